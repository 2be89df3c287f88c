"""ws per-object failures through a fake of the AIS target's session (fake_ws.py): the connection survives.

The target dials a session's connections once and never redials; a connection the pod closes ends its
``readLoop``, and every request already queued on it waits forever. So a failed object must be
answered in its own reply, as a Binary message (never Text, which means "delivered by direct put"),
and the next request on the same connection must be served as if nothing happened. A failure before
the reply began is a Binary message holding the error JSON; one after its first frame ends the
message with a last frame holding the same JSON, after the tar written so far, which a strict tar
reader refuses.

The first tests check the fake itself against a tiny ws server that closes a connection, so that
"the request stayed pending" is known to be what the target would do.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget, Fault
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar
from transformer.errors import ShardError
from transformer.shards import read_samples

from .fake_ws import FakeWsSession
from .harness import escaped_uname
from .outputs import truncated
from .test_direct_send import send_paths, wait_for_path

PENDING_FOR = 1.5  # how long a request must stay unanswered to count as "the target would wait forever"
NEXT = make_tar(imagenet_like_members(3))  # the request that follows a failed one on its connection


def ws_url(service: Service) -> str:
    return f"ws://127.0.0.1:{service.port}/ws"


def fresh_reply(service: Service, path: str, **request: Any) -> bytes:
    """The reply to one request on a connection of its own (what the same request gets when nothing failed)."""
    with FakeWsSession(ws_url(service), connections=1) as session:
        reply = session.submit(path, **request).result()
    assert reply.binary, reply
    return reply.data


def split_error(data: bytes) -> tuple[bytes, dict[str, Any]]:
    """A failed reply: the bytes sent before the failure, and the error JSON that ends it."""
    at = data.rfind(b'{"message": ')
    assert at >= 0, f"no error JSON at the end of the reply: {data[-200:]!r}"
    return data[:at], json.loads(data[at:])


def assert_refused_by_a_strict_tar_reader(data: bytes) -> None:
    with pytest.raises(ShardError):
        list(read_samples(io.BytesIO(data), "reply.tar", 2**30))


@pytest.fixture(scope="module")
def next_reference(service: Service) -> bytes:
    return fresh_reply(service, "next.tar", content=NEXT)


# --------------------------------------------------------------------------------- the fake itself


class _ClosingPod:
    """A ws server that answers each request Binary (its path), Text for "direct-put", and closes
    the connection with 1011 on "close-me" (a pod that closes on a failed object)."""

    def __init__(self) -> None:
        self.handshakes = 0
        self._lock = threading.Lock()
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, ping_interval=None)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handle(self, ws: ServerConnection) -> None:
        with self._lock:
            self.handshakes += 1
        try:
            for message in ws:
                control = json.loads(message)
                if "fqn" not in control:
                    ws.recv(timeout=10)  # the content message
                if control["path"] == "close-me":
                    ws.close(1011, "object failed")
                    return
                if control["path"] == "direct-put":
                    ws.send("0")
                else:
                    ws.send(control["path"].encode())
        except ConnectionClosed:
            pass

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(5)


def test_the_fake_session_dials_once_and_requests_queued_behind_a_closed_connection_stay_pending() -> None:
    pod = _ClosingPod()
    try:
        with FakeWsSession(f"ws://127.0.0.1:{pod.port}/ws", connections=2) as session:
            first = session.submit("a", connection=0, fqn="/mp/@ais/b/%ob/a")
            delivered = session.submit("direct-put", connection=0, content=b"x")
            closing = session.submit("close-me", connection=0, content=b"x")
            behind = [session.submit(f"behind-{i}", connection=0, fqn=f"/mp/@ais/b/%ob/{i}") for i in range(2)]
            assert first.result(10).data == b"a" and first.result().binary
            assert delivered.result(10).delivered  # Text: "delivered by direct put"
            closed = session.connections[0].wait_closed(10)
            assert closed is not None and closed.code == 1011
            assert closing.pending_after(PENDING_FOR)  # the pod closed without a reply
            assert all(r.pending_after(0.1) for r in behind), "requests queued on a closed connection were answered"
            assert [r.path for r in session.connections[0].queued] == ["close-me", "behind-0", "behind-1"]
            # The session goes on with its other connection, and never dials again.
            later = [session.submit(f"later-{i}", fqn=f"/mp/@ais/b/%ob/l{i}") for i in range(3)]
            assert [r.result(10).data for r in later] == [b"later-0", b"later-1", b"later-2"]
            assert {r.connection for r in later} == {1}
            assert session.dials == 2 and pod.handshakes == 2
            assert not session.connections[1].unexpected
            with pytest.raises(AssertionError, match="no reply within"):
                behind[0].result(0.2)
    finally:
        pod.stop()


def test_requests_queued_behind_a_connection_the_pod_closed_stay_pending(service: Service,
                                                                          next_reference: bytes) -> None:
    # A message that is no control message is a protocol violation: the pod closes (1003). The fake
    # then leaves what it queued on that connection pending, as the target would.
    with FakeWsSession(ws_url(service), connections=2) as session:
        served = session.submit("next.tar", connection=0, content=NEXT)
        session.send_raw(0, "not a control message")
        stranded = session.submit("stranded.tar", connection=0, content=NEXT)
        assert served.result().data == next_reference
        closed = session.connections[0].wait_closed(10)
        assert closed is not None and closed.code == 1003
        assert stranded.pending_after(PENDING_FOR)
        assert session.submit("next.tar", content=NEXT).result().data == next_reference  # on connection 1
        assert session.dials == 2


# ------------------------------------------------------------------ failures before the reply began


def _broken_first_sample() -> bytes:
    members = imagenet_like_members(2, extra=False)
    members[0] = (members[0][0], members[0][1][:200])  # a broken JPEG
    return make_tar(members)


def _before(name: str, target: FakeTarget, dest_target: FakeTarget, stage: FakeStage, disk: AisDisk,
            tmp_path: Path) -> tuple[dict[str, Any], int, str]:
    """The request for failure ``name``, its expected status and a piece of its message."""
    good = make_tar(imagenet_like_members(1))
    if name == "bad-etl-args":
        return {"content": good, "etl_args": '{"dtype": "int7"}'}, 400, "dtype"
    if name == "missing-fqn":
        return {"fqn": disk.fqn("train", "never-stored.tar")}, 404, "no such object file"
    if name == "forbidden-fqn":
        return {"fqn": AisDisk(tmp_path).put("train", "elsewhere.tar", good)}, 403, "outside the allowed roots"
    if name == "unreadable-shard":
        return {"content": b"definitely not a tar" * 64}, 422, "not a tar archive"
    if name == "sample-fails":
        return {"content": _broken_first_sample(), "etl_args": '{"on_error": "fail"}'}, 422, "sample-000000"
    if name == "destination-refuses":
        dest_target.set_fault("*", Fault(status=507, body=b"above high watermark"))
        entry = f"{dest_target.base_url}/{escaped_uname('dst', 'failed.tar')}?owt=3&uuid=tcb-ws"
        return {"content": good, "pipeline": entry}, 507, "above high watermark"
    if name == "stage-refuses":
        stage.set_fault("*", Fault(status=500, body=b"the stage broke"))
        return {"content": good, "pipeline": stage.base_url}, 500, "the stage broke"
    raise AssertionError(name)


BEFORE = ["bad-etl-args", "missing-fqn", "forbidden-fqn", "unreadable-shard", "sample-fails", "destination-refuses",
          "stage-refuses"]


@pytest.mark.parametrize("failure", BEFORE)
def test_a_failure_before_the_reply_began_is_a_binary_reply_and_the_connection_serves_the_next(
        failure: str, service: Service, target: FakeTarget, dest_target: FakeTarget, stage: FakeStage,
        disk: AisDisk, tmp_path: Path, next_reference: bytes) -> None:
    request, status, text = _before(failure, target, dest_target, stage, disk, tmp_path)
    with FakeWsSession(ws_url(service), connections=2) as session:
        failed = session.submit("failed.tar", connection=0, **request)
        after = session.submit("next.tar", connection=0, content=NEXT)  # pipelined, as the target sends
        reply, following = failed.result(), after.result()
        connection = session.connections[0]
        assert connection.alive and connection.closed is None and not connection.unexpected
    assert reply.binary, f"an error became a Text reply (the target would count it as delivered): {reply}"
    error = json.loads(reply.data)
    assert error["status"] == status and text in error["message"] and error["object"] == "failed.tar", error
    assert_refused_by_a_strict_tar_reader(reply.data)
    assert following.binary and following.data == next_reference


def test_a_failed_object_between_good_ones_costs_the_session_nothing(service: Service,
                                                                     next_reference: bytes) -> None:
    # Both connections, each carrying failures and good objects in turn, as an offline job would.
    with FakeWsSession(ws_url(service), connections=2) as session:
        requests = []
        for i in range(6):
            if i % 2:
                requests.append(session.submit(f"bad-{i}.tar", content=b"definitely not a tar" * 64))
            else:
                requests.append(session.submit("next.tar", content=NEXT))
        replies = [r.result() for r in requests]
        assert all(c.alive for c in session.connections) and session.dials == 2
    assert all(r.binary for r in replies)
    assert [r.data == next_reference for r in replies] == [True, False] * 3
    assert all(json.loads(r.data)["status"] == 422 for r in replies[1::2])


# ------------------------------------------------------------------- failures after the reply began


# The good members whose output the reply begins with (none: not a tar), the request, status, message.
Late = tuple[list[tuple[str, bytes]], dict[str, Any], int, str]


def _late_sample(stage: FakeStage) -> Late:
    good = imagenet_like_members(40, extra=False)
    broken = good + [("sample-999999.jpg", good[0][1][:200])]  # well after output began
    return good, {"content": make_tar(broken), "etl_args": '{"on_error": "fail"}'}, 422, "sample-999999"


def _late_truncation(stage: FakeStage) -> Late:
    good = imagenet_like_members(40, extra=False)
    return good[:70], {"content": truncated(make_tar(good), 70)}, 422, "truncated inside member"


def _stage_drops(stage: FakeStage) -> Late:
    stage.set_fault("*", Fault(drop_after=2 * 2**20))  # the stage's 200 body ends after 2 of its ~5 MB
    shard = make_tar(imagenet_like_members(8))
    return [], {"content": shard, "pipeline": stage.base_url}, 502, "peer closed connection"


AFTER: dict[str, Callable[[FakeStage], Late]] = {
    "sample-fails": _late_sample,
    "truncated-shard": _late_truncation,
    "stage-drops-its-reply": _stage_drops,
}


@pytest.mark.parametrize("sending", ["direct", "loop"])
@pytest.mark.parametrize("failure", list(AFTER))
def test_a_failure_after_the_reply_began_ends_the_message_with_the_error_and_the_connection_serves_the_next(
        failure: str, sending: str, request: pytest.FixtureRequest, stage: FakeStage) -> None:
    server: Service = request.getfixturevalue("service" if sending == "direct" else "loop_service")
    good, failing, status, text = AFTER[failure](stage)
    reference = fresh_reply(server, "next.tar", content=NEXT)
    before = send_paths(server.url)
    with FakeWsSession(ws_url(server), connections=2) as session:
        failed = session.submit("failed.tar", connection=0, **failing)
        after = session.submit("next.tar", connection=0, content=NEXT)
        reply, following = failed.result(), after.result()
        connection = session.connections[0]
        assert connection.alive and connection.closed is None and not connection.unexpected
    assert reply.binary, "an error became a Text reply"
    assert reply.frames > 2, f"the failure came before the reply began ({reply.frames} frames): nothing was tested"
    sent, error = split_error(reply.data)
    assert error["status"] == status and text in error["message"] and error["object"] == "failed.tar", error
    assert sent, "nothing before the error"
    if good:  # the tar so far is exactly the start of the good samples' output
        assert fresh_reply(server, "good.tar", content=make_tar(good)).startswith(sent)
    else:
        assert sent.startswith(b"stage:")
    assert_refused_by_a_strict_tar_reader(reply.data)
    assert following.binary and following.data == reference
    paths = wait_for_path(server.url, before, sending)
    assert paths.get(sending, 0) - before.get(sending, 0) >= 2, f"not sent the {sending} way: {before} -> {paths}"


def test_an_object_timeout_while_transforming_ends_the_reply_with_the_error(impatient: Service,
                                                                           disk: AisDisk) -> None:
    # A slow transform (a blur on every 500x375 photo, some 40 ms each) over 150 samples against a 2 s
    # object timeout: the first sample's output (64x85 float32, over the 64 KB chunk) begins the reply
    # at once, even on a loaded machine, and the shard runs out of time later.
    slow = json.dumps({"transforms": [{"GaussianBlur": {"kernel_size": 31, "sigma": 10.0}},
                                      {"Resize": {"size": 64}}]})
    fqn = disk.put("train", "ws-slow.tar", make_tar(imagenet_like_members(150, extra=False)))
    reference = fresh_reply(impatient, "next.tar", content=NEXT)
    with FakeWsSession(ws_url(impatient), connections=2) as session:
        failed = session.submit("ws-slow.tar", connection=0, fqn=fqn, etl_args=slow)
        after = session.submit("next.tar", connection=0, content=NEXT)
        reply, following = failed.result(), after.result()
        assert session.connections[0].alive
    assert reply.binary and reply.frames > 2, reply.frames
    sent, error = split_error(reply.data)
    assert "object timeout exceeded" in error["message"] and error["object"] == "ws-slow.tar", error
    assert sent
    assert_refused_by_a_strict_tar_reader(reply.data)
    assert following.binary and following.data == reference
