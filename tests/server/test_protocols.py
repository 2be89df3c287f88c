"""server/protocols.py: which responses may use direct send (``transport_of``), and the ws protocol with
wsreply.send_ws_frame: while the driver thread writes frames,
no pong is written; a failed reply's last frame goes out without waiting, after the held pongs, and
the next message starts cleanly.

Driven in memory (no socket) so the check is exact; tests/contract/test_direct_send.py has a slow
client ping all through a real reply.
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.frames import Frame, Opcode

from transformer.server import protocols
from transformer.server.protocols import WS_EXTENSION as EXTENSION
from transformer.server.protocols import FragmentingWebSocketProtocol
from transformer.server.wsreply import send_ws_frame

HANDSHAKE = (b"GET /ws HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


class Transport:
    def __init__(self) -> None:
        self.written = bytearray()

    def get_extra_info(self, name: str):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name)

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def ping(payload: bytes) -> bytes:
    return Frame(Opcode.PING, payload).serialize(mask=True, extensions=[])  # client frames are masked


def pong(payload: bytes) -> bytes:
    return Frame(Opcode.PONG, payload).serialize(mask=False, extensions=[])


async def accepted_connection() -> tuple[FragmentingWebSocketProtocol, Transport]:
    """The protocol on an in-memory transport, its handshake done and the connection accepted by an app
    that then only waits."""
    accepted = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        accepted.set()
        await asyncio.sleep(3600)

    config = Config(app=app, ws=FragmentingWebSocketProtocol, ws_ping_interval=None, ws_ping_timeout=None,
                    ws_per_message_deflate=False, log_level="warning")
    config.load()
    protocol = FragmentingWebSocketProtocol(config, ServerState(), {})
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(HANDSHAKE)
    await asyncio.wait_for(accepted.wait(), 5)
    return protocol, transport


def test_pongs_wait_while_the_threads_write_and_go_out_after() -> None:
    async def scenario() -> tuple[bytes, bytes, bytes, bool]:
        protocol, transport = await accepted_connection()
        registered = protocol.scope["extensions"][EXTENSION] is protocol
        handshake_end = len(transport.written)

        protocol.data_received(ping(b"before"))  # no threads writing: answered at once
        answered = bytes(transport.written[handshake_end:])
        protocol.threads_write(True)
        protocol.data_received(ping(b"during"))
        during = bytes(transport.written[handshake_end + len(answered):])
        protocol.threads_write(False)
        after = bytes(transport.written[handshake_end + len(answered):])
        for task in list(protocol.tasks):
            task.cancel()
        return answered, during, after, registered

    answered, during, after, registered = asyncio.run(scenario())
    assert registered
    assert answered == pong(b"before")
    assert during == b"", "a pong was written while the shard's threads write frames"
    assert after == pong(b"during")


def frame(opcode: Opcode, data: bytes, fin: bool) -> bytes:
    return Frame(opcode, data, fin=fin).serialize(mask=False, extensions=[])


def test_a_failed_reply_ends_with_its_error_frame_even_while_the_peer_does_not_read() -> None:
    # After a failure mid-message: pongs held while the threads wrote go out, then the error text as
    # the message's last frame, without waiting for the peer (writing is paused); the next message
    # then starts cleanly on the same connection.
    async def scenario() -> tuple[bytes, bool]:
        protocol, transport = await accepted_connection()
        start = len(transport.written)

        await send_ws_frame(protocol, b"first", first=True, fin=False, deadline=time.monotonic() + 5)
        protocol.threads_write(True)  # the shard's threads write the next frames
        protocol.data_received(ping(b"during"))
        protocol.pause_writing()  # the peer stopped reading
        timed_out = False
        try:
            await send_ws_frame(protocol, b"more", first=False, fin=False, deadline=time.monotonic() + 0.05)
        except asyncio.TimeoutError:
            timed_out = True
        protocol.threads_write(False)  # the failure: the threads stopped
        await send_ws_frame(protocol, b'{"message": "failed"}', first=False, fin=True, deadline=None)
        await send_ws_frame(protocol, b"next", first=True, fin=True, deadline=None)  # a new message: clean state
        for task in list(protocol.tasks):
            task.cancel()
        return bytes(transport.written[start:]), timed_out

    written, timed_out = asyncio.run(scenario())
    assert timed_out, "a frame with a deadline did not wait (until its deadline) while writing was paused"
    assert written == (frame(Opcode.BINARY, b"first", False) + pong(b"during")
                       + frame(Opcode.CONT, b'{"message": "failed"}', True) + frame(Opcode.BINARY, b"next", True))


def test_head_requests_and_foreign_servers_use_the_asgi_path() -> None:
    transport = Transport()
    scope = {"method": "GET", "extensions": {protocols.DIRECT_EXTENSION: {"transport": transport}}}
    assert protocols.transport_of(scope) is transport
    assert protocols.transport_of({**scope, "method": "HEAD"}) is None
    assert protocols.transport_of({"method": "GET"}) is None
    assert protocols.transport_of({"method": "GET", "extensions": {"http.response.trailers": {}}}) is None
