"""bench.services.read_ws_message: the benchmark's ws client counts exactly the reply's payload.

Frames are built by websockets (as a server sends them) and written in dribbles, so headers and
payloads arrive split across reads.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest
from websockets.frames import Frame, Opcode

from bench.services import read_ws_message


def frame(opcode: Opcode, data: bytes, fin: bool) -> bytes:
    return Frame(opcode, data, fin=fin).serialize(mask=False, extensions=[])


def served(wire: bytes, pieces: int = 0, then_close: bool = False) -> tuple[int, bytes]:
    """``wire`` written to one end of a socket pair, in ``pieces`` random cuts; read at the other."""
    ours, peer = socket.socketpair()
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(wire)), min(pieces, len(wire) - 1)))

    def write() -> None:
        at = 0
        for cut in [*cuts, len(wire)]:
            peer.sendall(wire[at:cut])
            at = cut
        if then_close:
            peer.close()

    writer = threading.Thread(target=write)
    writer.start()
    sink = bytearray()
    try:
        count, _ = read_ws_message(ours, time.monotonic() + 30, sink)
    finally:
        writer.join(10)
        ours.close()
        if not then_close:
            peer.close()
    return count, bytes(sink)


@pytest.mark.parametrize("pieces", [0, 50, 5000])
def test_a_fragmented_message_is_counted_exactly(pieces: int) -> None:
    parts = [b"first", b"", os.urandom(125), os.urandom(126), os.urandom(65_536), os.urandom(602_240), b"end"]
    wire = frame(Opcode.BINARY, parts[0], False) + b"".join(frame(Opcode.CONT, p, False) for p in parts[1:-1])
    wire += frame(Opcode.CONT, parts[-1], True)
    trailing = frame(Opcode.TEXT, b"next reply", True)  # a next message is not read into this one
    count, payload = served(wire + trailing, pieces)
    assert count == len(payload) == sum(map(len, parts))
    assert payload == b"".join(parts)


def test_a_message_in_one_frame_larger_than_the_buffer() -> None:
    data = os.urandom(9 << 20)
    count, payload = served(frame(Opcode.BINARY, data, True), pieces=20)
    assert (count, payload) == (len(data), data)


def test_an_empty_last_frame_ends_the_message() -> None:
    count, payload = served(frame(Opcode.BINARY, b"abc", False) + frame(Opcode.CONT, b"", True))
    assert (count, payload) == (3, b"abc")


@pytest.mark.parametrize("wire", [
    frame(Opcode.TEXT, b"0", True),  # a direct put's answer, not a reply
    frame(Opcode.BINARY, b"abc", False) + frame(Opcode.CLOSE, b"\x03\xf3failed", True),  # 1011 mid-message
])
def test_anything_but_a_binary_reply_is_an_error(wire: bytes) -> None:
    with pytest.raises(ConnectionError, match="unexpected frame"):
        served(wire)


def test_a_connection_closed_mid_message_is_an_error() -> None:
    with pytest.raises(ConnectionError, match="before the reply ended"):
        served(frame(Opcode.BINARY, os.urandom(1000), True)[:500], then_close=True)
