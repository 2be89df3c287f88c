"""Where a shard's bytes come from: the request body, an ``etl_fqn`` file, or an HTTP fetch.

Every source opens as a file object read by the shard's driver thread; ``replayable`` sources can be
read again (a retried direct put), the request body cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import BinaryIO

import httpx

from ..config import Settings
from ..errors import Cancelled, RequestError, UpstreamError
from ..redact import redact
from ..shards import readinto
from .hops import https_hint, no_secret
from .protocols import DirectSendProtocol, FlowControl

log = logging.getLogger("transformer.server")

_PIPE_BYTES = 1 << 20  # a body piped to a worker process: the pipe's size



class Source:
    """Where a shard's bytes come from. ``replayable`` sources can be read again for a retry."""

    replayable = True
    kind = "body"

    def open(self) -> contextlib.AbstractContextManager[BinaryIO]:
        raise NotImplementedError


class FileSource(Source):
    """A local file named by ``etl_fqn`` (already confined and decoded by ``fqn.resolve``)."""

    kind = "fqn"

    def __init__(self, path: str):
        self.path = path

    def open(self):
        return open(self.path, "rb", buffering=1024 * 1024)


class HttpSource(Source):
    """An object fetched over HTTP: hpull from ``AIS_TARGET_URL``, or a ``/download`` origin."""

    kind = "fetch"

    def __init__(self, client: httpx.Client, url: str, deadline: float):
        self.client, self.url, self.deadline = client, url, deadline

    @contextlib.contextmanager
    def open(self):
        remaining = max(0.1, self.deadline - time.monotonic())
        try:
            timeout = httpx.Timeout(remaining, connect=min(5.0, remaining))
            with self.client.stream("GET", self.url, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    status = 404 if r.status_code == 404 else 502
                    raise UpstreamError(f"GET {no_secret(self.url)}: {r.status_code} {redact(r.text)[:300]}", status)
                yield IteratorReader(r.iter_raw())
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"GET {no_secret(self.url)}: timed out ({exc.__class__.__name__})", 504) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"GET {no_secret(self.url)}: {exc.__class__.__name__}: {exc}"
                                f"{https_hint(self.url, exc)}", 502) from None


class ObjectFileSource(FileSource):
    """An ``etl_fqn`` file checked against the target's size of the object first (chunked objects).

    For a chunked AIS object only the first chunk lives at the FQN (core/ufest.go), so reading
    the file alone would transform a truncated shard. A ``HEAD`` of the object on the target
    (``AIS_TARGET_URL/<escaped uname>``, answered from metadata) gives its full size; when it differs
    from the file's, the object is fetched over HTTP instead. When the target cannot tell (HEAD
    failed), the file is read: the strict tar reader still refuses a shard cut short (422). With
    worker processes the worker leading the shard makes the check (``checked_file``).
    """

    def __init__(self, path: str, client: httpx.Client, object_url: str, deadline: float):
        super().__init__(path)
        self.client, self.object_url, self.deadline = client, object_url, deadline

    @contextlib.contextmanager
    def open(self):
        with open(self.path, "rb", buffering=1024 * 1024) as stream, \
                checked_file(stream, self.path, self.client, self.object_url, self.deadline) as checked:
            yield checked


@contextlib.contextmanager
def checked_file(stream: BinaryIO, path: str, client: httpx.Client, object_url: str, deadline: float):
    """``stream`` (an FQN's open file), or the object fetched from ``object_url`` when the target's size of it
    differs (``ObjectFileSource``)."""
    local = os.fstat(stream.fileno()).st_size
    size = _target_size(client, object_url, deadline, path)
    if size is None or size == local:
        yield stream
        return
    log.warning("etl_fqn %s has %d of the object's %d bytes (a chunked object); fetching %s over HTTP",
                path, local, size, no_secret(object_url))
    with HttpSource(client, object_url, deadline).open() as fetched:
        yield fetched


def _target_size(client: httpx.Client, object_url: str, deadline: float, path: str) -> int | None:
    remaining = max(0.1, deadline - time.monotonic())
    try:
        response = client.head(object_url, timeout=httpx.Timeout(min(5.0, remaining)))
    except httpx.HTTPError as exc:
        log.warning("etl_fqn %s: HEAD %s failed (%s); reading the file as is",
                    path, no_secret(object_url), exc.__class__.__name__)
        return None
    length = response.headers.get("content-length", "")
    if response.status_code != 200 or not length.isdigit():
        log.warning("etl_fqn %s: HEAD %s answered %d without a size; reading the file as is",
                    path, no_secret(object_url), response.status_code)
        return None
    return int(length)


class BytesSource(Source):
    """Bytes already in memory (a WebSocket content frame)."""

    def __init__(self, data: bytes):
        self.data = data

    def open(self):
        return io.BytesIO(self.data)


class BodySource(Source):
    """The request body, read from ASGI ``receive`` by the event loop and handed to the driver thread.

    One-shot: it cannot be replayed, which is why a failed direct put of a body-mode request is
    answered with AIS's 503 + ``Ais-Etl-Retry-Reason`` (the target then re-sends the body).

    ``pipe``: the body goes, as it arrives, into a pipe whose read end is a worker process's input
    (``take_read_end``), written by the event loop itself: no thread in between. With the service's
    protocol (``protocols.DirectSendProtocol.sink_body``) each chunk goes there straight from the HTTP
    parser (``feed``), without ASGI's copies and wake-ups, so the server process spends a system call
    per chunk on it (docs/performance.md, "Cores"); else ``pump`` writes what ``receive`` returns.
    """

    replayable = False

    _MAX_CHUNKS = 16  # body chunks buffered between the event loop and the driver (then TCP backpressure)

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: threading.Event, pipe: bool = False):
        self.loop, self.cancel = loop, cancel
        self.complete = threading.Event()  # the whole body has been received
        self._received = asyncio.Event()  # the same, or the caller went away (for the event loop)
        self._discard = False  # the transform has all it reads: what still arrives is dropped
        # A deque under a condition rather than an asyncio.Queue: the driver takes each chunk with a
        # lock, not with a coroutine scheduled on the event loop and waited for (run_coroutine_threadsafe
        # cost a loop wake-up and a future per 64 KB chunk).
        self._chunks_in: deque[bytes | Exception] = deque()
        self._ready = threading.Condition()
        self._room = asyncio.Event()
        self._room.set()
        self.error: BaseException | None = None  # why the body ended short (pipe mode)
        self._read_end: int | None = None
        self._write_end: int | None = None
        self._writable: asyncio.Future | None = None
        self._sunk = False  # the protocol feeds the pipe (sink_to)
        self._backlog: deque[memoryview] = deque()  # fed while the pipe was full
        self._flow: FlowControl | None = None  # the connection's reading, paused while there is a backlog
        self._finished = False
        if pipe:
            self._read_end, self._write_end = os.pipe2(os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # fewer, larger writes; the pipe's default is 64 KiB
                import fcntl

                fcntl.fcntl(self._write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            os.set_blocking(self._write_end, False)

    @property
    def piped(self) -> bool:
        return self._write_end is not None or self._read_end is not None

    def take_read_end(self) -> int:
        """The pipe's read end, for a worker process (the caller closes it once handed over)."""
        fd, self._read_end = self._read_end, None
        assert fd is not None, "a body source in pipe mode, read end taken once"
        return fd

    # -- pipe mode, fed by the connection's protocol (event loop) ---------------------------------------

    def sink_to(self, protocol: DirectSendProtocol) -> None:
        """Have ``protocol`` feed the body into the pipe as it parses it (``pump`` then only waits for its end)."""
        self._sunk = True
        protocol.sink_body(self)

    def feed(self, data: bytes, flow: FlowControl) -> None:
        if self._discard or self._write_end is None:
            return
        if self._backlog:
            self._backlog.append(memoryview(data))
            return
        try:
            written = os.write(self._write_end, data)
        except BlockingIOError:
            written = 0
        except OSError:  # EPIPE: the worker stopped reading; its report or error says why
            self._discard = True
            return
        if written < len(data):
            self._backlog.append(memoryview(data)[written:])
            self._flow = flow
            flow.pause_reading()  # TCP back-pressure until the worker read what waits
            self.loop.add_writer(self._write_end, self._drain)

    def _drain(self) -> None:
        while self._backlog and not self._discard and self._write_end is not None:
            try:
                written = os.write(self._write_end, self._backlog[0])
            except BlockingIOError:
                return
            except OSError:
                self._discard = True
                break
            first = self._backlog[0]
            if written < len(first):
                self._backlog[0] = first[written:]
                return
            self._backlog.popleft()
        self._unblock()
        if self._finished:
            self._close_pipe()

    def _unblock(self) -> None:
        self._backlog.clear()
        if self._write_end is not None:
            self.loop.remove_writer(self._write_end)
        if self._flow is not None:
            self._flow.resume_reading()
            self._flow = None

    def finish(self) -> None:
        self._finished = True
        self.complete.set()
        self._received.set()
        if not self._backlog:
            self._close_pipe()

    def fail(self) -> None:
        if self._finished:
            return
        self.error = Cancelled("caller disconnected while sending the body")
        self._received.set()
        self._unblock()
        self._close_pipe()

    # -- pipe mode, written by ``pump``; and the queue the driver thread reads -------------------------

    async def pump(self, receive: Callable, on_disconnect: Callable[[], None]) -> None:
        """Move body chunks to the driver or the pipe (awaiting room: TCP backpressure), then watch for disconnect.

        Fed by the protocol (``sink_to``), it only waits for the body's end: ``receive`` would resume reading
        the socket while the pipe is full."""
        if self._sunk:
            await self._received.wait()
            if self.error is not None:
                on_disconnect()
                return
            await watch_disconnect(receive, on_disconnect)
            return
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.error = Cancelled("caller disconnected while sending the body")
                    self._put(self.error, force=True)
                    self._received.set()
                    on_disconnect()
                    return
                body = message.get("body", b"")
                if body and not self._discard:
                    if self._write_end is not None:
                        await self._write(body)
                    else:
                        while not self._put(body) and not self._discard:
                            await self._room.wait()
                if not message.get("more_body", False):
                    self.complete.set()
                    self._received.set()
                    self._put(b"", force=True)
                    break
            self._close_pipe()  # the worker reads the body's end
            await watch_disconnect(receive, on_disconnect)
        finally:
            self._close_pipe()

    async def _write(self, data: bytes) -> None:
        """Into the pipe without blocking the loop: when it is full, wait until the worker read some."""
        view = memoryview(data)
        while view and not self._discard and self._write_end is not None:
            try:
                view = view[os.write(self._write_end, view):]
            except BlockingIOError:
                self._writable = self.loop.create_future()
                self.loop.add_writer(self._write_end, self._wake_writer)
                try:
                    await self._writable
                finally:
                    self.loop.remove_writer(self._write_end)
                    self._writable = None
            except OSError:  # EPIPE: the worker stopped reading; its report or error says why
                self._discard = True

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _close_pipe(self) -> None:
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None

    def close(self) -> None:
        """The response ended: a pipe's read end never handed over is closed (event loop)."""
        if self._sunk:
            self._unblock()
        self._close_pipe()
        if self._read_end is not None:
            os.close(self._read_end)
            self._read_end = None

    async def received(self, timeout: float) -> bool:
        """Before the response ends: wait (up to ``timeout`` s) until the whole body has arrived, dropping
        what the transform did not read (a tar's padding after its end-of-archive blocks).

        A server that ends its response while the caller is still sending closes (``Connection:
        close``) a socket with unread bytes, or gets them after closing; either way the kernel answers
        with a reset and throws away the end of the response still in its send buffer. A caller that
        sends and reads at once (the previous stage of a pipeline) would get a response cut short.
        """
        self._discard = True
        self._wake_writer()
        if self._sunk:
            self._unblock()  # what still arrives is read and dropped
        with self._ready:
            self._chunks_in.clear()
        self._room.set()
        try:
            await asyncio.wait_for(self._received.wait(), max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def _put(self, item: bytes | Exception, force: bool = False) -> bool:
        """Event loop: queue ``item``; False (and ``_room`` cleared) when full, unless ``force``."""
        with self._ready:
            if len(self._chunks_in) >= self._MAX_CHUNKS and not force:
                self._room.clear()  # under the lock: the driver's wake-up below cannot be lost
                return False
            self._chunks_in.append(item)
            self._ready.notify()
            return True

    def open(self):
        return IteratorReader(self._chunks())

    def _chunks(self) -> Iterator[bytes]:
        while True:
            with self._ready:
                while not self._chunks_in:
                    if not self._ready.wait(0.2) and self.cancel.is_set():
                        raise Cancelled("cancelled while reading the request body")
                item = self._chunks_in.popleft()
                if not self._room.is_set() and len(self._chunks_in) < self._MAX_CHUNKS // 2:
                    self.loop.call_soon_threadsafe(self._room.set)
            if isinstance(item, Exception):
                raise item
            if item == b"":
                return
            yield item


async def watch_disconnect(receive: Callable, on_disconnect: Callable[[], None]) -> None:
    """After the body: ``receive`` returns ``http.disconnect`` only when the caller goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class IteratorReader:
    """A read-only file object over an iterator of byte chunks (what ``tarfile`` stream mode needs)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = iter(chunks)
        self._buffer = memoryview(b"")
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            parts = [bytes(self._buffer)] + list(self._chunks)
            self._buffer = memoryview(b"")
            data = b"".join(parts)
            self.bytes_read += len(data)
            return data
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._buffer = memoryview(chunk)
        data = bytes(self._buffer[:size])
        self._buffer = self._buffer[size:]
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer) -> int:
        """Up to ``len(buffer)`` bytes from the current chunk (the next one when it is used up)."""
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._buffer = memoryview(chunk)
        count = min(len(buffer), len(self._buffer))
        buffer[:count] = self._buffer[:count]
        self._buffer = self._buffer[count:]
        self.bytes_read += count
        return count

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Counting:
    """Counts bytes read through any file object (bytes-in metric) and enforces ETL_MAX_SHARD_BYTES."""

    def __init__(self, stream: BinaryIO, shard: str, limit: int):
        self._stream, self.count = stream, 0
        self.shard, self.limit = shard, limit

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._counted(len(data))
        return data

    def readinto(self, buffer) -> int:
        return self._counted(readinto(self._stream, buffer))

    def _counted(self, count: int) -> int:
        self.count += count
        if self.count > self.limit:
            raise shard_too_large(self.shard, self.count, self.limit)
        return count


def shard_too_large(shard: str, size: int, limit: int) -> RequestError:
    return RequestError(f"shard '{shard}': {size} bytes or more, over the limit of {limit} (ETL_MAX_SHARD_BYTES)",
                        status=413)


def fqn_source(raw: str, settings: Settings, client: httpx.Client, deadline: float, *, shard: str,
               object_name: str, uname: str | None = None) -> FileSource:
    """The input named by ``etl_fqn``: decoded, confined, size-limited, and chunk-checked when possible.

    The chunk check asks the target (``AIS_TARGET_URL``) with ``client``; ``uname`` is the object's uname
    when the request carries it exactly (hpull), otherwise it is derived from the FQN and ``object_name``.
    """
    from ..wire import path_escape
    from .fqn import object_uname, resolve_fqn

    path = resolve_fqn(raw, settings.fqn_roots)
    size = os.path.getsize(path)
    if size > settings.max_shard_bytes:
        raise shard_too_large(shard, size, settings.max_shard_bytes)
    if not settings.ais_target_url:
        return FileSource(path)
    uname = uname or object_uname(path, object_name)
    return ObjectFileSource(path, client, f"{settings.ais_target_url}/{path_escape(uname)}", deadline)


def target_client(settings: Settings) -> httpx.Client:
    """The client for AIS targets (hpull fetch, size check, direct put): the server's and each worker's."""
    # TLS to AIS targets (hpull fetch, size check, direct put): AIS_CLIENT_CA, AIS_SKIP_VERIFY_CRT and the
    # client certificate AIS_CRT + AIS_CRT_KEY (mutual TLS), checked when the settings were read.
    verify = settings.ais_tls()
    # Idle connections expire before the target's own 6 s idle timeout would close them under us.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=4.0)
    return httpx.Client(verify=verify, limits=limits, follow_redirects=False, timeout=settings.obj_timeout)


def origin_client(settings: Settings) -> httpx.Client:
    """The client for ``/download`` origins."""
    # /download origins are any host (a web server, a cloud bucket's URL): verified against the default
    # bundle plus AIS_CLIENT_CA, never skip-verify, never the AIS client certificate, redirects followed.
    return httpx.Client(verify=settings.origin_tls(), follow_redirects=True, timeout=settings.obj_timeout)
