"""server/direct.py's FrameWriter on a socket pair: exact chunked framing, partial sends, the stall
hand-back, a gone peer, and the engine's transform threads writing through it."""

from __future__ import annotations

import asyncio
import io
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable

import pytest

from testbed.shardgen import make_tar
from tests.test_engine import mixed_members, slow_transforms
from transformer.engine import Write, transform_shard
from transformer.errors import Cancelled
from transformer.options import TransformOptions
from transformer.pool import TransformPool
from transformer.server import direct, protocols


class FakeTransport:
    """What a FrameWriter uses of uvicorn's transport: the socket, and write() for a stalled frame's rest."""

    def __init__(self, sock: socket.socket):
        self.sock, self.written = sock, bytearray()

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None

    def write(self, data: bytes) -> None:
        self.written += data


def writer(transport: FakeTransport, **kwargs) -> direct.FrameWriter:
    """The writer the server makes for a connection: a duplicate of its socket, the rest of a frame to its transport."""
    return direct.FrameWriter(direct.socket_of(transport), transport.write, **kwargs)


def framed(chunks: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks)


def never() -> None:
    pass


def read_all(sock: socket.socket, into: bytearray) -> None:
    while data := sock.recv(1 << 20):
        into += data


def unframed(data: bytes) -> tuple[bytes, list[int]]:
    """The body inside HTTP/1.1 chunked frames, and the size of each frame (strict: no trailing bytes)."""
    body, sizes, at = bytearray(), [], 0
    while at < len(data):
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        assert size > 0, "an empty frame would end the body"
        body += data[end + 2:end + 2 + size]
        assert data[end + 2 + size:end + 4 + size] == b"\r\n"
        sizes.append(size)
        at = end + 4 + size
    return bytes(body), sizes


def send_all(chunks: list) -> tuple[bytes, list[int]]:
    ours, peer = socket.socketpair()
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(peer, received))
    reader.start()
    sender = writer(FakeTransport(ours))
    assert all(sender.send(chunk, never, lambda: False) for chunk in chunks)
    assert sender.flush(never, lambda: False)
    sender.close()
    ours.close()  # the duplicate is closed; this is the last descriptor, so the reader sees EOF
    reader.join(10)
    return unframed(bytes(received))


def test_frames_arrive_exactly_in_chunked_encoding() -> None:
    chunks = [b"a", os.urandom(70_000), memoryview(os.urandom(3 * 224 * 224 * 4)), b"tail" * 1000]
    body, sizes = send_all(chunks)
    assert body == b"".join(bytes(c) for c in chunks)
    assert sizes == [1 + 70_000, 3 * 224 * 224 * 4, 4000]  # small chunks ride with the next one; flush sends the last


def test_a_samples_small_pieces_and_its_array_go_out_as_one_frame() -> None:
    header, array, label = os.urandom(640), memoryview(os.urandom(602_112)), os.urandom(1536)
    chunks = [header, array, label, header, array, label, b"", b"end"]
    body, sizes = send_all(chunks)
    assert body == b"".join(bytes(c) for c in chunks)
    assert sizes == [640 + 602_112, 1536 + 640 + 602_112, 1536 + 3]


def test_many_tiny_chunks_never_exceed_what_one_sendmsg_takes() -> None:
    # A next stage answering in tiny HTTP chunks (ShardJob._to_stage re-sends them): sendmsg refuses more
    # than IOV_MAX (1024) buffers, which must never surface as "caller went away".
    chunks = [bytes([i % 251]) * 32 for i in range(1100)] + [os.urandom(70_000)]
    body, sizes = send_all(chunks)
    assert body == b"".join(chunks)
    assert len(sizes) > 1


def test_held_chunks_are_part_of_a_stalled_frame_handed_to_the_transport() -> None:
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = FakeTransport(ours)
    sender = writer(transport)
    small, chunk = os.urandom(2000), os.urandom(4 << 20)
    assert sender.send(small, never, lambda: True)  # held
    assert sender.send(chunk, never, lambda: True) is False
    sender.close()
    ours.shutdown(socket.SHUT_WR)
    received = bytearray()
    read_all(peer, received)
    assert bytes(received) + bytes(transport.written) == framed([small + chunk])


def test_a_stalled_frame_goes_to_the_transport_when_waiting_could_deadlock() -> None:
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = FakeTransport(ours)
    sender = writer(transport)
    chunk = os.urandom(4 << 20)  # far more than the socket pair buffers; nobody reads yet
    assert sender.send(chunk, never, lambda: True) is False
    sender.close()
    ours.shutdown(socket.SHUT_WR)
    received = bytearray()
    read_all(peer, received)
    assert 0 < len(received) < len(framed([chunk]))
    assert bytes(received) + bytes(transport.written) == framed([chunk])  # nothing lost, nothing twice


def test_a_blocked_send_stops_when_the_job_is_cancelled() -> None:
    ours, _peer = socket.socketpair()
    sender = writer(FakeTransport(ours))
    calls = []

    def cancel() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise Cancelled("caller went away")

    with pytest.raises(Cancelled):
        sender.send(os.urandom(4 << 20), cancel, lambda: False)  # not stalled: keeps waiting until cancelled
    sender.close()


def test_a_peer_that_went_away_is_a_cancellation() -> None:
    ours, peer = socket.socketpair()
    peer.close()
    sender = writer(FakeTransport(ours))
    with pytest.raises(Cancelled, match="went away"):
        sender.send(os.urandom(1 << 20), never, lambda: False)
    sender.close()


def test_try_send_never_waits_and_the_next_send_finishes_its_frame_first() -> None:
    # A transform thread writes with try_send (Output.try_write): on a full socket it keeps the rest of the
    # frame and says FULL; the driver's next send writes that rest before anything else.
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = writer(FakeTransport(ours))
    small, big, after, tail = os.urandom(100), os.urandom(4 << 20), os.urandom(200_000), b"tail"
    assert sender.try_send(small) is Write.OK  # held, as send holds it
    assert sender.try_send(big) is Write.FULL  # nobody reads yet: part of the frame is in the socket
    assert sender.try_send(b"more" * 100_000) is Write.REFUSED  # not taken while a frame is unfinished
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(peer, received))
    reader.start()
    assert sender.send(after, never, lambda: False)
    assert sender.send(tail, never, lambda: False)  # held
    assert sender.flush(never, lambda: False)
    sender.close()
    ours.close()
    reader.join(10)
    body, sizes = unframed(bytes(received))
    assert body == small + big + after + tail
    assert sizes == [100 + len(big), len(after), len(tail)]


def test_try_send_of_a_gone_peer_is_a_cancellation() -> None:
    ours, peer = socket.socketpair()
    peer.close()
    sender = writer(FakeTransport(ours))
    with pytest.raises(Cancelled, match="went away"):
        sender.try_send(os.urandom(1 << 20))
    sender.close()


def test_flush_after_try_send_writes_only_the_unfinished_frame() -> None:
    # Nothing held, only the rest of a frame: flush must not add a frame (an empty one ends the body).
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = writer(FakeTransport(ours))
    big = os.urandom(2 << 20)
    assert sender.try_send(big) is Write.FULL
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(peer, received))
    reader.start()
    assert sender.flush(never, lambda: False)
    sender.close()
    ours.close()
    reader.join(10)
    assert bytes(received) == framed([big])


def test_the_engines_relay_over_a_real_socket_that_fills(pool: TransformPool,
                                                         make_options: Callable[..., TransformOptions],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The service's writer (FrameWriter.try_send) on a socket with a 4 KB buffer and a slow reader: the
    # transform threads keep finding it full and the driver keeps finishing frames. The body must be the
    # driver path's bytes, in chunked framing.
    slow_transforms(monkeypatch, lambda key: random.Random(key).uniform(0, 0.005))
    data = make_tar(mixed_members(40))
    options = make_options(seed=3)
    reference = b"".join(bytes(c) for c in transform_shard(io.BytesIO(data), options, pool, shard="s",
                                                          object_name="s", window=6))
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    received = bytearray()

    def read_slowly() -> None:
        while piece := peer.recv(8192):
            received.extend(piece)
            time.sleep(0.0005)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    sender = writer(FakeTransport(ours))
    answers: list[Write] = []

    def try_send(chunk) -> Write:
        answers.append(sender.try_send(chunk))
        return answers[-1]

    for chunk in transform_shard(io.BytesIO(data), options, pool, shard="s", object_name="s", window=6,
                                 writer=try_send):
        assert sender.send(chunk, never, lambda: False)
    assert sender.flush(never, lambda: False)
    sender.close()
    ours.close()
    reader.join(30)
    body, _ = unframed(bytes(received))
    assert body == reference
    assert Write.FULL in answers and Write.OK in answers  # both paths were taken


class TlsTransport(FakeTransport):
    """An SSL transport as asyncio and uvloop make them: ``socket`` is the raw socket, under the TLS layer."""

    def get_extra_info(self, name: str):
        return {"socket": self.sock, "sslcontext": ssl.create_default_context()}.get(name)


def test_a_tls_connection_is_never_written_directly() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        transport = TlsTransport(ours)
        scope = {"method": "GET", "extensions": {protocols.DIRECT_EXTENSION: {"transport": transport}}}
        assert protocols.transport_of(scope) is None
        assert asyncio.run(direct.drained(transport, 1.0)) is False  # a ws reply's way to direct send
        with pytest.raises(OSError, match="TLS"):
            writer(transport)


# --- ws replies (protocol_ends_message): continuation frames, the tail, a frame cut short -------------


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65_535, 65_536, 3 * 224 * 224 * 4])
def test_ws_continuation_headers_are_websockets_own(size: int) -> None:
    from websockets.frames import Frame, Opcode

    payload = os.urandom(size)
    theirs = Frame(Opcode.CONT, payload, fin=False).serialize(mask=False, extensions=[])
    assert direct.ws_continuation_frame(size) == (theirs[:len(theirs) - size], b"")


def object_timeout() -> None:
    """A ``cancel`` check that finds the object timeout passed (the driver's ``_check_cancel``)."""
    raise Cancelled("object timeout")


def ws_sender(sock: socket.socket, transport: FakeTransport | None = None) -> direct.FrameWriter:
    return writer(transport or FakeTransport(sock), frame=direct.ws_continuation_frame, protocol_ends_message=True)


def test_ws_frames_carry_the_data_and_the_held_tail_is_handed_back() -> None:
    from websockets.frames import Frame, Opcode
    from wsproto.frame_protocol import FrameProtocol

    ours, peer = socket.socketpair()
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(peer, received))
    reader.start()
    sender = ws_sender(ours)
    first, header, array, end = b"first", os.urandom(512), os.urandom(602_240), bytes(1024)
    assert sender.send(header, never, lambda: False)  # held, then one frame with the array
    assert sender.send(array, never, lambda: False)
    assert sender.send(end, never, lambda: False)  # held: the message's last frame is the protocol's
    tail = sender.take_tail()
    assert tail == end
    assert sender.flush(never, lambda: False)  # nothing left to write
    sender.close()
    ours.close()
    reader.join(10)
    # As the service does it: websockets opens the message and ends it, the sender writes between.
    opening = Frame(Opcode.BINARY, first, fin=False).serialize(mask=False, extensions=[])
    closing = Frame(Opcode.CONT, tail, fin=True).serialize(mask=False, extensions=[])
    parser = FrameProtocol(client=True, extensions=[])
    parser.receive_bytes(opening + bytes(received) + closing)
    frames = list(parser.received_frames())
    assert [(f.frame_finished, f.message_finished) for f in frames] == [(True, False), (True, False), (True, True)]
    assert [f.payload for f in frames] == [first, header + array, end]


def test_a_ws_frame_cut_short_is_completed_through_the_transport_at_close() -> None:
    # An object timeout while the peer does not read leaves a frame half written; the message's last
    # frame (the error text) comes next through the transport, so the frame's rest must go there first.
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = FakeTransport(ours)
    sender = ws_sender(ours, transport)
    array = os.urandom(4 << 20)
    with pytest.raises(Cancelled):
        sender.send(array, object_timeout, lambda: False)
    assert not transport.written
    sender.close()
    ours.shutdown(socket.SHUT_WR)
    received = bytearray()
    read_all(peer, received)
    header, _ = direct.ws_continuation_frame(len(array))
    assert bytes(received) + bytes(transport.written) == header + array


def test_an_http_frame_cut_short_stays_cut() -> None:
    # uvicorn aborts a failed HTTP response; nothing goes to its transport after the failure.
    ours, _peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = FakeTransport(ours)
    sender = writer(transport)
    with pytest.raises(Cancelled):
        sender.send(os.urandom(4 << 20), object_timeout, lambda: False)
    assert sender.take_tail() == b""
    sender.close()
    assert not transport.written


# --- a ws frame a worker left cut: the frame log and the bytes a socket was given -------------------------


def test_the_frame_log_completes_exactly_the_frame_cut_at_any_byte() -> None:
    log = direct.FrameLog()
    frames, written = [], 0
    for size in (10, 70_000, 3, 200, 5):  # every header length: 2, 4 (and 10 below) bytes
        header, _ = direct.ws_continuation_frame(size)
        written += len(header) + size
        log.record(written, header)
        frames.append((written - len(header) - size, header, written))
    for start, header, end in frames[-2:]:  # the writer keeps at most two frames unfinished
        for cut in range(start, end + 1):
            rest = log.rest(cut)
            if cut in (start, end):
                assert rest == b""  # at a frame boundary
            else:
                into = cut - start
                assert rest == header[into:] + b"\xff" * (end - max(cut, start + len(header)))
                assert cut + len(rest) == end
    assert log.rest(frames[0][2] - 1) is None  # before the oldest boundary kept: cannot tell
    log.close()


def test_bytes_written_counts_what_a_tcp_socket_was_given_read_or_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            assert direct.bytes_written(peer) == 0
            peer.setblocking(False)
            given = 0
            try:
                while given < 8 << 20:
                    given += peer.send(b"x" * 65536)
            except BlockingIOError:
                pass
            assert direct.bytes_written(peer) == given  # nothing read yet: all of it queued
            client.recv(100_000)
            assert direct.bytes_written(peer) == given
    a, b = socket.socketpair()
    with a, b:
        assert direct.bytes_written(a) is None  # not TCP
