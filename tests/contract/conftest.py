"""Fixtures of the contract suite: the fake AIS target(s), a fake next stage, the service under test.

The service is our real ``python -m transformer serve`` in a subprocess on 127.0.0.1 with
``AIS_TARGET_URL`` pointing at ``FakeTarget`` and ``ETL_FQN_ROOTS`` at a temporary "mountpath" where
objects are laid out as an AIS target stores them (``<mountpath>/@ais/<bucket>/%ob/<object>``).
The imagenet-val preset keeps outputs deterministic, so two requests for one shard compare equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget
from testbed.planted import planted
from testbed.service import Service, base_env, start_transformer

from .harness import start_reference

ETL_NAME = "wds-etl"
SECRET = "Sec4et9XyZ"


@pytest.fixture(scope="session")
def target() -> Iterator[FakeTarget]:
    fake = FakeTarget(ETL_NAME, SECRET).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def dest_target() -> Iterator[FakeTarget]:
    """Another target of the cluster (the owner of a destination object); the ETL secret is cluster-wide."""
    fake = FakeTarget(ETL_NAME, SECRET).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def stage() -> Iterator[FakeStage]:
    fake = FakeStage().start()
    yield fake
    fake.stop()


@pytest.fixture(autouse=True)
def _fresh_fakes(target: FakeTarget, dest_target: FakeTarget, stage: FakeStage) -> None:
    for fake in (target, dest_target, stage):
        fake.reset()


@pytest.fixture(scope="session")
def disk(tmp_path_factory: pytest.TempPathFactory) -> AisDisk:
    return AisDisk(tmp_path_factory.mktemp("ais"))


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


def transformer_env(target: FakeTarget, disk: AisDisk, **overrides: str) -> dict[str, str]:
    settings = {
        "AIS_TARGET_URL": target.ais_target_url,
        "direct_put": "true",  # what AIS sets for support_direct_put: true
        "ETL_FQN_ROOTS": str(disk.root),
        "ETL_OBJ_TIMEOUT": "30s",
        "ETL_WORKERS": "2",
        # Each shard in one of two worker processes (the default on 5 CPUs or more): every contract test
        # drives that design; the real-ETL suite (tests/ais) drives the pod's threads-only default on 2 CPUs.
        "ETL_PROCESSES": "2",
        "ETL_PRESET": "imagenet-val",
        "ETL_LOG_LEVEL": "warning",
    }
    return base_env(**{**settings, **overrides})


@pytest.fixture(scope="session")
def service(target: FakeTarget, disk: AisDisk, logs: Path) -> Iterator[Service]:
    server = start_transformer("transformer", logs, transformer_env(target, disk))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def loop_service(target: FakeTarget, disk: AisDisk, logs: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The service with every body and ws frame sent by the event loop (no direct send: ``testbed/planted.py``)."""
    env = transformer_env(target, disk, **planted(tmp_path_factory.mktemp("loop-send"), "loop-send"))
    server = start_transformer("transformer-loop-send", logs, env)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def impatient(target: FakeTarget, disk: AisDisk, logs: Path) -> Iterator[Service]:
    """A second service whose obj_timeout is 2 s, for the timeout contract (started only when asked for)."""
    server = start_transformer("transformer-2s", logs, transformer_env(target, disk, ETL_OBJ_TIMEOUT="2s"))
    yield server
    server.stop()


def _http(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        yield http


@pytest.fixture(scope="session")
def client(service: Service) -> Iterator[httpx.Client]:
    yield from _http(service)


@pytest.fixture(scope="session")
def reference(target: FakeTarget, logs: Path) -> Iterator[Service]:
    # No direct-put retries: its backoff (1, 2, 4 s) would only slow the suite, the outcomes compared
    # here do not depend on it.
    server = start_reference(logs, base_env(AIS_TARGET_URL=target.ais_target_url, AIS_DIRECT_PUT_RETRIES="0"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ref_client(reference: Service) -> Iterator[httpx.Client]:
    yield from _http(reference)
