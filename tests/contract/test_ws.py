"""ws: ``/ws`` with a Binary JSON control message [+ Binary content], one reply per request, FIFO.

A Binary reply carries bytes; a Text reply means "delivered by direct put" and nothing else, since AIS
treats any Text as success. So an error must never be a Text reply: it is a Binary reply holding the
error JSON (or, once the reply began, ending with it), and the connection goes on serving, since AIS
never redials it (test_ws_session.py drives those failures through a fake of AIS's session).
"""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget, Fault, go_path_escape
from testbed.ports import free_port
from testbed.service import Service, start_transformer
from testbed.shardgen import imagenet_like_members, make_tar, read_tar
from transformer.errors import ShardError
from transformer.shards import read_samples

from .conftest import transformer_env
from .harness import escaped_uname
from .outputs import assert_transformed, image_shard, plain_members, plain_shard

REPLY_TIMEOUT = 60.0


@contextmanager
def ws_session(service: Service) -> Iterator[ClientConnection]:
    # Like the target's gorilla DefaultDialer: no subprotocol, no compression, large messages.
    with connect(f"ws://127.0.0.1:{service.port}/ws", max_size=None, compression=None, open_timeout=10,
                 close_timeout=5) as ws:
        yield ws


def control(path: str, fqn: str | None = None, etl_args: str | None = None, pipeline: str | None = None) -> bytes:
    message: dict[str, str] = {"path": path}
    if fqn is not None:
        message["fqn"] = go_path_escape(fqn)  # single-encoded inside the JSON (section 2.1)
    if etl_args is not None:
        message["etl_args"] = etl_args
    if pipeline is not None:
        message["pipeline"] = pipeline
    return json.dumps(message).encode()


def request(ws: ClientConnection, path: str, shard: bytes | None = None, **fields: str) -> None:
    ws.send(control(path, **fields))  # bytes -> a Binary frame
    if shard is not None:
        ws.send(shard)


def test_ws_fqn_control_message_gets_one_binary_reply(service: Service, client: httpx.Client,
                                                      disk: AisDisk) -> None:
    shard = image_shard(3)
    fqn = disk.put("train", "ws dir/ws-fqn.tar", shard)
    inline = client.put("/train/ws dir/ws-fqn.tar", content=shard)
    with ws_session(service) as ws:
        request(ws, "ws dir/ws-fqn.tar", fqn=fqn)  # no content frame when fqn is present
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert isinstance(reply, bytes)
    assert reply == inline.content


def test_ws_content_frame_follows_a_control_message_without_fqn(service: Service) -> None:
    inputs = imagenet_like_members(2)
    with ws_session(service) as ws:
        request(ws, "ws-body.tar", make_tar(inputs))
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert isinstance(reply, bytes)
    assert_transformed(inputs, reply)


def test_ws_etl_args_from_the_control_message(service: Service) -> None:
    inputs = imagenet_like_members(2)
    with ws_session(service) as ws:
        request(ws, "ws-args.tar", make_tar(inputs), etl_args='{"dtype": "uint8", "layout": "HWC"}')
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert_transformed(inputs, reply, dtype="uint8", shape=(224, 224, 3))


def test_ws_replies_in_fifo_order_when_requests_are_pipelined(service: Service, disk: AisDisk) -> None:
    # A slow request first, quick ones behind it: replies must still come back in request order.
    requests = [
        ("fifo-0.tar", make_tar(imagenet_like_members(8, extra=False))),
        ("fifo-1.tar", plain_shard(1, "one")),
        ("fifo-2.tar", plain_shard(2, "two")),
        ("fifo-3.tar", make_tar(imagenet_like_members(1))),
    ]
    fqn = disk.put("train", "fifo-2.tar", requests[2][1])
    with ws_session(service) as ws:
        for name, shard in requests:
            if name == "fifo-2.tar":
                request(ws, name, fqn=fqn)
            else:
                request(ws, name, shard)
        replies = [ws.recv(timeout=REPLY_TIMEOUT) for _ in requests]
    assert all(isinstance(r, bytes) for r in replies)
    assert len(read_tar(replies[0])) == 16
    assert read_tar(replies[1]) == plain_members(1, "one")
    assert read_tar(replies[2]) == plain_members(2, "two")
    assert_transformed(imagenet_like_members(1), replies[3])


def test_ws_direct_put_reply_is_text_only_after_the_destinations_200(service: Service, client: httpx.Client,
                                                                     dest_target: FakeTarget) -> None:
    shard = image_shard(2)
    inline = client.put("/train/ws-dp.tar", content=shard)
    entry = f"{dest_target.base_url}/{escaped_uname('dst', 'ws-dp.tar')}?owt=3&uuid=tcb-ws"
    dest_target.set_fault("*", Fault(stall=1.0))
    with ws_session(service) as ws:
        request(ws, "ws-dp.tar", shard, pipeline=entry)
        reply = ws.recv(timeout=REPLY_TIMEOUT)
        replied = time.monotonic()
    assert isinstance(reply, str)  # Text = delivered by direct put
    (put,) = dest_target.recorded("PUT")
    assert put.answered_at and put.answered_at <= replied
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', 'ws-dp.tar')}"
    assert put.query_pairs[:2] == [("owt", "3"), ("uuid", "tcb-ws")]
    assert put.body == inline.content


def test_ws_stage_pipeline_relays_the_stages_bytes_as_binary(service: Service, stage: FakeStage) -> None:
    inputs = plain_members(2, "staged")
    with ws_session(service) as ws:
        request(ws, "ws-stage.tar", make_tar(inputs), pipeline=stage.base_url)
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    (put,) = stage.recorded("PUT")
    assert isinstance(reply, bytes)
    assert reply == b"stage:" + put.body
    assert read_tar(put.body) == inputs


def _assert_binary_error_then_served(ws: ClientConnection, text: str) -> None:
    """The error is one Binary reply holding the error JSON, and the same connection serves the next request."""
    reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert not isinstance(reply, str), f"an error became a Text reply (AIS would count it as delivered): {reply!r}"
    error = json.loads(reply)
    assert text in error["message"], error
    request(ws, "after-the-error.tar", plain_shard(1, "after"))
    assert read_tar(ws.recv(timeout=REPLY_TIMEOUT)) == plain_members(1, "after")


def test_ws_corrupt_shard_under_fail_is_a_binary_error_reply(service: Service) -> None:
    members = imagenet_like_members(2, extra=False)
    members[0] = (members[0][0], members[0][1][:200])  # a broken JPEG
    with ws_session(service) as ws:
        request(ws, "ws-corrupt.tar", make_tar(members), etl_args='{"on_error": "fail"}')
        _assert_binary_error_then_served(ws, "sample-000000")


def test_ws_unreadable_shard_is_a_binary_error_reply(service: Service) -> None:
    with ws_session(service) as ws:
        request(ws, "ws-garbage.tar", b"definitely not a tar" * 64)
        _assert_binary_error_then_served(ws, "not a tar archive")


def test_ws_invalid_etl_args_is_a_binary_error_reply(service: Service) -> None:
    with ws_session(service) as ws:
        request(ws, "ws-bad-args.tar", image_shard(1), etl_args='{"dtype": "int7"}')
        _assert_binary_error_then_served(ws, "dtype")


def test_ws_unreachable_destination_is_a_binary_error_reply(impatient: Service) -> None:
    entry = f"http://127.0.0.1:{free_port()}/{escaped_uname('dst', 'ws-nowhere.tar')}?owt=3&uuid=tcb-ws"
    with ws_session(impatient) as ws:
        request(ws, "ws-nowhere.tar", image_shard(1), pipeline=entry)
        # Remote destination: AIS expected a direct put, so a Binary reply is recorded as an object error.
        _assert_binary_error_then_served(ws, "ws-nowhere.tar")


def test_ws_destination_refusal_is_a_binary_error_reply(service: Service, dest_target: FakeTarget) -> None:
    dest_target.set_fault("*", Fault(status=507, body=b"above high watermark"))
    entry = f"{dest_target.base_url}/{escaped_uname('dst', 'ws-full.tar')}?owt=3&uuid=tcb-ws"
    with ws_session(service) as ws:
        request(ws, "ws-full.tar", image_shard(1), pipeline=entry)
        _assert_binary_error_then_served(ws, "above high watermark")


def test_ws_one_connection_carries_request_after_request(service: Service) -> None:
    # The target keeps a fixed set of connections open; each one carries many objects in turn.
    with ws_session(service) as ws:
        for i in range(3):
            request(ws, f"again-{i}.tar", plain_shard(1, str(i)))
            assert read_tar(ws.recv(timeout=REPLY_TIMEOUT)) == plain_members(1, str(i))


def test_ws_reply_is_one_message_sent_in_many_frames(service: Service, disk: AisDisk) -> None:
    # 12 float32 samples, 7 MB: more than one of the 4 MiB frames a worker process gathers output into.
    members = imagenet_like_members(12)
    fqn = disk.put("train", "ws-frames.tar", make_tar(members))
    with ws_session(service) as ws:
        request(ws, "ws-frames.tar", fqn=fqn)
        frames = list(ws.recv_streaming(decode=False))  # the message's frames as they arrive
    assert len(frames) >= 3, "the reply was held and sent whole"
    assert all(frames), "an empty frame (the last one carries data and FIN)"
    assert_transformed(members, b"".join(frames))


def test_ws_failure_after_the_reply_began_ends_the_message_with_the_error(service: Service) -> None:
    members = imagenet_like_members(40, extra=False)
    members.append(("sample-999999.jpg", members[0][1][:200]))  # a broken JPEG, well after output began
    with ws_session(service) as ws:
        request(ws, "ws-late-failure.tar", make_tar(members), etl_args='{"on_error": "fail"}')
        frames = list(ws.recv_streaming(decode=False))
        request(ws, "after-the-error.tar", plain_shard(1, "after"))  # the connection goes on
        assert read_tar(ws.recv(timeout=REPLY_TIMEOUT)) == plain_members(1, "after")
    assert len(frames) > 2, "the failure came before the reply began: this test needs a later failure"
    error = json.loads(frames[-1])  # the message's last frame: the error, after the tar so far
    assert "sample-999999" in error["message"] and error["status"] == 422
    with pytest.raises(ShardError):
        list(read_samples(io.BytesIO(b"".join(frames)), "reply.tar", 2**30))


def _peak_rss_during(pid: int, action) -> int:
    """The process's highest VmRSS (bytes), polled every 5 ms while ``action`` runs."""
    peak, done = 0, threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            with open(f"/proc/{pid}/status") as status:
                peak = max(peak, int(re.search(r"^VmRSS:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024)
            time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        action()
    finally:
        done.set()
        poller.join()
    return peak


def test_ws_reply_memory_does_not_grow_with_the_shard(target: FakeTarget, disk: AisDisk, logs: Path) -> None:
    # A fresh service: a warm one may have freed memory to reuse, which would hide a reply held whole.
    fresh = start_transformer("transformer-ws-memory", logs, transformer_env(target, disk))
    try:
        jpeg = imagenet_like_members(1)[0][1]
        small = make_tar([("s-000000.jpg", jpeg), ("s-000000.cls", b"1")] * 1)
        big = make_tar([m for i in range(300) for m in ((f"s-{i:06d}.jpg", jpeg), (f"s-{i:06d}.cls", b"1"))])
        fqn_small, fqn_big = disk.put("train", "ws-small.tar", small), disk.put("train", "ws-big.tar", big)
        sizes = {}

        def one(path: str, fqn: str) -> None:
            with ws_session(fresh) as ws:
                request(ws, path, fqn=fqn)
                sizes[path] = sum(len(frame) for frame in ws.recv_streaming(decode=False))

        one("ws-small.tar", fqn_small)  # first-use costs: pool threads, caches
        before = _peak_rss_during(fresh.process.pid, lambda: one("ws-small.tar", fqn_small))
        peak = _peak_rss_during(fresh.process.pid, lambda: one("ws-big.tar", fqn_big))
    finally:
        fresh.stop()
    assert sizes["ws-big.tar"] > 300 * 3 * 224 * 224 * 4  # 300 float32 (3, 224, 224) arrays: 181 MB
    assert peak - before < 100 * 2**20, f"RSS grew by {(peak - before) / 2**20:.0f} MB for a 181 MB reply"


def test_under_plain_uvicorn_the_ws_reply_is_sent_whole_and_identical(service: Service, target: FakeTarget,
                                                                      disk: AisDisk, logs: Path) -> None:
    # `uvicorn transformer.server:app` has no frame-by-frame sender: the reply is one frame, same bytes.
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "transformer.server:app", "--host", "127.0.0.1",
               "--port", str(port), "--ws-max-size", str(2**30), "--log-level", "warning"]
    plain = Service("uvicorn-plain-ws", command, transformer_env(target, disk), logs, port).wait_healthy(90)
    try:
        members = imagenet_like_members(5)
        fqn = disk.put("train", "ws-plain.tar", make_tar(members))
        replies = {}
        for server in (service, plain):
            with ws_session(server) as ws:
                request(ws, "ws-plain.tar", fqn=fqn)
                replies[server.name] = list(ws.recv_streaming(decode=False))
    finally:
        plain.stop()
    assert len(replies[plain.name]) == 1 and len(replies[service.name]) > 1
    assert replies[plain.name][0] == b"".join(replies[service.name])
    assert_transformed(members, replies[plain.name][0])


def test_ws_reply_nobody_reads_ends_at_the_object_timeout(impatient: Service, disk: AisDisk) -> None:
    # 400 float32 images (240 MB) to a client that does not read: its queue of 16 frames (up to 4 MiB
    # each from a worker process) and the socket buffers fill, the reply waits, and at the object
    # timeout (2 s here) the shard's thread gives up and releases its window instead of waiting for a
    # reader forever. The message then ends with the error, and the connection serves the next
    # request once the client reads again.
    jpeg = imagenet_like_members(1)[0][1]
    fqn = disk.put("train", "ws-unread.tar",
                   make_tar([m for i in range(400) for m in ((f"u-{i:04d}.jpg", jpeg), (f"u-{i:04d}.cls", b"1"))]))
    with ws_session(impatient) as ws:
        request(ws, "ws-unread.tar", fqn=fqn)
        time.sleep(3.5)  # not reading, past the 2 s object timeout
        metrics = httpx.get(impatient.url + "/metrics", timeout=5).text
        assert re.search(r"^etl_inflight_shards 0(\.0)?$", metrics, re.M), "still in flight while nobody reads"
        frames = list(ws.recv_streaming(decode=False))
        request(ws, "after-the-timeout.tar", plain_shard(1, "after"))
        assert read_tar(ws.recv(timeout=REPLY_TIMEOUT)) == plain_members(1, "after")
    error = json.loads(frames[-1])
    assert "object timeout" in error["message"], error
    received = sum(len(frame) for frame in frames[:-1])
    assert 0 < received < 400 * 602_240
    with pytest.raises(ShardError):
        list(read_samples(io.BytesIO(b"".join(frames)), "reply.tar", 2**30))
