"""A shard job's output as a ws reply: one Binary message sent frame by frame (``WsReply``).

The reply starts once the output's first item exists, so a failure before it is still an ordinary
error reply. With direct send the first frame goes out on the event loop, the driver thread writes
the continuation frames, and the last frame, with FIN, goes out on the event loop again, so
websockets' own state stays right. A reply that fails after its first frame ends with a last frame
carrying the error JSON, once a frame cut short was completed, so the connection stays usable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from uvicorn.protocols.utils import ClientDisconnected
from websockets.exceptions import InvalidState

from ..errors import TransformerError, UpstreamError
from ..redact import redact_bytes
from .direct import STALL_SECONDS, drained
from .output import Chunk, End, Failure, Final, Output
from .protocols import FragmentingWebSocketProtocol


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
