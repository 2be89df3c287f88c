"""The ETL secret never reaches the pod's log nor an answer AIS records, on any path that uses it.

AIS shows the pod's log to its users (``ais etl view-logs``) and the pod's error bodies too (``ais etl
show errors``); the secret in ``AIS_TARGET_URL`` opens every object of the cluster. Here the real
``serve`` runs with every logger at DEBUG (``ETL_LOG_LEVEL=debug``: the root logger, so httpx and
httpcore, and uvicorn's error and access logs, which carry websockets' own debug lines), and each path
that puts the secret in a URL is driven, failures included: the chunked-object size check and fetch,
the hpull fetch, the direct put, pipeline hops, ws, ``/download``, a fetch cut after the response
began (a traceback from uvicorn), a target that is down (httpx exceptions). After each, the log lines
it wrote and every answer must hold neither the secret nor the full ``AIS_TARGET_URL``, while the
masked URL shows the lines were there to check. Lines written later (threads still finishing, the
shutdown) are read by the package's last check (``secret_checked_last``): every service's whole log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from testbed import inputs
from testbed.fake_ais import AisDisk, FakeStage, Fault, go_path_escape
from testbed.ports import free_port
from testbed.service import Service, start_transformer
from testbed.shardgen import make_tar
from tests.contract.harness import escaped_uname, fqn_query
from transformer.wire import path_escape

from .conftest import ETL_NAME, SECRET, HeadAwareTarget, service_env

SHARD = make_tar(inputs.good_members(3))
BIG = make_tar(inputs.good_members(24))
MASKED = f"/v1/etl/_object/{ETL_NAME}/***/"


def ais_error(target: HeadAwareTarget, uname: str, message: str) -> bytes:
    """An error body as an AIS target writes it (cmn.ErrHTTP): it echoes the request's path, secret and all."""
    return json.dumps({"message": message, "method": "GET", "url_path": f"{target.etl_path}/{go_path_escape(uname)}",
                       "remote_addr": "127.0.0.1:40000", "status": 500}).encode()


class DebugPod:
    """The service at DEBUG, and the part of its log written since ``mark``."""

    def __init__(self, service: Service, target: HeadAwareTarget):
        self.service, self.target, self._offset = service, target, 0

    def mark(self) -> None:
        self._offset = self.service.log_path.stat().st_size

    def new_log(self, settle: float = 0.3) -> str:
        time.sleep(settle)  # lines of threads still finishing (the access log after the answer)
        return self.service.log_path.read_bytes()[self._offset:].decode("utf-8", "replace")

    def assert_clean(self, *answers: str | bytes, masked: bool = True) -> str:
        log = self.new_log()
        for text in (log, *answers):
            text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
            assert SECRET not in text, _around(text, SECRET)
            assert self.target.ais_target_url not in text, _around(text, self.target.ais_target_url)
        if masked:  # the URL was logged (httpx at INFO, at least), masked
            assert MASKED in log, log[-3000:]
        return log


def _around(text: str, needle: str) -> str:
    at = text.find(needle)
    return text[max(0, at - 600): at + 200]


@pytest.fixture(scope="module")
def debug_service(target_server: HeadAwareTarget, disk: AisDisk, logs: Path) -> Iterator[Service]:
    env = service_env(target_server, disk, ETL_LOG_LEVEL="debug", PYTHONUNBUFFERED="1")
    server = start_transformer("secret-debug", logs, env)
    yield server
    server.stop()


@pytest.fixture
def pod(debug_service: Service, target: HeadAwareTarget) -> Iterator[DebugPod]:
    watched = DebugPod(debug_service, target)
    watched.mark()
    yield watched
    assert debug_service.process.poll() is None, debug_service.log_tail()


@pytest.fixture
def http(debug_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=debug_service.url, timeout=httpx.Timeout(30.0, connect=5.0)) as client:
        yield client


def test_the_log_really_is_at_debug_for_every_library(pod: DebugPod, http: httpx.Client,
                                                      target: HeadAwareTarget) -> None:
    target.objects["ais/@#/src/debug.tar"] = SHARD
    assert http.get(f"/{escaped_uname('src', 'debug.tar')}").status_code == 200
    log = pod.assert_clean()
    assert "httpx: HTTP Request: GET" in log  # httpx's request line, at INFO
    assert "DEBUG httpcore." in log  # httpcore's traces
    assert 'src/debug.tar HTTP/1.1" 200' in log  # uvicorn's access log


def test_chunked_object_size_check_and_fetch(pod: DebugPod, http: httpx.Client, disk: AisDisk,
                                             target: HeadAwareTarget) -> None:
    fqn = disk.put("src", "chunked.tar", SHARD[: len(SHARD) // 3])
    target.objects["ais/@#/src/chunked.tar"] = SHARD
    ok = http.put(f"/src/chunked.tar?{fqn_query(fqn)}", content=b"")
    assert ok.status_code == 200, ok.text
    fqn = disk.put("src", "chunked-broken.tar", SHARD[: len(SHARD) // 3])
    target.objects["ais/@#/src/chunked-broken.tar"] = SHARD
    target.set_fault("ais/@#/src/chunked-broken.tar",
                     Fault(status=500, body=ais_error(target, "ais/@#/src/chunked-broken.tar", "disk error")))
    failed = http.put(f"/src/chunked-broken.tar?{fqn_query(fqn)}", content=b"")
    assert failed.status_code == 502 and "disk error" in failed.text
    pod.assert_clean(failed.content)


def test_hpull_fetch_and_its_failures(pod: DebugPod, http: httpx.Client, target: HeadAwareTarget) -> None:
    target.objects["ais/@#/src/pulled.tar"] = SHARD
    assert http.get(f"/{escaped_uname('src', 'pulled.tar')}").status_code == 200
    missing = http.get(f"/{escaped_uname('src', 'missing.tar')}")
    target.objects["ais/@#/src/refused.tar"] = SHARD
    target.set_fault("ais/@#/src/refused.tar",
                     Fault(status=500, body=ais_error(target, "ais/@#/src/refused.tar", "refused")))
    refused = http.get(f"/{escaped_uname('src', 'refused.tar')}")
    target.objects["ais/@#/src/reset.tar"] = SHARD
    target.set_fault("ais/@#/src/reset.tar", Fault(reset=True))
    reset = http.get(f"/{escaped_uname('src', 'reset.tar')}")
    assert (missing.status_code, refused.status_code, reset.status_code) == (404, 502, 502)
    pod.assert_clean(missing.content, refused.content, reset.content)


def test_an_upstream_error_body_is_masked_before_it_is_shortened(pod: DebugPod, http: httpx.Client,
                                                                  target: HeadAwareTarget) -> None:
    # Only the first 300 characters of a target's error are kept: cut after masking, or a cut inside an
    # escaped secret (no marker to recognise it by) would leave its first characters.
    escaped = f"%2Fv1%2Fetl%2F_object%2F{ETL_NAME}%2F{SECRET}%2Fais"
    body = ("x" * (300 - escaped.index(SECRET) - 6) + escaped).encode()
    target.objects["ais/@#/src/long.tar"] = SHARD
    target.set_fault("ais/@#/src/long.tar", Fault(status=500, body=body))
    response = http.get(f"/{escaped_uname('src', 'long.tar')}")
    assert response.status_code == 502 and "xxxxxxxx" in response.text
    assert SECRET[:6] not in response.text, response.text
    pod.assert_clean(response.content)


def test_hpull_fetch_cut_after_the_response_began(pod: DebugPod, debug_service: Service,
                                                  target: HeadAwareTarget) -> None:
    # The pod aborts its answer; the reason is one line of its log, the fetch's URL masked (a foreseen
    # failure: no traceback).
    target.objects["ais/@#/src/cut.tar"] = BIG
    target.set_fault("ais/@#/src/cut.tar", Fault(drop_after=len(BIG) // 2))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{debug_service.url}/{escaped_uname('src', 'cut.tar')}", timeout=30).raise_for_status()
    log = pod.assert_clean()
    assert "cut.tar: RemoteProtocolError: peer closed connection" in log and "Traceback" not in log, log


def test_direct_put_and_its_failures(pod: DebugPod, http: httpx.Client, target: HeadAwareTarget) -> None:
    def entry(name: str, host: str = target.base_url) -> dict[str, str]:
        return {"Ais-Node-Url": f"{host}/{escaped_uname('dst', name)}?owt=3&uuid=tcb-1"}

    assert http.put("/src/put.tar", content=SHARD, headers=entry("put.tar")).status_code == 204
    target.set_fault("ais/@#/dst/denied.tar",
                     Fault(status=403, body=ais_error(target, "ais/@#/dst/denied.tar", "read-only bucket")))
    denied = http.put("/src/denied.tar", content=SHARD, headers=entry("denied.tar"))
    unreachable = http.put("/src/away.tar", content=SHARD, headers=entry("away.tar", f"http://127.0.0.1:{free_port()}"))
    assert (denied.status_code, unreachable.status_code) == (403, 503)
    assert "read-only bucket" in denied.text
    pod.assert_clean(denied.content, unreachable.content)


def test_pipeline_hops(pod: DebugPod, http: httpx.Client, target: HeadAwareTarget, stage: FakeStage) -> None:
    last = f"{target.base_url}/{escaped_uname('dst', 'piped.tar')}?owt=3"
    stage.reply = "delivered"
    through = http.put("/src/piped.tar", content=SHARD, headers={"Ais-Node-Url": f"{stage.base_url},{last}"})
    assert through.status_code == 204
    stage.set_fault("/src/piped-err.tar", Fault(status=500, body=ais_error(target, "ais/@#/dst/x", "stage failed")))
    failed = http.put("/src/piped-err.tar", content=SHARD, headers={"Ais-Node-Url": f"{stage.base_url},{last}"})
    assert failed.status_code == 500 and "stage failed" in failed.text
    # Only our own direct put puts the secret in a URL: the stage's PUT carries the entry as it was.
    assert SECRET not in stage.recorded("PUT")[0].headers.get("ais-node-url", "")
    pod.assert_clean(failed.content, masked=False)


def test_ws_fetch_direct_put_and_error_reply(pod: DebugPod, debug_service: Service, disk: AisDisk,
                                             target: HeadAwareTarget) -> None:
    fqn = disk.put("src", "ws-chunked.tar", SHARD[: len(SHARD) // 3])
    target.objects["ais/@#/src/ws-chunked.tar"] = SHARD
    fqn_bad = disk.put("src", "ws-bad.tar", SHARD[: len(SHARD) // 3])
    target.objects["ais/@#/src/ws-bad.tar"] = SHARD
    target.set_fault("ais/@#/src/ws-bad.tar",
                     Fault(status=500, body=ais_error(target, "ais/@#/src/ws-bad.tar", "gone")))
    put_entry = f"{target.base_url}/{escaped_uname('dst', 'ws-put.tar')}?owt=3"
    with connect(f"ws://127.0.0.1:{debug_service.port}/ws", max_size=None, open_timeout=10) as ws:
        ws.send(json.dumps({"path": "ws-chunked.tar", "fqn": path_escape(fqn)}).encode())
        fetched = ws.recv(timeout=30)
        ws.send(json.dumps({"path": "ws-put.tar", "pipeline": put_entry}).encode())
        ws.send(SHARD)
        delivered = ws.recv(timeout=30)
        ws.send(json.dumps({"path": "ws-bad.tar", "fqn": path_escape(fqn_bad)}).encode())
        error = ws.recv(timeout=30)
    assert isinstance(fetched, bytes) and isinstance(delivered, str)
    assert json.loads(error)["status"] == 502 and "gone" in json.loads(error)["message"]
    pod.assert_clean(error)


def test_download(pod: DebugPod, http: httpx.Client, target: HeadAwareTarget) -> None:
    target.origin["o.tar"] = SHARD
    ok = http.post("/download", params={"original_url": f"{target.base_url}/origin/o.tar", "object_to": "o.tar"})
    assert ok.status_code == 200
    # A caller that names the target's ETL endpoint itself (it knows the secret): still masked in the log.
    target.objects["ais/@#/src/dl.tar"] = SHARD
    direct = f"{target.ais_target_url}/{escaped_uname('src', 'dl.tar')}"
    http.post("/download", params={"original_url": direct, "object_to": "dl.tar"})
    gone = http.post("/download", params={"original_url": f"{target.ais_target_url}/{escaped_uname('src', 'no')}"})
    assert gone.status_code == 404
    pod.assert_clean(gone.content)


def test_a_target_that_is_down(disk: AisDisk, logs: Path) -> None:
    # httpx's exceptions (connection refused) on the size check and the fetch, at DEBUG.
    secret_url = f"http://127.0.0.1:{free_port()}/v1/etl/_object/{ETL_NAME}/{SECRET}"

    class Down:
        ais_target_url = secret_url

    server = start_transformer("secret-down", logs, service_env(Down, disk, ETL_LOG_LEVEL="debug",  # type: ignore[arg-type]
                                                                PYTHONUNBUFFERED="1"))
    try:
        fqn = disk.put("src", "down.tar", SHARD)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            local = http.put(f"/src/down.tar?{fqn_query(fqn)}", content=b"")  # HEAD fails: the file is read
            fetched = http.get(f"/{escaped_uname('src', 'down.tar')}")
        assert local.status_code == 200 and fetched.status_code == 502
        time.sleep(0.3)
        log = server.log_path.read_text(errors="replace")
        for text in (log, fetched.text):
            assert SECRET not in text and secret_url not in text, _around(text, SECRET)
        assert MASKED in log and "ConnectError" in log
    finally:
        server.stop()
