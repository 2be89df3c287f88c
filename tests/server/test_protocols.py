"""server/protocols.py: which responses may use direct send (``transport_of``), and the ws protocol's pongs:
while the driver thread writes frames, no pong is written; the held ones go out after.

Driven in memory (no socket) so the check is exact; tests/contract/test_direct_send.py has a slow
client ping all through a real reply.
"""

from __future__ import annotations

import asyncio

from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.frames import Frame, Opcode

from transformer.server import protocols
from transformer.server.protocols import WS_EXTENSION as EXTENSION
from transformer.server.protocols import FragmentingWebSocketProtocol

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


def test_head_requests_and_foreign_servers_use_the_asgi_path() -> None:
    transport = Transport()
    scope = {"method": "GET", "extensions": {protocols.DIRECT_EXTENSION: {"transport": transport}}}
    assert protocols.transport_of(scope) is transport
    assert protocols.transport_of({**scope, "method": "HEAD"}) is None
    assert protocols.transport_of({"method": "GET"}) is None
    assert protocols.transport_of({"method": "GET", "extensions": {"http.response.trailers": {}}}) is None
