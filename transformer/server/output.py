"""One shard response's output buffer, between the driver thread and the event loop: ``Output``.

Two threads meet here. The shard's driver thread produces the output (``write``, ``end``, ``fail``,
``answer``); the event loop consumes it (``next``) and sends it: an HTTP response through ASGI
(``httpreply.respond_http``) or a ws reply as a fragmented Binary message (``wsreply.WsReply``). At any
moment one thread writes a response's bytes:

* **The status line waits for the first chunk** (or a complete answer: a 204 after a direct put, an
  error), so an unreadable shard or a bad first sample is still a proper 4xx/5xx.
* **Back-pressure.** At most ``_QUEUE_CHUNKS`` chunks wait for the event loop; the driver then waits
  for room, and the window stops refilling. A half-duplex caller (one that reads the response only
  after sending the whole body: requests, httpx, the SDK's pipeline stages) would deadlock with that,
  so while the body is still arriving, output that finds no room is parked in an unlinked temp file
  (``_Spill``) and read back by the event loop in order.
* **Direct send.** Once the first chunk went out through the server and its write buffer is empty,
  the shard's own threads write the rest of the body (``direct.FrameWriter``, see there); the end
  goes back to the event loop. The transform thread that completes the oldest unwritten sample
  writes it through ``try_write``, never waiting; when the socket is full the role passes to the
  driver thread, which waits in ``write``. With worker processes the connection goes to the worker
  leading the shard instead (``delegate``), which writes from there and sends back only the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Write
from ..errors import Cancelled, TransformerError
from .direct import FrameWriter, socket_of, ws_continuation_frame

log = logging.getLogger("transformer.server")

_QUEUE_CHUNKS = 8  # chunks waiting for the event loop before the driver waits (back-pressure)


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
        self._sender: FrameWriter | None = None  # used by the driver thread only
        # Set by the job when a worker process leads the shard: it is handed the offered connection (or
        # told there is none) instead of this output writing to it; True when it took it.
        self.delegate: Callable[[asyncio.Transport | None, bool], bool] | None = None
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

    def write_raw(self, data: bytes) -> None:
        """Bytes for the connection as they are, before any later chunk: the rest of a frame the worker
        leading the shard began before it handed the connection back (``delegate``)."""
        if self._offered is not None and data:
            self._loop.call_soon_threadsafe(self._offered[0].write, data)

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
        if self.delegate is not None:
            transport, ws = self._offered if self._offered is not None else (None, False)
            if self.delegate(transport, ws):
                self.send_path = "direct"
            return
        if self._offered is None:
            return
        transport, ws = self._offered
        try:
            fallback = self._to_transport(transport)
            if ws:
                self._sender = FrameWriter(socket_of(transport), fallback, frame=ws_continuation_frame,
                                           protocol_ends_message=True)
            else:
                self._sender = FrameWriter(socket_of(transport), fallback)
            self.send_path = "direct"
        except OSError as exc:  # the connection closed in the meantime: the event loop's path reports it
            log.info("shard %s: direct send unavailable (%s)", self.shard, exc)

    def _to_transport(self, transport: asyncio.Transport) -> Callable[[bytes], None]:
        """Bytes the sender hands back (a frame's rest), written by the event loop in order."""
        return lambda data: self._loop.call_soon_threadsafe(transport.write, data)

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
