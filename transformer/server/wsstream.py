"""A ws reply sent as a fragmented message: memory bounded by the window, not by the shard.

Why: ASGI sends a WebSocket message whole (``websocket.send`` carries all its bytes), and AIS wants one
message per object, so a 1,000-image float32 shard meant a 600 MB reply held in memory, then framed
(a copy) and joined (another copy) by uvicorn: 2.6 GB peak for a 100 MB shard, and AIS opens 8 ws
connections per offline job. RFC 6455 lets one message travel as several frames (section 5.4: a
Binary frame with FIN clear, continuation frames, the last with FIN set), and AIS's reader (gorilla
``NextReader``/``ReadMessage``) reassembles them, so the reply can leave as the shard is transformed.

How: uvicorn's websockets (sans-I/O) protocol, subclassed only to put itself into the ASGI scope under
``EXTENSION`` and to send one frame of a message. Framing stays websockets' (``send_binary`` /
``send_continuation``); flow control stays uvicorn's (``writable`` is cleared while the transport is
above its high-water mark). A failure after the first frame ends the message with a last frame
(FIN) that carries the error text, so the connection stays usable for the next request; the reader
holds a tar cut short followed by bytes that are no tar, which a strict tar reader refuses: never a
shorter, valid-looking message. Without the extension (another server or ws implementation) the
reply is sent whole, as before. With direct send (direct.py) the frames between the first and the
last are written by the shard's threads; ``threads_write`` keeps this protocol's pongs back in the
meantime.
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.http11 import Request

EXTENSION = "transformer.ws_fragments"


class FragmentingWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets (sans-I/O) protocol that can also send a message frame by frame."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._threads_write = False

    def threads_write(self, active: bool) -> None:
        """Whether a shard's threads are writing frames to the socket (direct send; event loop only).

        Meanwhile a pong this protocol owes stays in websockets' outgoing buffer: written now it could
        land inside a frame being written. It goes out with the next frame sent here (the reply's last;
        control frames may come between fragments, RFC 6455 5.4), or at the end of the hold. Reading goes
        on, so a next request is still read ahead as before.
        """
        self._threads_write = active
        if not active:
            pending = self.conn.data_to_send()
            if pending and not self.transport.is_closing():
                self.transport.write(b"".join(pending))

    def handle_ping(self) -> None:
        if not self._threads_write:
            super().handle_ping()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # only set when the handshake is accepted
        if scope is not None:
            scope["extensions"][EXTENSION] = self

    async def send_frame(self, data: bytes | memoryview, *, first: bool, fin: bool, deadline: float | None) -> None:
        """One frame of a Binary message: the first opens it, ``fin`` ends it.

        Waits while writing is paused (the peer is not reading), until ``deadline`` (``time.monotonic``),
        then raises ``TimeoutError``. ``deadline`` None: no wait, the frame goes to the transport's
        buffer at once (a small error text that ends a message, also after the object timeout, so
        the next reply on the connection starts at a message boundary).
        """
        if deadline is not None and not self.writable.is_set():
            await asyncio.wait_for(self.writable.wait(), max(0.0, deadline - time.monotonic()))
        if self.disconnected or self.close_sent:
            raise ClientDisconnected()
        try:
            if first:
                self.conn.send_binary(data, fin=fin)
            else:
                self.conn.send_continuation(data, fin=fin)
        except InvalidState:
            raise ClientDisconnected() from None
        for piece in self.conn.data_to_send():  # one write each: no join of the frame's bytes
            self.transport.write(piece)


def fragmenter_of(scope: dict) -> FragmentingWebSocketProtocol | None:
    return (scope.get("extensions") or {}).get(EXTENSION)
