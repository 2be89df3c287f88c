"""One shard response's output, from the status line to the last byte: ``Output``.

Two threads meet here. The shard's driver thread produces the output (``write``, ``end``, ``fail``,
``answer``); the event loop consumes it (``next``) and sends it: an HTTP response through ASGI
(``respond_http``) or a ws reply as a fragmented Binary message (``WsReply``). This module is the only
place that writes a response's bytes, and at any moment one thread does:

* **The status line waits for the first chunk** (or a complete answer: a 204 after a direct put, an
  error), so an unreadable shard or a bad first sample is still a proper 4xx/5xx.
* **Back-pressure.** At most ``_QUEUE_CHUNKS`` chunks wait for the event loop; the driver then waits
  for room, and the window stops refilling. A half-duplex caller (one that reads the response only
  after sending the whole body: requests, httpx, the SDK's pipeline stages) would deadlock with that,
  so while the body is still arriving, output that finds no room is parked in an unlinked temp file
  (``_Spill``) and read back by the event loop in order.
* **Direct send.** Through ASGI every chunk crosses to the event loop, which frames it (uvicorn joins
  the chunk-size line, the array and the CRLF into a new bytes object) and writes it holding the GIL,
  while the transform threads wait for it. So once the first chunk went out through uvicorn and its
  write buffer is empty, the shard's own threads write the rest of the body (``DirectSender``:
  ``sendmsg`` on a duplicate of the socket, the GIL released, no copy in Python). The transform
  thread that completes the oldest unwritten sample writes it through ``try_write``, never waiting
  (the engine's relay gives the writer role to one thread at a time); when the socket is full the
  role passes to the driver thread, which waits in ``write``. The end goes back to the event loop, so
  uvicorn's or websockets' state (keep-alive, the final chunk, the frame with FIN, the abort on
  failure) stays exactly theirs. A frame that stays unwritten for ``STALL_SECONDS`` while the body is
  still arriving goes to uvicorn's transport and the output returns to the event loop's path (the
  half-duplex caller again). docs/performance.md measures both choices.
* **Never over TLS**: only the transport's SSL object may write a TLS connection's socket, so such a
  connection always takes the event loop's path (``encrypted``).
* **Finish and abort.** ``End`` ends the body; a ``Failure`` after the status line raises
  ``StreamAborted`` out of the ASGI call, so uvicorn drops the connection without the final chunk (the
  caller sees a broken transfer, never a cleanly terminated, truncated tar). A ws reply that fails
  after its first frame ends with a last frame carrying the error JSON, once a frame cut short was
  completed, so the connection stays usable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from uvicorn.protocols.utils import ClientDisconnected
from websockets.exceptions import InvalidState

from ..engine import Write
from ..errors import Cancelled, InternalError, TransformerError, UpstreamError
from ..redact import redact_bytes
from .protocols import FragmentingWebSocketProtocol, encrypted

log = logging.getLogger("transformer.server")

TAR_CONTENT_TYPE = "application/x-tar"
STALL_SECONDS = 0.2  # a frame not accepted by the socket for this long, with the body still arriving
_QUEUE_CHUNKS = 8  # chunks waiting for the event loop before the driver waits (back-pressure)
_POLL = 0.05  # how often a blocked send checks for cancellation and stalls
HOLD = 64 * 1024  # chunks smaller than this may wait for the next one (DirectSender.send)
_HOLD_COUNT = 64  # and at most this many (sendmsg takes at most IOV_MAX = 1024 buffers)


# ------------------------------------------------------------------------------------------- items


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes of the body."""

    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class End:
    """The body is complete."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The job failed; before the first chunk an error answer, after it an abort."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Final:
    """A complete answer with no streamed body: 204 after a direct put, or a next hop's status."""

    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None


Item = Chunk | End | Failure | Final
END = End()


class StreamAborted(Exception):
    """Raised out of the ASGI app so the server drops the connection mid-body (on purpose).

    ``foreseen``: the failure is one the service answers this way by design (a ``TransformerError``:
    a sample under ``on_error=fail``, the rest of the shard unreadable, the object timeout, the caller
    gone), which its job logged as one line; the server's record of the exception, a traceback under
    "Exception in ASGI application", is then left out (``ForeseenAbortFilter``). A bug keeps it.
    """

    def __init__(self, message: str, foreseen: bool = False):
        super().__init__(message)
        self.foreseen = foreseen


class ForeseenAbortFilter(logging.Filter):
    """Leaves out the ASGI server's record of a foreseen ``StreamAborted`` (on uvicorn's error logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, StreamAborted) and error.foreseen)


def quiet_foreseen_aborts(logger: logging.Logger) -> None:
    """``ForeseenAbortFilter`` on ``logger``, once."""
    if not any(isinstance(f, ForeseenAbortFilter) for f in logger.filters):
        logger.addFilter(ForeseenAbortFilter())


# ------------------------------------------------------------------------------------------ output


class Output:
    """Where one shard job's output goes; built on the event loop before the job starts.

    ``cancel`` is set when the caller goes away (and by the response when it ends); ``deadline`` is
    the object timeout (``time.monotonic``); ``input_done`` is set once the request body has arrived
    (None: the input is not the body). ``may_go_direct``: the response will offer the socket after
    the first chunk (``go_direct``), so the driver waits for that decision once.
    """

    def __init__(self, shard: str, *, cancel: threading.Event, deadline: float,
                 input_done: threading.Event | None = None, may_go_direct: bool = False):
        self.shard, self.cancel, self.deadline = shard, cancel, deadline
        self._input_done = input_done
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Item | _Spilled] = asyncio.Queue()
        self._room = threading.Semaphore(_QUEUE_CHUNKS)
        self._spill: _Spill | None = None
        self.may_go_direct = may_go_direct
        self._awaiting_offer = may_go_direct  # the driver waits for go_direct after its first chunk
        self._handoff = threading.Event()
        self._offered: tuple[asyncio.Transport, bool] | None = None  # (transport, ws frames) from go_direct
        self._sender: DirectSender | None = None  # used by the driver thread only
        self.bytes_written = 0
        self.send_path = "loop"  # the etl_send_path metric: loop, direct, direct_then_loop

    # -- driver thread ---------------------------------------------------------------------------

    def write(self, chunk: bytes | memoryview) -> None:
        """One chunk of the body: on the socket (direct send), or to the event loop."""
        self.bytes_written += len(chunk)
        sender = self._sender
        if sender is not None:
            if not sender.send(chunk, self.check, self._input_pending):
                self._leave_direct()
            return
        self._queue(chunk)
        if self._awaiting_offer:
            self._awaiting_offer = False
            self._take_socket()

    def try_write(self, chunk: bytes | memoryview) -> Write:
        """A chunk from a transform thread (the engine's ``writer``): on the socket, never waiting.

        Only while direct send is on: before the first chunk went out through the server, and after
        leaving direct send, it is refused and the driver writes it with ``write``. The engine lets
        one thread write at a time, and none once the driver has the role, so the driver alone
        opens and closes the sender.
        """
        sender = self._sender
        if sender is None:
            return Write.REFUSED
        done = sender.try_send(chunk)
        if done is not Write.REFUSED:
            self.bytes_written += len(chunk)
        return done

    def end(self) -> None:
        """The whole body was written. A ws reply's held tail goes through the event loop: it is the
        message's last frame."""
        sender = self._sender
        if sender is not None:
            tail = sender.take_tail()
            if not sender.flush(self.check, self._input_pending):
                self._leave_direct()
            self._close_sender()
            if tail:
                self._queue(tail)
        self._put(END)

    def fail(self, error: BaseException) -> None:
        # Direct send ends first: what it hands to the transport (the rest of a ws frame cut short)
        # must go out before the error's own bytes.
        self._close_sender()
        self._put(Failure(error))

    def answer(self, final: Final) -> None:
        self._put(final)

    def close(self) -> None:
        """The job is over: no thread writes to the socket any more (idempotent)."""
        self._close_sender()

    def check(self) -> None:
        """While the driver waits for the caller to take output: gone, or past the object timeout."""
        if self.cancel.is_set():
            raise Cancelled(f"shard '{self.shard}': caller went away")
        if time.monotonic() > self.deadline:  # a caller that stopped reading must not pin the window
            raise TransformerError(f"shard '{self.shard}': object timeout exceeded while the caller was not "
                                   f"reading the output ({self.bytes_written} bytes produced)")

    def _input_pending(self) -> bool:
        return self._input_done is not None and not self._input_done.is_set()

    def _take_socket(self) -> None:
        """After the first chunk: wait for the event loop's ``go_direct``, then write from here if offered."""
        while not self._handoff.wait(0.1):
            self.check()
        if self._offered is None:
            return
        transport, ws = self._offered
        try:
            if ws:
                self._sender = DirectSender(self._loop, transport, frame=ws_continuation_frame,
                                            protocol_ends_message=True)
            else:
                self._sender = DirectSender(self._loop, transport)
            self.send_path = "direct"
        except OSError as exc:  # the connection closed in the meantime: the event loop's path reports it
            log.info("shard %s: direct send unavailable (%s)", self.shard, exc)

    def _leave_direct(self) -> None:
        # The caller stopped reading while it still sends (half-duplex): the frame's rest went to the
        # transport; from here on the event loop sends, spilling to disk while it must.
        log.info("shard %s: caller is not reading yet; leaving direct send", self.shard)
        self.send_path = "direct_then_loop"
        self._close_sender()

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _put(self, item: Item | _Spilled) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    def _queue(self, chunk: bytes | memoryview) -> None:
        spill = self._spill
        if spill is not None and spill.drained() and not self._input_pending():
            spill.close()  # the caller caught up and the input is in: back to in-memory back-pressure
            spill = self._spill = None
        if spill is None:
            while not self._room.acquire(timeout=0.2):
                self.check()
                if self._input_pending():
                    # The caller is not reading while it still sends: keep consuming input.
                    spill = self._spill = _Spill()
                    log.info("shard %s: caller is not reading yet; spilling output to disk", self.shard)
                    break
            else:
                self._put(Chunk(chunk))
                return
        self._put(spill.write(chunk))

    # -- event loop ------------------------------------------------------------------------------

    async def next(self) -> Item:
        item = await self._items.get()
        if isinstance(item, _Spilled):
            data = await asyncio.to_thread(os.pread, item.spill.fileno(), item.length, item.offset)
            item.spill.consumed()
            return Chunk(data)
        if isinstance(item, Chunk):
            self._room.release()
        return item

    def go_direct(self, transport: asyncio.Transport | None, *, ws: bool = False) -> None:
        """After the first chunk went out: the driver writes the rest to ``transport`` (None: it does not)."""
        self._offered = (transport, ws) if transport is not None else None
        self._handoff.set()


# ------------------------------------------------------------------------------------ HTTP response


async def respond_http(output: Output, send: Callable, transport: asyncio.Transport | None,
                       input_received: Callable[[], Awaitable[object]] | None = None) -> None:
    """Send the job's output as the ASGI response; raises ``StreamAborted`` on a failure after the status line.

    ``transport``: the connection's, when direct send may take over after the first chunk.
    ``input_received``: awaited before the response ends (``BodySource.received``).
    """
    item = await output.next()
    match item:
        case Failure(error=error):
            status, body = error_answer(error)
            if input_received is not None:
                await input_received()
            await _send_whole(send, status, body, {})
            return
        case Final(status=status, body=body, headers=headers):
            if input_received is not None:
                await input_received()
            await _send_whole(send, status, body, headers or {})
            return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", TAR_CONTENT_TYPE.encode())]})
    first = True
    while True:
        match item:
            case Chunk(data=data):
                await send({"type": "http.response.body", "body": bytes(data), "more_body": True})
            case End():
                if input_received is not None:
                    await input_received()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            case Failure(error=error):
                foreseen = isinstance(error, TransformerError) and not isinstance(error, InternalError)
                raise StreamAborted(f"aborting the response of shard '{output.shard}' after "
                                    f"{output.bytes_written} bytes: {error}", foreseen) from error
            case Final():
                raise StreamAborted(f"shard '{output.shard}': a complete answer after the body began")
        if first:
            first = False
            # uvicorn wrote the status line and the first chunk: the driver may take the socket.
            ready = transport is not None and await drained(transport, STALL_SECONDS)
            output.go_direct(transport if ready else None)
        item = await output.next()


def error_answer(error: BaseException) -> tuple[int, bytes]:
    if isinstance(error, TransformerError):
        return error.status, error.message.encode()
    return 500, f"internal error: {error!r}".encode()


async def _send_whole(send: Callable, status: int, body: bytes, headers: dict[str, str]) -> None:
    if status >= 400:  # our error, or a next hop's or a destination's relayed: AIS shows it to its users
        body = redact_bytes(body)
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if status != 204:
        raw_headers.append((b"content-type", b"text/plain; charset=utf-8"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": b"" if status == 204 else body})


# ------------------------------------------------------------------------------------------ ws reply


class WsReply:
    """A ws reply whose first item is ready, so a failure before it is still an ordinary error reply.

    ``start`` waits for it: a ``Final`` (a direct put, answered with a Text frame by the caller) or
    the first chunk, after which ``send`` streams the message frame by frame (``whole`` joins it for a
    server that cannot send frames).
    """

    def __init__(self, output: Output, path: str):
        self.output, self.path = output, path
        self._first: bytes | memoryview | None = None
        self.frames_sent = 0

    async def start(self) -> Final | None:
        """The job's first item: its ``Final`` (direct put, 204), or None once the body has begun."""
        first = await self._next()
        if isinstance(first, Final):
            return first
        self._first = first
        return None

    async def _next(self) -> bytes | memoryview | Final | None:
        """The next chunk, a 204 ``Final``, or None at the end; a failure or a next hop's refusal raises."""
        match await self.output.next():
            case Chunk(data=data):
                return data
            case End():
                return None
            case Failure(error=error):
                raise error if isinstance(error, TransformerError) else TransformerError(repr(error))
            case Final(status=204) as final:
                return final
            case Final(status=status, body=body):
                raise UpstreamError(f"ws request {self.path!r}: next hop answered {status}: "
                                    f"{redact_bytes(body)[:300].decode('utf-8', 'replace')}", status)

    async def _chunks(self) -> AsyncIterator[bytes | memoryview]:
        chunk = self._first
        while chunk is not None:
            if isinstance(chunk, Final):
                raise TransformerError(f"ws request {self.path!r}: a direct put answered after output began")
            yield chunk
            chunk = await self._next()

    async def whole(self) -> bytes:
        """Every chunk, joined: the message for a server that cannot send frame by frame."""
        try:
            return b"".join([chunk async for chunk in self._chunks()])
        finally:
            self.output.cancel.set()

    async def send(self, protocol: FragmentingWebSocketProtocol) -> None:
        """The reply as one Binary message of many frames, each sent as the shard's output arrives.

        With direct send the first frame goes out here, the driver writes the continuation frames,
        and the last frame, with FIN, goes out here again, so websockets' own state stays right.
        """
        held = None  # one chunk held back, so the last frame carries data and FIN
        deadline = self.output.deadline
        try:
            async for chunk in self._chunks():
                if held is not None:
                    await self._frame(protocol, held, fin=False, deadline=deadline)
                held = chunk
                if self.frames_sent == 0 and self.output.may_go_direct:
                    # The driver waits for go_direct() after its first chunk: it cannot be held back.
                    await self._frame(protocol, held, fin=False, deadline=deadline)
                    held = None
                    await self._go_direct(protocol)
            await self._frame(protocol, held if held is not None else b"", fin=True, deadline=deadline)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            raise TransformerError(f"ws request {self.path!r}: the reply was not read within the object "
                                   "timeout") from None
        finally:
            self.output.cancel.set()
            protocol.threads_write(False)

    async def end_with_error(self, protocol: FragmentingWebSocketProtocol, body: bytes) -> None:
        """After a failure: the message already begun ends with ``body`` as its last frame (FIN).

        Written without waiting for the peer to read: it is small, and it must follow at once for the
        next reply to start at a message boundary, also after the object timeout.
        """
        await send_ws_frame(protocol, body, first=False, fin=True, deadline=None)
        self.frames_sent += 1

    async def _frame(self, protocol: FragmentingWebSocketProtocol, data: bytes | memoryview, *, fin: bool,
                     deadline: float) -> None:
        await send_ws_frame(protocol, data, first=self.frames_sent == 0, fin=fin, deadline=deadline)
        self.frames_sent += 1

    async def _go_direct(self, protocol: FragmentingWebSocketProtocol) -> None:
        """After the first frame: the driver writes the next ones, once the transport is empty.

        Not with a per-message extension (compression: ``serve`` turns it off), whose frames only
        websockets can build.
        """
        transport = protocol.transport
        ready = not protocol.conn.extensions and await drained(transport, STALL_SECONDS)
        if ready:
            protocol.threads_write(True)  # no pong of ours may land inside a frame being written
        self.output.go_direct(transport if ready else None, ws=True)


async def send_ws_frame(protocol: FragmentingWebSocketProtocol, data: bytes | memoryview, *, first: bool,
                        fin: bool, deadline: float | None) -> None:
    """One frame of a Binary message: the first opens it, ``fin`` ends it (framing by websockets).

    Waits while writing is paused (the peer is not reading), until ``deadline`` (``time.monotonic``),
    then raises ``TimeoutError``. ``deadline`` None: no wait, the frame goes to the transport's buffer
    at once (a small error text that ends a message, also after the object timeout, so the next reply
    on the connection starts at a message boundary).
    """
    if deadline is not None and not protocol.writable.is_set():
        await asyncio.wait_for(protocol.writable.wait(), max(0.0, deadline - time.monotonic()))
    if protocol.lost or protocol.close_sent:
        raise ClientDisconnected()
    try:
        if first:
            protocol.conn.send_binary(data, fin=fin)
        else:
            protocol.conn.send_continuation(data, fin=fin)
    except InvalidState:
        raise ClientDisconnected() from None
    for piece in protocol.conn.data_to_send():  # one write each: no join of the frame's bytes
        protocol.transport.write(piece)


# ----------------------------------------------------------------------------------------- spilling


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


@dataclass(frozen=True, slots=True)
class _Spilled:
    spill: _Spill
    offset: int
    length: int


# ------------------------------------------------------------------------------------- direct send


async def drained(transport: asyncio.Transport, timeout: float) -> bool:
    """Wait until uvicorn's transport has written everything it holds; False after ``timeout``.

    Also False, at once, for a TLS connection: its socket is never written to directly.
    """
    if encrypted(transport):
        return False
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while transport.get_write_buffer_size():
        if transport.is_closing() or loop.time() > end:
            return False
        await asyncio.sleep(0.001)
    return not transport.is_closing()


def chunked_frame(size: int) -> tuple[bytes, bytes]:
    """HTTP/1.1 chunked encoding (RFC 9112 7.1): the size line before the data, CRLF after."""
    return b"%x\r\n" % size, b"\r\n"


def ws_continuation_frame(size: int) -> tuple[bytes, bytes]:
    """A WebSocket continuation frame's header, FIN clear, unmasked (server to client; RFC 6455 5.2).

    Written here because websockets builds a frame by copying its payload into one bytes object
    (``Frame.serialize``), which is the copy direct send exists to avoid; tests/test_direct.py checks
    these headers against websockets' own for every length encoding.
    """
    if size < 126:
        return bytes((0x00, size)), b""
    if size < 1 << 16:
        return struct.pack("!BBH", 0x00, 126, size), b""
    return struct.pack("!BBQ", 0x00, 127, size), b""


class DirectSender:
    """Writes a response's frames from the shard's driver thread (see the module docstring).

    ``frame`` gives the bytes around a frame's data: HTTP chunked encoding (the default), or WebSocket
    continuation frames. ``protocol_ends_message``: the server's protocol sends the message's last
    frame (websockets: the frame with FIN, after a failure carrying the error text), so ``take_tail``
    hands it the held chunks and ``close`` completes a frame cut short.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport,
                 frame: Callable[[int], tuple[bytes, bytes]] = chunked_frame, protocol_ends_message: bool = False):
        self._loop, self._transport, self._wrap = loop, transport, frame
        self._protocol_ends_message = protocol_ends_message
        if encrypted(transport):
            raise OSError("a TLS connection: only its transport may write to the socket")
        raw = transport.get_extra_info("socket")
        if raw is None or raw.fileno() < 0:
            raise OSError("the connection has no open socket")
        # A duplicate descriptor: uvloop may close its own when the peer goes away while we write.
        self._sock = socket.socket(fileno=os.dup(raw.fileno()))
        # Non-blocking, as the event loop needs it; a full socket is waited for with poll(), and only
        # then (a socket with a timeout polls before every send: a system call per frame for nothing).
        self._sock.setblocking(False)
        self._writable = select.poll()
        self._writable.register(self._sock.fileno(), select.POLLOUT)
        # Small chunks (tar headers, labels, padding: what the engine gathers between two arrays) wait
        # here and go out in one frame, and one sendmsg, with the next array.
        self._held: list[bytes | memoryview] = []
        self._held_bytes = 0
        # What try_send could not write (the socket was full), written first by the next send or flush;
        # or a frame cut short by a cancel (see close).
        self._unsent: list[bytes | memoryview] = []

    def send(self, chunk: bytes | memoryview, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        """Write one frame. False: the socket stalled and the rest went to the transport (use ASGI now).

        ``cancel`` raises if the job must stop; ``stalled`` says whether waiting longer could deadlock.
        A chunk under ``HOLD`` bytes may be held and written with the next one (``flush`` writes it).
        """
        if not chunk:
            return True  # an empty frame would end the body
        if self._held_bytes + len(chunk) < HOLD and len(self._held) < _HOLD_COUNT:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            return True
        return self._write(chunk, cancel, stalled)

    def try_send(self, chunk: bytes | memoryview) -> Write:
        """``send`` that never waits, for a transform thread (``Output.try_write``): ``Write.OK`` when the
        frame was written or the chunk held, ``Write.FULL`` when the socket took part of it (the rest
        goes first with the next ``send`` or ``flush``, which the shard's driver makes)."""
        if self._unsent and not self._send_nowait(self._unsent):
            return Write.REFUSED  # a frame is still unfinished: the driver's blocking send finishes it
        if not chunk:
            return Write.OK
        if self._held_bytes + len(chunk) < HOLD and len(self._held) < _HOLD_COUNT:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            return Write.OK
        parts = self._frame(chunk)
        if not self._send_nowait(parts):
            self._unsent = parts
            return Write.FULL
        return Write.OK

    def _send_nowait(self, parts: list[bytes | memoryview]) -> bool:
        """One non-blocking ``sendmsg``; drops what was sent from ``parts``; whether all of it went."""
        try:
            sent = self._sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError as exc:  # EPIPE, ECONNRESET: the caller went away
            raise Cancelled(f"caller went away while receiving ({exc.strerror or exc})") from None
        drop_sent(parts, sent)
        return not parts

    def flush(self, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        """Write what ``send`` held back (the end of a body); False as for ``send``."""
        return self._write(b"", cancel, stalled) if self._held_bytes or self._unsent else True

    def take_tail(self) -> bytes:
        """At the end of the output: the held chunks, for the protocol's last frame (``protocol_ends_message``).

        Otherwise nothing: ``flush`` writes them.
        """
        if not self._protocol_ends_message:
            return b""
        held, self._held, self._held_bytes = self._held, [], 0
        return b"".join(held)

    def _frame(self, chunk: bytes | memoryview) -> list[bytes | memoryview]:
        """The held pieces and ``chunk`` as one frame (nothing when both are empty)."""
        held, self._held, size = self._held, [], self._held_bytes + len(chunk)
        self._held_bytes = 0
        if not size:
            return []
        prefix, suffix = self._wrap(size)
        return [prefix, *held, chunk, suffix] if suffix else [prefix, *held, chunk]

    def _write(self, chunk: bytes | memoryview, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        parts, self._unsent = [*self._unsent, *self._frame(chunk)], []
        waited = 0.0
        try:
            while parts:
                try:
                    sent = self._sock.sendmsg(parts)
                except BlockingIOError:
                    writable = self._writable.poll(_POLL * 1000)
                    cancel()  # also when poll() says writable and the socket still refuses: never spin unchecked
                    if writable:
                        continue  # (or failed: the next sendmsg says how)
                    waited += _POLL
                    if waited >= STALL_SECONDS and stalled():
                        self._to_transport(parts)
                        return False
                    continue
                except OSError as exc:  # EPIPE, ECONNRESET: the caller went away
                    parts.clear()  # nobody will read the rest of the frame
                    raise Cancelled(f"caller went away while receiving ({exc.strerror or exc})") from None
                waited = 0.0
                drop_sent(parts, sent)
        finally:
            self._unsent = parts  # a frame cut short by ``cancel`` (object timeout): see ``close``
        return True

    def _to_transport(self, parts: list[bytes | memoryview]) -> None:
        """The rest of a frame goes to uvicorn's transport (written by the event loop, in order)."""
        if parts:
            self._loop.call_soon_threadsafe(self._transport.write, b"".join(parts))
            parts.clear()

    def close(self) -> None:
        """Stop writing. With ``protocol_ends_message``, the rest of a frame cut short goes to the transport.

        A ws reply that fails mid-message is ended by the websockets protocol with a last frame that
        carries the error text, through the transport: a frame (or a pong) inside a frame's payload
        would be read as payload, so the frame is completed first. An HTTP response that fails is cut
        off by uvicorn instead, so a cut frame stays cut.
        """
        if self._protocol_ends_message:
            self._to_transport(self._unsent)
        self._unsent = []
        self._sock.close()


def drop_sent(parts: list[bytes | memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes from a ``sendmsg`` buffer list, in place (a partial send)."""
    while sent:
        first = len(parts[0])
        if sent >= first:
            sent -= first
            parts.pop(0)
        else:
            parts[0] = memoryview(parts[0])[sent:]
            sent = 0
