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

import json
import threading
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve

from tests.shardgen import imagenet_like_members, make_tar

from .fake_ws import FakeWsSession
from .harness import Service

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
