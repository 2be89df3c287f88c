"""The request body as a shard's source: ``BodySource``, pumped by the event loop to the shard's reader.

The body arrives on the event loop (ASGI ``receive``, or straight from the HTTP parser with the service's
protocol) and is read by a driver thread, or by a worker process through a pipe; this module is the one
place that moves it between them, with back-pressure both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator

from ..errors import Cancelled
from .protocols import DirectSendProtocol, FlowControl
from .sources import IteratorReader, Source

_PIPE_BYTES = 1 << 20  # a body piped to a worker process: the pipe's size


class BodySource(Source):
    """The request body, read from ASGI ``receive`` by the event loop and handed to the driver thread.

    One-shot: it cannot be replayed, which is why a failed direct put of a body-mode request is
    answered with AIS's 503 + ``Ais-Etl-Retry-Reason`` (the target then re-sends the body).

    ``pipe``: the body goes, as it arrives, into a pipe whose read end is a worker process's input
    (``take_read_end``), written by the event loop itself: no thread in between. With the service's
    protocol (``protocols.DirectSendProtocol.sink_body``) each chunk goes there straight from the HTTP
    parser (``feed``), without ASGI's copies and wake-ups, so the server process spends a system call
    per chunk on it (docs/design.md, "Cores"); else ``pump`` writes what ``receive`` returns.
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
