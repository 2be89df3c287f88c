"""server/wsreply.py's ``send_ws_frame`` on the ws protocol: a failed reply's last frame goes out without
waiting for the peer, after the pongs held while the threads wrote, and the next message starts cleanly.

Driven in memory (no socket), on test_protocols' in-memory connection, so the check is exact.
"""

from __future__ import annotations

import asyncio
import time

from websockets.frames import Frame, Opcode

from transformer.server.wsreply import send_ws_frame

from .test_protocols import accepted_connection, ping, pong


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
