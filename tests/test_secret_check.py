"""The check run last by the real-ETL and reliability packages (``tests/secret_check.py``) reports a planted
secret by pod, file and line, and a body received through each client the tests use, by its source."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import requests
from websockets.sync.client import connect
from websockets.sync.server import ServerConnection, serve

from testbed.httpserve import QuietServer
from tests.secret_check import BodyRecorder, PodLog, check_last, debug_gaps, leaks, planted_is_found

SECRET = "Pl4ntedS3cret"
TARGET_URL = f"http://10.0.0.2:51081/v1/etl/_object/etl-x/{SECRET}"
CLEAN = [
    "2026-11-26 21:00:00,001 INFO uvicorn.error: Started server process [7]",
    "2026-11-26 21:00:01,002 DEBUG httpcore.connection: connect_tcp.started host='10.0.0.2' port=51081",
    '2026-11-26 21:00:01,003 INFO httpx: HTTP Request: HEAD http://10.0.0.2:51081/v1/etl/_object/etl-x/***/'
    'ais%2F@%23%2Fsrc%2Fa.tar "HTTP/1.1 200 OK"',
    "2026-11-26 21:00:01,004 INFO uvicorn.access: 10.0.0.2:40000 - \"PUT /src/a.tar?etl_fqn=x HTTP/1.1\" 200",
]


def pod_log(folder: Path, lines: list[str], level: str = "debug", name: str = "etl-x-abcde") -> PodLog:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log").write_text("\n".join(lines) + "\n")
    return PodLog(name, folder / "log", TARGET_URL, level, "etl-x")


def test_a_clean_debug_log_passes(tmp_path: Path) -> None:
    log = pod_log(tmp_path, CLEAN)
    assert leaks([log], []) == [] and debug_gaps([log], ["etl-x"]) == []
    check_last([log], [], ["etl-x"])


@pytest.mark.parametrize("planted", [f"GET {TARGET_URL}/ais%2Fx", f"Traceback: secret={SECRET}"], ids=["url", "secret"])
def test_a_planted_line_is_reported_by_pod_file_and_line(tmp_path: Path, planted: str) -> None:
    clean = pod_log(tmp_path / "clean", CLEAN, name="etl-x-clean")
    dirty = pod_log(tmp_path / "dirty", [*CLEAN[:2], planted, *CLEAN[2:]])
    found = leaks([clean, dirty], [])
    assert {(leak.line, leak.text) for leak in found} == {(3, planted)}
    assert all(f"pod etl-x-abcde ({dirty.path})" in leak.where for leak in found)
    with pytest.raises(AssertionError, match=rf"log of pod etl-x-abcde \({dirty.path}\), line 3: the "):
        check_last([clean, dirty], [])


def test_a_secret_in_another_pods_log_is_found_too(tmp_path: Path) -> None:
    other = PodLog("etl-y-fghij", pod_log(tmp_path / "y", CLEAN).path, TARGET_URL.replace(SECRET, "0therSecr3t"))
    mine = pod_log(tmp_path / "x", [*CLEAN, "leaked 0therSecr3t"])
    assert [(leak.line, leak.what) for leak in leaks([mine, other], [])] == [(5, "the ETL secret of pod etl-y-fghij")]


def test_planted_is_found_on_a_copy_and_leaves_the_log_alone(tmp_path: Path) -> None:
    log = pod_log(tmp_path, CLEAN)
    assert planted_is_found([log]) == ""
    assert log.path.read_text().splitlines() == CLEAN


@pytest.mark.parametrize(("level", "lines", "gap"), [
    ("info", [CLEAN[2]], "used the secret at ETL_LOG_LEVEL=info, not debug"),
    ("debug", [CLEAN[0], CLEAN[2]], "runs at debug but logged no DEBUG line"),
    ("debug", [CLEAN[0], CLEAN[1], CLEAN[3]], "pods served objects, none used the secret at DEBUG"),
], ids=["not-debug", "no-debug-line", "served-without-the-secret"])
def test_a_log_that_proves_little_is_a_failure(tmp_path: Path, level: str, lines: list[str], gap: str) -> None:
    log = pod_log(tmp_path, lines, level)
    assert any(gap in line for line in debug_gaps([log])), debug_gaps([log])
    with pytest.raises(AssertionError, match=gap):
        check_last([log], [])


def test_an_etl_whose_pods_served_objects_without_the_secret_is_a_failure(tmp_path: Path) -> None:
    ws = PodLog("etl-ws-abcde", pod_log(tmp_path / "ws", [CLEAN[1], CLEAN[3]]).path, TARGET_URL, "debug", "etl-ws")
    assert debug_gaps([pod_log(tmp_path / "x", CLEAN), ws], ["etl-x", "etl-ws"]) == [
        "pods of etl-ws served objects, none used the secret at DEBUG (no masked ETL object URL in a DEBUG log)"]


def test_pods_that_served_nothing_prove_nothing_and_need_nothing(tmp_path: Path) -> None:
    idle = pod_log(tmp_path, [CLEAN[0], '... "GET /health HTTP/1.1" 200 OK'])
    assert debug_gaps([idle], ["etl-x"]) == []


def test_an_etl_registered_as_a_user_would_may_log_at_info(tmp_path: Path) -> None:
    user = pod_log(tmp_path / "user", [CLEAN[2]], "info", name="wds-transform-t1")
    user = PodLog(user.name, user.path, TARGET_URL, "info", "wds-transform")
    assert debug_gaps([pod_log(tmp_path / "x", CLEAN), user], other_levels=["wds-transform"]) == []
    assert debug_gaps([pod_log(tmp_path / "x", CLEAN), user]) != []


def test_a_target_url_without_a_secret_is_refused(tmp_path: Path) -> None:
    log = PodLog("etl-x", pod_log(tmp_path, CLEAN).path, "http://10.0.0.2:51081/")
    with pytest.raises(ValueError, match="has no secret"):
        leaks([log], [])


class _Leaky(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, body = (200, b"ok") if self.path == "/ok" else (500, f"failed: {TARGET_URL}/x".encode())
        self.send_response(status)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(body) // 2  # the secret split over two chunks
            for piece in (body[:half], body[half:], b""):
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def leaky() -> Iterator[str]:
    server = QuietServer(("127.0.0.1", 0), _Leaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def recorder() -> Iterator[BodyRecorder]:
    recording = BodyRecorder().install()
    yield recording
    recording.uninstall()


def _ws_reply(connection: ServerConnection) -> None:
    connection.recv()
    connection.send(f'{{"status": 502, "message": "{TARGET_URL}"}}')


def test_error_bodies_are_recorded_wherever_the_tests_receive_them(tmp_path: Path, leaky: str,
                                                                    recorder: BodyRecorder) -> None:
    assert requests.get(f"{leaky}/ok", timeout=10).text == "ok"
    assert requests.get(f"{leaky}/plain", timeout=10).status_code == 500
    with requests.get(f"{leaky}/chunked", stream=True, timeout=10) as streamed:
        b"".join(streamed.iter_content(7))
    assert httpx.get(f"{leaky}/plain", timeout=10).status_code == 500

    async def fetch() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            await client.get(f"{leaky}/chunked")

    asyncio.run(fetch())
    with serve(_ws_reply, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with connect(f"ws://127.0.0.1:{server.socket.getsockname()[1]}") as ws:
            ws.send("x")
            ws.recv(timeout=10)
    sources = [body.source for body in recorder.bodies]
    assert len(sources) == 5 and not any("/ok" in source for source in sources), sources
    found = leaks([pod_log(tmp_path, CLEAN)], recorder.bodies)
    assert {leak.where for leak in found} == {f"error body of {source}" for source in sources}
    with pytest.raises(AssertionError, match=r"error body of http://127\.0\.0\.1:\d+/plain \(HTTP 500\), line 1"):
        check_last([pod_log(tmp_path, CLEAN)], recorder.bodies)


def test_uninstall_puts_the_clients_back(leaky: str) -> None:
    recording = BodyRecorder().install()
    recording.uninstall()
    requests.get(f"{leaky}/plain", timeout=10)
    httpx.get(f"{leaky}/plain", timeout=10)
    assert recording.bodies == []
