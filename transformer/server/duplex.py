"""Full-duplex HTTP/1.1 PUT, for the hop to the next ETL stage of a pipeline.

Written by hand on purpose: httpx/httpcore send the whole request body before reading the response.
A next stage that streams (as this transformer does) starts answering before it has read all of its
input; once the buffers in both directions are full, each side waits for the other and the pipeline
hangs until ``obj_timeout`` (docs/reliability.md). Here a sender thread writes the body (chunked
framing) while the caller reads the response; h11, httpx's own HTTP/1.1 parser, parses the response.
``tests/contract/test_direct_put.py`` pipes a large shard through two real servers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

import h11

from ..errors import Cancelled, TransformerError, UpstreamError

_RECV = 256 * 1024


class DuplexResponse:
    """The stage's answer: status, headers, and its body as an iterator (read once)."""

    def __init__(self, status_code: int, headers: dict[str, str], chunks: Iterator[bytes], closer):
        self.status_code, self.headers, self._chunks, self._closer = status_code, headers, chunks, closer

    def iter_bytes(self) -> Iterator[bytes]:
        yield from self._chunks

    def read(self) -> bytes:
        return b"".join(self._chunks)

    def close(self) -> None:
        self._closer()


def duplex_put(url: str, body: Iterable[bytes | memoryview], headers: dict[str, str], deadline: float,
               shown_url: str) -> DuplexResponse:
    """PUT ``body`` to an ``http://`` URL while reading the response; retries only failed connects."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise UpstreamError(f"PUT {shown_url}: ETL stages are reached over http:// only (AIS sets the scheme)", 502)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sock = _connect(parts.hostname or "", parts.port or 80, deadline, shown_url)
    connection = h11.Connection(h11.CLIENT)
    request = h11.Request(method="PUT", target=target, headers=[
        ("Host", parts.netloc), ("Transfer-Encoding", "chunked"), ("Connection", "close"), *headers.items()])
    failure: list[BaseException] = []

    def send_body() -> None:
        try:
            sock.sendall(connection.send(request))
            for chunk in body:
                if len(chunk):
                    sock.sendall(b"%x\r\n" % len(chunk))
                    sock.sendall(chunk)
                    sock.sendall(b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except BaseException as exc:  # our transform failed, or the stage stopped reading
            failure.append(exc)
            _shutdown(sock)  # the stage sees a cut body: it must never store a truncated object

    sender = threading.Thread(target=send_body, name="stage-sender", daemon=True)
    sender.start()

    def next_event():
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UpstreamError(f"PUT {shown_url}: object timeout exceeded", 504)
            sock.settimeout(remaining)
            try:
                data = sock.recv(_RECV)
            except TimeoutError:
                raise UpstreamError(f"PUT {shown_url}: timed out", 504) from None
            except OSError as exc:
                raise _ours_or(failure, UpstreamError(f"PUT {shown_url}: {exc.__class__.__name__}: {exc}")) from None
            connection.receive_data(data)

    def finish() -> None:
        _shutdown(sock)
        sock.close()
        sender.join(timeout=5)

    try:
        event = next_event()
        while isinstance(event, h11.InformationalResponse):
            event = next_event()
    except h11.RemoteProtocolError as exc:
        finish()
        raise _ours_or(failure, UpstreamError(f"PUT {shown_url}: {exc}")) from None
    except BaseException:
        finish()
        raise
    if not isinstance(event, h11.Response):
        finish()
        raise _ours_or(failure, UpstreamError(f"PUT {shown_url}: connection closed before a response"))
    response_headers = {k.decode("latin-1").title(): v.decode("latin-1") for k, v in event.headers}

    def chunks() -> Iterator[bytes]:
        try:
            while True:
                try:
                    item = next_event()
                except h11.RemoteProtocolError as exc:
                    raise _ours_or(failure, UpstreamError(f"PUT {shown_url}: {exc}")) from None
                if isinstance(item, h11.Data):
                    yield bytes(item.data)
                elif isinstance(item, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            sender.join(timeout=max(0.0, deadline - time.monotonic()))
            ours = [f for f in failure if isinstance(f, TransformerError)]
            if ours:  # the stage answered in full, but our own output failed: never pass it on as complete
                raise ours[0]
        finally:
            finish()

    return DuplexResponse(event.status_code, response_headers, chunks(), finish)


def _connect(host: str, port: int, deadline: float, shown_url: str) -> socket.socket:
    attempt = 0
    while True:
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=min(5.0, max(0.1, remaining)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            attempt += 1
            delay = min(0.25 * 2 ** (attempt - 1), 4.0)
            if time.monotonic() + delay >= deadline:
                raise UpstreamError(f"PUT {shown_url}: ConnectError: cannot connect ({exc})", 502) from None
            time.sleep(delay)


def _ours_or(failure: list[BaseException], error: UpstreamError) -> BaseException:
    """Our own failure (a bad shard, a cancel) explains a broken exchange better than the socket error."""
    for exc in failure:
        if isinstance(exc, TransformerError | Cancelled):
            return exc
    return error


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
