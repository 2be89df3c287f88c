"""Fixtures of the reliability suite: the real service with tight limits, and the fakes it talks to.

The service is ``python -m transformer serve`` in a subprocess on 127.0.0.1 (the contract suite's
harness), with small size limits and a short object timeout so that every limit and fault is cheap
to reach. After each test the service must still answer ``/health``: no input may take it down.
The fakes (AIS target and its disk, next stage) are ``testbed.fake_ais``'s. Every service logs at
DEBUG; when the package's tests are done, no line of any service's whole log and no error body the
tests received holds the ETL secret (``tests/secret_check.py``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget, Recorded
from testbed.service import Service, base_env, start_transformer
from tests.secret_check import BodyRecorder, PodLog, check_last

ETL_NAME = "wds-etl"
SECRET = "Rel1ab1eXy"
MAX_MEMBER_BYTES = 2 * 2**20
MAX_SHARD_BYTES = 12 * 2**20
OBJ_TIMEOUT = 4.0


class HeadAwareTarget(FakeTarget):
    """The contract suite's fake target plus ``HEAD`` of an object, as AIS answers it (Content-Length = size).

    ``head_status[uname]`` makes HEAD of that object answer another status (e.g. 405, as an AIS
    version without the handler would), to exercise the fallback.
    """

    def __init__(self, etl_name: str, secret: str) -> None:
        super().__init__(etl_name, secret)
        self.head_status: dict[str, int] = {}

    def reset(self) -> None:
        super().reset()
        self.head_status.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await super().__call__(scope, receive, send)
            return
        entry = Recorded("HEAD", scope["raw_path"].decode("latin-1"), scope["query_string"].decode("latin-1"),
                         {}, b"", time.monotonic())
        self.record(entry)
        uname = unquote(entry.raw_path.rsplit("/", 1)[-1])
        status = self.head_status.get(uname, 200 if uname in self.objects else 404)
        headers = [(b"content-length", str(len(self.objects[uname])).encode())] if status == 200 else []
        entry.answered_at = time.monotonic()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def service_env(target: FakeTarget, disk: AisDisk, **overrides: str) -> dict[str, str]:
    env = {
        "AIS_TARGET_URL": target.ais_target_url,
        "direct_put": "true",
        "ETL_FQN_ROOTS": str(disk.root),
        "ETL_OBJ_TIMEOUT": f"{OBJ_TIMEOUT:g}s",
        "ETL_WORKERS": "2",
        "ETL_PRESET": "imagenet-val",
        "ETL_MAX_MEMBER_BYTES": str(MAX_MEMBER_BYTES),
        "ETL_MAX_SHARD_BYTES": str(MAX_SHARD_BYTES),
        "ETL_LOG_LEVEL": "debug",
    }
    env.update(overrides)
    return base_env(**env)


@pytest.fixture(scope="session")
def target_server() -> Iterator[HeadAwareTarget]:
    fake = HeadAwareTarget(ETL_NAME, SECRET).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def stage_server() -> Iterator[FakeStage]:
    fake = FakeStage().start()
    yield fake
    fake.stop()


@pytest.fixture
def target(target_server: HeadAwareTarget) -> HeadAwareTarget:
    """The fake AIS target (``AIS_TARGET_URL``), with no objects, faults or records from other tests."""
    target_server.reset()
    return target_server


@pytest.fixture
def stage(stage_server: FakeStage) -> FakeStage:
    """The fake next ETL stage, reset."""
    stage_server.reset()
    return stage_server


@pytest.fixture(scope="session")
def disk(tmp_path_factory: pytest.TempPathFactory) -> AisDisk:
    return AisDisk(tmp_path_factory.mktemp("ais"))


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability-logs")


@pytest.fixture(scope="package", autouse=True)
def secret_checked_last(logs: Path) -> Iterator[BodyRecorder]:
    """Records the error bodies the tests receive; once every test of the package ran, checks them and every
    line of every service's whole log (all services started on ``logs``, stopped ones too) for the secret."""
    recorder = BodyRecorder().install()
    try:
        yield recorder
    finally:
        recorder.uninstall()
    services = [PodLog(s.name, s.log_path, s.env.get("AIS_TARGET_URL", ""), s.env.get("ETL_LOG_LEVEL", "info"))
                for s in Service.started if s.log_path.parent == logs]
    check_last(services, recorder.bodies)


@pytest.fixture(scope="session")
def service(target_server: FakeTarget, disk: AisDisk, logs: Path) -> Iterator[Service]:
    server = start_transformer("reliability", logs, service_env(target_server, disk))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=httpx.Timeout(30.0, connect=5.0)) as http:
        yield http


@pytest.fixture
def still_serving(service: Service) -> Iterator[Service]:
    """The shared service; after the test it must be alive and answer /health (it keeps serving)."""
    yield service
    assert service.process.poll() is None, f"the service died:\n{service.log_tail()}"
    assert httpx.get(service.url + "/health", timeout=5.0).status_code == 200


# ------------------------------------------------------------------------------- process measurements


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metric(service: Service, name: str, labels: str = "") -> float:
    """The value of one sample of GET /metrics (0 when absent), e.g. ``metric(s, "etl_inflight_shards")``."""
    text = httpx.get(service.url + "/metrics", timeout=5.0).text
    pattern = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition()`` until it is true or ``timeout`` seconds passed; the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
