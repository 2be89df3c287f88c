"""Fixtures of the client suite: a fake AIS proxy, an SDK client on it, the real service on loopback.

The service is ``python -m transformer serve`` in a subprocess on 127.0.0.1 (the contract suite's
harness), reading shards through ``etl_fqn`` from a temporary mountpath in the AIS layout; the fake
proxy stores its objects in that same mountpath and redirects ETL GETs to the service as an AIS
target does for ``hpull://``. Shards hold small real photographs (``tests.shardgen``) so a run stays
quick on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract.harness import Service, base_env, start_transformer
from tests.shardgen import jpeg_bytes, make_tar

from .fake_proxy import FakeProxy

# Tiny, deterministic output: 32x32 uint8 (3 KB per sample instead of 602 KB).
SMALL = {"transforms": [{"Resize": {"size": [32, 32]}}], "dtype": "uint8"}


@pytest.fixture(scope="session")
def mountpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ais-mountpath")


@pytest.fixture(scope="session")
def service(mountpath: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = base_env(ETL_FQN_ROOTS=str(mountpath), ETL_WORKERS="2", ETL_OBJ_TIMEOUT="60s", ETL_LOG_LEVEL="warning")
    server = start_transformer("client-suite-transformer", tmp_path_factory.mktemp("logs"), env)
    yield server
    server.stop()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[FakeProxy]:
    with FakeProxy(tmp_path / "mountpath") as fake:
        yield fake
    assert fake.problems == [], fake.problems  # every request the client made followed the contract


@pytest.fixture
def served_proxy(mountpath: Path, service: Service, request: pytest.FixtureRequest) -> Iterator[FakeProxy]:
    """A fake proxy whose objects the service can read (shared mountpath, one bucket per test)."""
    with FakeProxy(mountpath, pod_url=service.url) as fake:
        yield fake
    assert fake.problems == [], fake.problems


@pytest.fixture
def ais(proxy: FakeProxy):
    from aistore.sdk import Client

    return Client(proxy.url, timeout=(2, 30))


def labelled_shard(first: int, count: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """``sample-<i>.jpg`` + ``.cls`` (label i) for i in [first, first + count); photo i % 4."""
    members = []
    for i in range(first, first + count):
        members.append((f"sample-{i:05d}.jpg", jpeg_bytes(i, size)))
        members.append((f"sample-{i:05d}.cls", str(i).encode()))
    return make_tar(members)
