"""SIGTERM while shards are in flight: finish or fail cleanly within the grace period, refuse new work.

``wds-transform serve`` runs uvicorn with ``timeout_graceful_shutdown`` = ``ETL_OBJ_TIMEOUT``: on
SIGTERM it closes the listening socket at once (new connections are refused, so K8s/AIS move on to
another pod), lets in-flight requests finish, then re-raises SIGTERM on itself (uvicorn >= 0.29), so the
exit status is -15 / 143 only after the drain. A request can never outlive its object timeout, so the
grace period always covers it. Each test starts its own service.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from testbed import inputs
from testbed.fake_ais import AisDisk, Fault
from testbed.service import Service, start_transformer
from testbed.shardgen import make_tar, read_tar
from tests.contract.harness import escaped_uname

from .conftest import HeadAwareTarget, service_env, wait_until

GRACE = 8.0  # = ETL_OBJ_TIMEOUT of these services
EXITED_ON_SIGTERM = -signal.SIGTERM  # after the graceful drain


@pytest.fixture
def fresh(target: HeadAwareTarget, disk: AisDisk, logs: Path) -> Service:
    server = start_transformer("sigterm", logs, service_env(target, disk, ETL_OBJ_TIMEOUT=f"{GRACE:g}s"))
    yield server
    server.stop()


def _in_background(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _refuses_connections(service: Service) -> bool:
    try:
        httpx.get(service.url + "/health", timeout=1.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_in_flight_request_finishes_and_new_connections_are_refused(fresh: Service,
                                                                    target: HeadAwareTarget) -> None:
    shard = make_tar(inputs.good_members(3))
    target.objects["ais/@#/src/inflight.tar"] = shard
    target.set_fault("ais/@#/src/inflight.tar", Fault(stall=2.0))  # keeps the request in flight
    expected = httpx.put(f"{fresh.url}/src/inflight.tar", content=shard, timeout=30).content

    thread, box = _in_background(lambda: httpx.get(f"{fresh.url}/{escaped_uname('src', 'inflight.tar')}",
                                                   timeout=30))
    assert wait_until(lambda: target.recorded("GET"), timeout=10)  # the fetch is under way
    started = time.monotonic()
    fresh.process.send_signal(signal.SIGTERM)

    assert wait_until(lambda: _refuses_connections(fresh), timeout=2), "still accepting after SIGTERM"
    thread.join(timeout=GRACE + 5)
    assert "error" not in box, box.get("error")
    response = box["result"]
    assert response.status_code == 200
    assert read_tar(response.content) == read_tar(expected)  # complete, not cut
    assert fresh.process.wait(timeout=GRACE + 5) == EXITED_ON_SIGTERM
    assert time.monotonic() - started < GRACE + 3


def test_streaming_response_completes_after_sigterm(fresh: Service) -> None:
    shard = make_tar(inputs.good_members(30))
    received = bytearray()
    first_bytes = threading.Event()

    def stream() -> int:
        with httpx.stream("PUT", f"{fresh.url}/src/stream.tar", content=shard, timeout=30) as response:
            for chunk in response.iter_raw():
                received.extend(chunk)
                first_bytes.set()
            return response.status_code

    thread, box = _in_background(stream)
    assert first_bytes.wait(timeout=30)
    fresh.process.send_signal(signal.SIGTERM)
    thread.join(timeout=GRACE + 5)
    assert "error" not in box, box.get("error")
    assert box["result"] == 200
    names = [n for n, _ in read_tar(bytes(received))]
    assert names == [n.replace(".jpg", ".npy") for n, _ in inputs.good_members(30)]
    assert fresh.process.wait(timeout=GRACE + 5) == EXITED_ON_SIGTERM


def test_request_longer_than_its_deadline_fails_cleanly_before_exit(fresh: Service, target: HeadAwareTarget) -> None:
    target.objects["ais/@#/src/forever.tar"] = make_tar(inputs.good_members(1))
    target.set_fault("ais/@#/src/forever.tar", Fault(stall=60))
    thread, box = _in_background(lambda: httpx.get(f"{fresh.url}/{escaped_uname('src', 'forever.tar')}",
                                                   timeout=30))
    assert wait_until(lambda: target.recorded("GET"), timeout=10)
    fresh.process.send_signal(signal.SIGTERM)
    thread.join(timeout=GRACE + 5)
    assert box["result"].status_code == 504  # a clear error from the object deadline, not a dropped socket
    assert "timed out" in box["result"].text
    assert fresh.process.wait(timeout=5) == EXITED_ON_SIGTERM


def test_idle_service_exits_at_once(fresh: Service) -> None:
    with httpx.Client(base_url=fresh.url) as keep_alive:  # an idle keep-alive connection stays open
        assert keep_alive.get("/health").status_code == 200
        started = time.monotonic()
        fresh.process.send_signal(signal.SIGTERM)
        assert fresh.process.wait(timeout=GRACE) == EXITED_ON_SIGTERM
    assert time.monotonic() - started < 3
