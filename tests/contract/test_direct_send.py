"""Direct send (server/direct.py): the shard's driver thread writes the body frames; the bytes are the same.

The default service writes each response's body, and each ws reply's frames between its first and its
last, from the shard's driver thread once the first chunk went out through uvicorn; the ``loop-send`` plant
(``testbed/planted.py``) sends every chunk through the event loop. Both must give the caller identical bytes,
and a caller that reads only after sending must still get the whole shard.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Ping, Pong
from wsproto.events import Request as WsRequest

from testbed.fake_ais import AisDisk, FakeTarget
from testbed.ports import free_port
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar, read_tar
from testbed.tlscerts import TlsFiles, make_tls_files

from .conftest import transformer_env
from .harness import args_query, fqn_query
from .test_half_duplex_clients import _shard as half_duplex_shard
from .test_ws import REPLY_TIMEOUT, control, request, ws_session


def send_paths(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.labels["path"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "etl_send_path_total"}


def wait_for_path(url: str, before: dict[str, float], path: str) -> dict[str, float]:
    """The counter is recorded when the job ends, which may be just after the caller read the last byte."""
    deadline = time.monotonic() + 5
    while True:
        after = send_paths(url)
        if after.get(path, 0) > before.get(path, 0) or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def test_direct_and_event_loop_sending_give_identical_bytes(service: Service, loop_service: Service,
                                                            disk: AisDisk) -> None:
    inputs = imagenet_like_members(24)  # ~14 MB of float32 arrays: far more than the first chunk
    shard = make_tar(inputs)
    fqn = disk.put("train", "direct-send.tar", shard)
    query = args_query(json.dumps({"preset": "imagenet-train", "seed": 11}))
    outputs = {}
    with httpx.Client(timeout=60) as http:
        for name, server in (("direct", service), ("loop", loop_service)):
            before = send_paths(server.url)
            by_body = http.put(f"{server.url}/train/direct-send.tar?{query}", content=shard)
            by_fqn = http.put(f"{server.url}/train/direct-send.tar?{fqn_query(fqn)}&{query}", content=b"")
            assert by_body.status_code == by_fqn.status_code == 200, by_body.text[:300]
            assert by_body.content == by_fqn.content
            outputs[name] = by_body.content
            after = wait_for_path(server.url, before, name)
            assert after.get(name, 0) - before.get(name, 0) == 2, (name, before, after)
    assert outputs["direct"] == outputs["loop"]
    members = read_tar(outputs["direct"])
    assert sum(name.endswith(".npy") for name, _ in members) == 24
    assert [name for name, _ in members if not name.endswith(".npy")] == \
        [name for name, _ in inputs if not name.endswith(".jpg")]


def test_a_caller_that_reads_only_after_sending_moves_the_response_back_to_the_event_loop(service: Service) -> None:
    # ~40 MB in, ~130 MB out: far more output than loopback buffers hold (this kernel autotunes a receive
    # buffer up to 32 MB), so the socket stalls while the body is still arriving.
    samples = 150
    shard = half_duplex_shard(samples)
    before = send_paths(service.url)
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        whole = http.put(f"{service.url}/bck/stalled.tar?" + args_query('{"seed": 5}'), content=shard)
    assert whole.status_code == 200, whole.text[:300]
    assert len(read_tar(whole.content)) == 3 * samples  # image, pass-through member and label of each
    after = wait_for_path(service.url, before, "direct_then_loop")
    assert after.get("direct_then_loop", 0) - before.get("direct_then_loop", 0) == 1, (before, after)


def test_ws_replies_written_directly_and_by_the_event_loop_are_identical(service: Service, loop_service: Service,
                                                                        disk: AisDisk) -> None:
    inputs = imagenet_like_members(24)
    fqn = disk.put("train", "direct-ws.tar", make_tar(inputs))
    replies = {}
    for name, server in (("direct", service), ("loop", loop_service)):
        before = send_paths(server.url)
        with ws_session(server) as ws:
            request(ws, "direct-ws.tar", fqn=fqn, etl_args=json.dumps({"seed": 3}))
            frames = list(ws.recv_streaming(decode=False))
        assert len(frames) > 3 and all(frames), f"{name}: {[len(f) for f in frames]}"
        replies[name] = b"".join(frames)
        after = wait_for_path(server.url, before, name)
        assert after.get(name, 0) - before.get(name, 0) == 1, (name, before, after)
    assert replies["direct"] == replies["loop"]
    assert sum(name.endswith(".npy") for name, _ in read_tar(replies["direct"])) == 24


def _replies_read_slowly_while_pinging(port: int, requests: list[bytes], tls: ssl.SSLContext | None = None
                                       ) -> tuple[list[bytes], int, int]:
    """ws requests (control messages, all sent at once as the target pipelines them) from a client that
    reads in small, slow steps and pings all through each reply, on one connection.

    Driven with wsproto over a raw socket with a small receive buffer, so the server's socket is full
    most of the time: a pong the server wrote in the middle of a frame would then break the framing.
    Returns the replies, the pings sent and the pongs received. ``tls``: over ``wss://`` with this
    context (one thread reads and writes the TLS connection).
    """
    connection = WSConnection(ConnectionType.CLIENT)
    replies: list[bytes] = []
    reply, pings, pongs, reads = bytearray(), 0, 0, 0
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT) as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        sock = tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls is not None else raw
        try:
            sock.sendall(connection.send(WsRequest(host=f"127.0.0.1:{port}", target="/ws")))
            while len(replies) < len(requests) or pongs < pings:
                data = sock.recv(16 * 1024)
                if not data:
                    raise ConnectionError("the server closed the connection")
                connection.receive_data(data)
                for event in connection.events():
                    if isinstance(event, AcceptConnection):
                        for message in requests:
                            sock.sendall(connection.send(BytesMessage(data=message)))
                    elif isinstance(event, BytesMessage):
                        reply += event.data
                        if event.message_finished:
                            replies.append(bytes(reply))
                            reply = bytearray()
                    elif isinstance(event, Pong):
                        pongs += 1
                    else:
                        raise AssertionError(f"unexpected {event!r}"[:300])
                reads += 1
                if len(replies) < len(requests) and reply and reads % 3 == 0:  # all through each reply
                    sock.sendall(connection.send(Ping(payload=b"%d" % pings)))
                    pings += 1
                time.sleep(0.0005)
        finally:
            sock.close()
    return replies, pings, pongs


def test_pings_during_a_direct_ws_reply_never_land_inside_its_frames(service: Service, disk: AisDisk) -> None:
    # A client that pings while the reply streams (websockets' own keepalive does, every 20 s): the
    # server's pong must not be written in the middle of a frame the shard's threads are writing.
    # Whether a stray pong lands inside a frame depends on timing (without the hold this failed in
    # most runs); tests/server/test_protocols.py checks the hold itself exactly.
    inputs = imagenet_like_members(32)
    fqn = disk.put("train", "direct-ws-pings.tar", make_tar(inputs))
    with ws_session(service) as ws:
        request(ws, "direct-ws-pings.tar", fqn=fqn, etl_args=json.dumps({"seed": 4}))
        reference = ws.recv(timeout=REPLY_TIMEOUT)
    before = send_paths(service.url)
    (reply,), pings, pongs = _replies_read_slowly_while_pinging(service.port, [control(
        "direct-ws-pings.tar", fqn=fqn, etl_args=json.dumps({"seed": 4}))])
    assert pings > 100 and pongs == pings
    assert reply == reference
    after = wait_for_path(service.url, before, "direct")
    assert after.get("direct", 0) - before.get("direct", 0) == 1, "the reply did not go direct: nothing was tested"


def test_pings_through_a_direct_ws_reply_that_fails_and_the_next_reply_on_its_connection(service: Service,
                                                                                       disk: AisDisk) -> None:
    # The same slow, pinging client; the first reply fails after most of it went out (a broken image at
    # the end, on_error=fail), while pongs are held back for the shard's threads. Its message must end
    # with the error, every pong must arrive outside the frames, and the next request, already sent on
    # the same connection, must get exactly the reply a fresh connection gets.
    inputs = imagenet_like_members(32, extra=False)
    good = disk.put("train", "direct-ws-good.tar", make_tar(inputs))
    failing = disk.put("train", "direct-ws-fails.tar", make_tar(inputs + [("zz-999999.jpg", inputs[0][1][:200])]))
    with ws_session(service) as ws:
        request(ws, "direct-ws-good.tar", fqn=good)
        reference = ws.recv(timeout=REPLY_TIMEOUT)
    before = send_paths(service.url)
    (failed, following), pings, pongs = _replies_read_slowly_while_pinging(service.port, [
        control("direct-ws-fails.tar", fqn=failing, etl_args='{"on_error": "fail"}'),
        control("direct-ws-good.tar", fqn=good),
    ])
    assert pings > 100 and pongs == pings
    at = failed.rfind(b'{"message": ')
    assert at > 0 and "zz-999999" in json.loads(failed[at:])["message"], failed[-300:]
    assert reference.startswith(failed[:at])
    assert following == reference
    after = wait_for_path(service.url, before, "direct")
    assert after.get("direct", 0) - before.get("direct", 0) == 2, "the replies did not go direct: nothing was tested"


# --- TLS: uvicorn serving https (its --ssl-certfile) --------------------------------------------------

# `wds-transform serve` has no TLS options; someone running uvicorn with the service's protocols and a
# certificate gets this server: transformer.serve's uvicorn options plus ssl_certfile/ssl_keyfile.
_TLS_SERVER = """
import sys

import uvicorn

from transformer.config import KEEPALIVE_SECONDS, Settings
from transformer.server.logs import serve_log_config
from transformer.server.protocols import DirectSendProtocol, FragmentingWebSocketProtocol

port, certfile, keyfile = sys.argv[1:4]
settings = Settings.from_env()
uvicorn.run("transformer.server:create_app", factory=True, host="127.0.0.1", port=int(port),
            timeout_keep_alive=KEEPALIVE_SECONDS,
            http=DirectSendProtocol, ws=FragmentingWebSocketProtocol,
            ws_max_size=min(16 * 2**30, max(settings.max_shard_bytes, 2**20)), ws_ping_interval=None,
            ws_ping_timeout=None, ws_per_message_deflate=False, log_level=settings.log_level,
            log_config=serve_log_config(settings.log_level), access_log=False,
            ssl_certfile=certfile, ssl_keyfile=keyfile)
"""


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def https_service(target: FakeTarget, disk: AisDisk, logs: Path, tls_files: TlsFiles) -> Iterator[Service]:
    port = free_port()
    command = [sys.executable, "-c", _TLS_SERVER, str(port), str(tls_files.server_cert), str(tls_files.server_key)]
    server = Service("transformer-https", command, transformer_env(target, disk), logs, port)
    server.url = f"https://127.0.0.1:{port}"
    server.wait_healthy(90, verify=ssl.create_default_context(cafile=str(tls_files.ca)))
    yield server
    server.stop()


def test_over_tls_the_output_is_never_written_around_the_tls_layer(service: Service, https_service: Service,
                                                                   tls_files: TlsFiles, disk: AisDisk) -> None:
    # A response or ws reply written straight to the socket would bypass the TLS layer: the client
    # would get plaintext in the middle of the TLS stream. Over https it takes the event loop's path.
    inputs = imagenet_like_members(16)  # several frames after the first: the part direct send would write
    shard = make_tar(inputs)
    fqn = disk.put("train", "tls-send.tar", shard)
    query = args_query(json.dumps({"preset": "imagenet-train", "seed": 13}))
    verify = ssl.create_default_context(cafile=str(tls_files.ca))
    with httpx.Client(timeout=60) as plain, httpx.Client(timeout=60, verify=verify) as https:
        reference = plain.put(f"{service.url}/train/tls-send.tar?{query}", content=shard)
        assert reference.status_code == 200, reference.text[:300]

        def paths() -> dict[str, float]:
            text = https.get(f"{https_service.url}/metrics").text
            return {sample.labels["path"]: sample.value for family in text_string_to_metric_families(text)
                    for sample in family.samples if sample.name == "etl_send_path_total"}

        before = paths()
        by_body = https.put(f"{https_service.url}/train/tls-send.tar?{query}", content=shard)
        by_fqn = https.put(f"{https_service.url}/train/tls-send.tar?{fqn_query(fqn)}&{query}", content=b"")
        assert by_body.status_code == by_fqn.status_code == 200, by_body.text[:300]
        assert by_body.content == by_fqn.content == reference.content
        # One thread reads and writes the TLS connection: a client that does so from two threads at once
        # (websockets' sync client) can lose the handshake's answer now and then.
        (reply,), pings, pongs = _replies_read_slowly_while_pinging(https_service.port, [control(
            "tls-send.tar", fqn=fqn, etl_args=json.dumps({"preset": "imagenet-train", "seed": 13}))], tls=verify)
        assert reply == reference.content and pongs == pings
        deadline = time.monotonic() + 5
        while (after := paths()).get("loop", 0) - before.get("loop", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert after.get("loop", 0) - before.get("loop", 0) == 3, (before, after)
    assert after.get("direct", 0) == before.get("direct", 0) and after.get("direct_then_loop", 0) == \
        before.get("direct_then_loop", 0), (before, after)

