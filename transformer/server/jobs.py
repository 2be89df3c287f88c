"""One shard request in flight: its input source, its driver thread, and the hand-off to the event loop.

Each request gets a driver thread that reads the input, runs ``engine.transform_shard`` (which fans
samples out to the shared ``TransformPool``) and sends the output to the next hop, or to the caller:
after the first chunk it and the transform threads write the response body to the socket themselves
(direct send, direct.py; engine._Relay), or it hands chunks to the event loop through an asyncio queue.
The event loop never parses, decodes or waits on CPU work, which keeps ``/health`` answering while
every core is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import httpx

from ..config import Settings
from ..engine import ShardReport, TransformPool, Write, transform_shard
from ..errors import Cancelled, RequestError, TransformerError, UpstreamError
from ..options import TransformOptions
from ..shards import readinto
from .direct import DirectSender
from .duplex import duplex_put
from .hops import (
    HEADER_DIRECT_PUT_LENGTH,
    HEADER_NODE_URL,
    HEADER_RETRY_REASON,
    RETRY_REASON_TRANSIENT,
    DirectPutTarget,
    EtlStage,
    NextHop,
    https_hint,
    put_stream,
)
from .metrics import Metrics

log = logging.getLogger("transformer.server")

_OUTPUT_QUEUE_CHUNKS = 8  # chunks buffered between the driver thread and the socket (backpressure)


@dataclass
class Runtime:
    """Process-wide state shared by all requests."""

    settings: Settings
    pool: TransformPool
    client: httpx.Client  # thread-safe; used from driver threads only
    metrics: Metrics


# ---------------------------------------------------------------------------------------------- sources


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
                    raise UpstreamError(f"GET {_no_secret(self.url)}: {r.status_code} {r.text[:300]}", status)
                yield _IteratorReader(r.iter_raw())
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"GET {_no_secret(self.url)}: timed out ({exc.__class__.__name__})", 504) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"GET {_no_secret(self.url)}: {exc.__class__.__name__}: {exc}"
                                f"{https_hint(self.url, exc)}", 502) from None


class ObjectFileSource(FileSource):
    """An ``etl_fqn`` file checked against the target's size of the object first (chunked objects).

    For a chunked AIS object only the first chunk lives at the FQN (core/ufest.go), so reading
    the file alone would transform a truncated shard. A ``HEAD`` of the object on the target
    (``AIS_TARGET_URL/<escaped uname>``, answered from metadata) gives its full size; when it differs
    from the file's, the object is fetched over HTTP instead. When the target cannot tell (HEAD
    failed), the file is read: the strict tar reader still refuses a shard cut short (422).
    """

    def __init__(self, path: str, client: httpx.Client, object_url: str, deadline: float):
        super().__init__(path)
        self.client, self.object_url, self.deadline = client, object_url, deadline

    @contextlib.contextmanager
    def open(self):
        local = os.path.getsize(self.path)
        size = self._target_size()
        if size is None or size == local:
            with open(self.path, "rb", buffering=1024 * 1024) as stream:
                yield stream
            return
        log.warning("etl_fqn %s has %d of the object's %d bytes (a chunked object); fetching %s over HTTP",
                    self.path, local, size, _no_secret(self.object_url))
        with HttpSource(self.client, self.object_url, self.deadline).open() as stream:
            yield stream

    def _target_size(self) -> int | None:
        remaining = max(0.1, self.deadline - time.monotonic())
        try:
            response = self.client.head(self.object_url, timeout=httpx.Timeout(min(5.0, remaining)))
        except httpx.HTTPError as exc:
            log.warning("etl_fqn %s: HEAD %s failed (%s); reading the file as is",
                        self.path, _no_secret(self.object_url), exc.__class__.__name__)
            return None
        length = response.headers.get("content-length", "")
        if response.status_code != 200 or not length.isdigit():
            log.warning("etl_fqn %s: HEAD %s answered %d without a size; reading the file as is",
                        self.path, _no_secret(self.object_url), response.status_code)
            return None
        return int(length)


class BytesSource(Source):
    """Bytes already in memory (a WebSocket content frame)."""

    def __init__(self, data: bytes):
        self.data = data

    def open(self):
        import io

        return io.BytesIO(self.data)


class BodySource(Source):
    """The request body, read from ASGI ``receive`` by the event loop and handed to the driver thread.

    One-shot: it cannot be replayed, which is why a failed direct put of a body-mode request is
    answered with AIS's 503 + ``Ais-Etl-Retry-Reason`` (the target then re-sends the body).
    """

    replayable = False

    _MAX_CHUNKS = 16  # body chunks buffered between the event loop and the driver (then TCP backpressure)

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: threading.Event):
        self.loop, self.cancel = loop, cancel
        self.complete = threading.Event()  # the whole body has been received
        # A deque under a condition rather than an asyncio.Queue: the driver takes each chunk with a
        # lock, not with a coroutine scheduled on the event loop and waited for (run_coroutine_threadsafe
        # cost a loop wake-up and a future per 64 KB chunk).
        self._chunks_in: deque[bytes | Exception] = deque()
        self._ready = threading.Condition()
        self._room = asyncio.Event()
        self._room.set()

    async def pump(self, receive: Callable, on_disconnect: Callable[[], None]) -> None:
        """Move body chunks to the driver (awaiting room: TCP backpressure), then watch for disconnect."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._put(Cancelled("caller disconnected while sending the body"), force=True)
                on_disconnect()
                return
            body = message.get("body", b"")
            if body:
                while not self._put(body):
                    await self._room.wait()
            if not message.get("more_body", False):
                self.complete.set()
                self._put(b"", force=True)
                break
        await watch_disconnect(receive, on_disconnect)

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
        return _IteratorReader(self._chunks())

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


class _IteratorReader:
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


class _Counting:
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


def _no_secret(url: str) -> str:
    """A URL fit for logs and error bodies: the ETL secret of AIS_TARGET_URL is not repeated."""
    marker = "/v1/etl/_object/"
    if marker in url:
        head, tail = url.split(marker, 1)
        parts = tail.split("/", 2)
        if len(parts) == 3:
            return f"{head}{marker}{parts[0]}/***/{parts[2]}"
    return url


# ----------------------------------------------------------------------------------------------- jobs


@dataclass
class Final:
    """A complete answer (no streamed body): 204 after direct put, or an error status."""

    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None


class _Spill:
    """Output parked on disk (unlinked temp file) while a half-duplex caller is still sending."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="wds-transform-spill-")
        self._written = 0
        self._pending = 0
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, chunk: bytes | memoryview) -> _Spilled:
        offset = self._written
        self._file.write(chunk)
        self._file.flush()
        self._written += len(chunk)
        with self._lock:
            self._pending += 1
        return _Spilled(self, offset, len(chunk))

    def consumed(self) -> None:
        with self._lock:
            self._pending -= 1

    def drained(self) -> bool:
        with self._lock:
            return self._pending == 0

    def close(self) -> None:
        self._file.close()


@dataclass
class _Spilled:
    spill: _Spill
    offset: int
    length: int


class ShardJob:
    """Transforms one shard in a driver thread; the event loop consumes ``next_item()``."""

    def __init__(self, runtime: Runtime, source: Source, options: TransformOptions, *, shard: str,
                 object_name: str, hop: NextHop | None, comm: str, cancel: threading.Event | None = None):
        self.runtime, self.source, self.options = runtime, source, options
        self.shard, self.object_name, self.hop, self.comm = shard, object_name, hop, comm
        self.cancel = cancel or threading.Event()
        self.report = ShardReport(shard, object_name, options.on_error)
        self.deadline = time.monotonic() + runtime.settings.obj_timeout
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(_OUTPUT_QUEUE_CHUNKS)
        self._spill: _Spill | None = None
        self.bytes_in = 0
        # Direct send (direct.py): set by the response before start(); the driver waits on it after its
        # first chunk, then writes the rest itself if ``direct`` was given.
        self.handoff: threading.Event | None = None
        self.direct: DirectSender | None = None
        self._direct_lock = threading.Lock()
        self._handed_off = False
        self._finished = False
        self.send_path = "loop"

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"shard {self.shard}", daemon=True).start()

    async def next_item(self):
        """A chunk (bytes), a ``Final``, an exception, or ``None`` at the end of a streamed body."""
        item = await self._items.get()
        if isinstance(item, bytes | memoryview):
            self._room.release()
        elif isinstance(item, _Spilled):
            data = await asyncio.to_thread(os.pread, item.spill.fileno(), item.length, item.offset)
            item.spill.consumed()
            return data
        return item

    def go_direct(self, make: Callable[[], DirectSender] | None) -> None:
        """Event loop, after the first chunk went out: the driver sends the rest (``make`` None: it does not)."""
        with self._direct_lock:
            if make is not None and not self._finished:
                try:
                    self.direct = make()
                    self.send_path = "direct"
                except OSError as exc:  # the connection closed in the meantime: the ASGI path reports it
                    log.info("shard %s: direct send unavailable (%s)", self.shard, exc)
        if self.handoff is not None:
            self.handoff.set()

    # -- driver thread ---------------------------------------------------------------------------

    def _send(self, chunk: bytes | memoryview) -> None:
        """One output chunk to the caller: written here (direct send) or handed to the event loop."""
        direct = self.direct
        if direct is not None:
            if not direct.send(chunk, self._check_cancel, lambda: not self._body_complete()):
                self._leave_direct()
            return
        self._emit_chunk(chunk)
        if self.handoff is not None and not self._handed_off:  # first chunk: wait for go_direct()
            self._handed_off = True
            while not self.handoff.wait(0.1):
                self._check_cancel()

    def _try_write(self, chunk: bytes | memoryview) -> Write:
        """A chunk written by a transform thread (``engine._Relay``): only on the direct socket, never waiting.

        Before the first chunk went out through the response (and ``go_direct``), and after leaving
        direct send, it is refused: the driver writes, as ``_send`` does.
        """
        direct = self.direct
        if direct is None or not self._handed_off:
            return Write.REFUSED
        done = direct.try_send(chunk)
        if done is not Write.REFUSED:
            self.report.bytes_out += len(chunk)
        return done

    def _check_cancel(self) -> None:
        """While the driver waits for the caller to take output: gone, or past the object timeout."""
        if self.cancel.is_set():
            raise Cancelled(f"shard '{self.shard}': caller went away")
        if time.monotonic() > self.deadline:  # a caller that stopped reading must not pin the window
            raise TransformerError(f"shard '{self.shard}': object timeout exceeded while the caller was not "
                                   f"reading the output ({self.report.samples_out} samples sent)")

    def _end_body(self) -> None:
        """The whole body was sent: what direct send holds goes out, then the event loop ends the body.

        (For a ws reply the held tail goes through the event loop: it is the message's last frame.)
        """
        direct = self.direct
        if direct is not None:
            tail = direct.take_tail()
            if not direct.flush(self._check_cancel, lambda: not self._body_complete()):
                self._leave_direct()
            if tail:
                self._emit_chunk(tail)
        self._emit(None)

    def _leave_direct(self) -> None:
        # The caller stopped reading while it still sends (half-duplex): the frame's rest went to the
        # transport; from here on the event loop sends, spilling to disk while it must.
        log.info("shard %s: caller is not reading yet; leaving direct send", self.shard)
        self.send_path = "direct_then_loop"
        self._close_direct()

    def _fail(self, exc: BaseException) -> None:
        # Direct send ends first: what it hands to the transport (the rest of a ws frame cut short)
        # must go out before the error's own bytes (a ws reply's last frame, with the error text).
        self._close_direct()
        self._emit(exc)

    def _close_direct(self) -> None:
        with self._direct_lock:
            direct, self.direct = self.direct, None
        if direct is not None:
            direct.close()

    def _emit(self, item) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    def _emit_chunk(self, chunk) -> None:
        spill = self._spill
        if spill is not None and spill.drained() and self._body_complete():
            spill.close()  # the caller caught up and the input is in: back to in-memory backpressure
            spill = self._spill = None
        if spill is None:
            while not self._room.acquire(timeout=0.2):
                self._check_cancel()
                if not self._body_complete():
                    # The caller is not reading while it still sends: a half-duplex client (requests,
                    # httpx, the SDK's pipeline stages) would deadlock with us. Keep consuming input.
                    spill = self._spill = _Spill()
                    log.info("shard %s: caller is not reading yet; spilling output to disk", self.shard)
                    break
            else:
                self._emit(chunk)
                return
        self._emit(spill.write(chunk))

    def _body_complete(self) -> bool:
        return not isinstance(self.source, BodySource) or self.source.complete.is_set()

    def _output(self, writer: Callable[[bytes | memoryview], Write] | None = None) -> Iterator[bytes | memoryview]:
        """The transformed shard; opening the source again on every call (for retries).

        With ``writer``, the transform threads write what they can themselves (direct send); the rest
        is yielded.
        """
        self.report = ShardReport(self.shard, self.object_name, self.options.on_error)
        with self.source.open() as stream:
            counted = _Counting(stream, self.shard, self.runtime.settings.max_shard_bytes)
            chunks = transform_shard(
                counted, self.options, self.runtime.pool, shard=self.shard, object_name=self.object_name,
                window=self.runtime.settings.window, report=self.report, cancel=self.cancel,
                deadline=self.deadline, writer=writer,
            )
            try:
                with contextlib.closing(chunks):  # its end stops the transform threads' writes, when we end
                    for chunk in chunks:
                        if self.report.first_byte is None:
                            self.report.first_byte = time.monotonic()
                        self.report.bytes_out += len(chunk)
                        yield chunk
            finally:
                self.bytes_in += counted.count

    def _run(self) -> None:
        metrics = self.runtime.metrics
        metrics.inflight.inc()
        outcome = "error"
        try:
            if self.hop is None:
                # A response that may go direct: the transform threads write to the socket themselves.
                # Closed here, not when collected: no transform thread may write once the job ends.
                with contextlib.closing(self._output(self._try_write if self.handoff is not None else None)) as out:
                    for chunk in out:
                        self._send(chunk)
                self._end_body()
            elif isinstance(self.hop, DirectPutTarget):
                self._emit(self._direct_put(self.hop))
            else:
                self._to_stage(self.hop)
            outcome = "ok"
        except Cancelled as exc:
            outcome = "cancelled"
            log.info("shard %s: caller went away; work stopped", self.shard)
            self._fail(exc)  # ends the response coroutine too, whether or not the response had started
        except TransformerError as exc:
            log.warning("%s", exc.message)
            self._fail(exc)
        except Exception as exc:  # a bug: report it as a 500 with the reason, keep serving
            log.exception("shard %s: unexpected error", self.shard)
            self._fail(TransformerError(f"shard '{self.shard}': internal error: {exc!r}"))
        finally:
            with self._direct_lock:
                self._finished = True
            self._close_direct()
            if self.report.first_byte is not None and not isinstance(self.hop, DirectPutTarget):
                metrics.send_path.labels(self.send_path).inc()
            metrics.record(self.report, self.comm, outcome, self.bytes_in)
            metrics.inflight.dec()  # last: no shard in flight means every finished one is counted

    def _direct_put(self, hop: DirectPutTarget) -> Final:
        try:
            response = put_stream(self.runtime.client, hop.url, self._output, headers={},
                                  deadline=self.deadline, replayable=self.source.replayable)
        except UpstreamError as exc:
            if not self.source.replayable and exc.status >= 500 and exc.status != 504 and exc.transient:
                # The target re-sends a replayable body when asked this way (ext/etl/communicator.go).
                return Final(503, exc.message.encode(), {HEADER_RETRY_REASON: RETRY_REASON_TRANSIENT})
            raise
        with contextlib.closing(response):  # httpx.Response is no context manager
            response.read()
        if response.status_code == 200:
            return Final(204, b"", {HEADER_DIRECT_PUT_LENGTH: str(self.report.bytes_out)})
        # Propagate the destination's refusal (never a 204): AIS records it as the object's error.
        return Final(response.status_code, response.content or f"direct put failed: {response.status_code}".encode())

    def _to_stage(self, hop: EtlStage) -> None:
        headers = {HEADER_NODE_URL: hop.remaining} if hop.remaining else {}
        # Full duplex: a streaming stage answers while it still reads (see duplex.py); stage URLs carry no secret.
        response = duplex_put(hop.url, self._output(), headers, self.deadline, shown_url=hop.url.split("?")[0])
        with contextlib.closing(response):
            if response.status_code == 200:
                for chunk in response.iter_bytes():
                    self._send(chunk)
                self._end_body()
            elif response.status_code == 204:
                length = response.headers.get(HEADER_DIRECT_PUT_LENGTH)
                self._emit(Final(204, b"", {HEADER_DIRECT_PUT_LENGTH: length} if length else None))
            else:
                self._emit(Final(response.status_code, response.read()))


def fqn_source(raw: str, runtime: Runtime, deadline: float, *, shard: str, object_name: str,
               uname: str | None = None) -> FileSource:
    """The input named by ``etl_fqn``: decoded, confined, size-limited, and chunk-checked when possible.

    The chunk check needs the target (``AIS_TARGET_URL``); ``uname`` is the object's uname when the
    request carries it exactly (hpull), otherwise it is derived from the FQN and ``object_name``.
    """
    from .fqn import object_uname, path_escape, resolve_fqn

    settings = runtime.settings
    path = resolve_fqn(raw, settings.fqn_roots)
    size = os.path.getsize(path)
    if size > settings.max_shard_bytes:
        raise shard_too_large(shard, size, settings.max_shard_bytes)
    if not settings.ais_target_url:
        return FileSource(path)
    uname = uname or object_uname(path, object_name)
    return ObjectFileSource(path, runtime.client, f"{settings.ais_target_url}/{path_escape(uname)}", deadline)

