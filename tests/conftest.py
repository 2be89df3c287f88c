"""Shared fixtures for the core-module tests: default settings, options from etl_args, a pool.

The engine's modules are imported by the fixtures that use them, not here: the client's tests also run
where only the client's dependencies are installed (``python -m bench.gpu`` on a GPU machine).
"""

from __future__ import annotations

from testbed import userns

userns.enter()  # an unprivileged run: root in a user namespace, while the process has one thread (testbed/userns.py)

import io  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from transformer.config import Settings
    from transformer.engine import ShardReport
    from transformer.options import TransformOptions
    from transformer.pool import TransformPool
    from transformer.shards import Sample


# Test packages whose package-scoped fixtures check every test of the package at its end: one xdist work unit each.
WHOLE_PACKAGES = ("tests/ais/", "tests/reliability/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test`` runs ``-n 2 --dist loadfile``: each test file on one worker, so its module fixtures run
    once. Here all of ``tests/ais/`` counts as one file: its session cluster and its ETL package's cluster then
    start once, and the package's end-of-run checks (the secret check's "some pod used the secret at DEBUG")
    see every test of the package. ``tests/reliability/`` is one too, for its own end-of-package secret check.
    ``--dist loadgroup`` would say this with marks, but xdist 3.8 groups by
    rewriting node ids, which pytest 9.2 no longer allows (pytest-xdist#1386): the marks are silently ignored."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    last = not userns.can_leave_a_network_namespace()

    class OneFileForTheRealAis(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            for package in WHOLE_PACKAGES:
                if path.startswith(package):
                    return package
            return path

        def _assign_work_unit(self, node: Any) -> None:
            scope = next(iter(self.workqueue))
            super()._assign_work_unit(node)
            if scope == "tests/ais/" and last:  # its real-ETL tests end in their network namespace: nothing after
                node.shutdown()

    return OneFileForTheRealAis(config, log)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if userns.stuck_in:
        pytest.fail(f"{item.nodeid} would run inside the real-ETL tests' network namespace, which this process "
                    f"could not leave ({userns.stuck_in[0]}): those tests must be the last this process runs",
                    pytrace=False)


@pytest.fixture(scope="session")
def settings() -> Settings:
    """The service defaults, independent of the environment the tests run in."""
    from transformer.config import Settings

    return Settings.from_env({})


@pytest.fixture
def make_options(settings: Settings) -> Callable[..., TransformOptions]:
    """``make_options(dtype="uint8", seed=1)``: options exactly as that etl_args object would give."""
    from transformer.options import options_from_mapping

    def build(**etl_args: Any) -> TransformOptions:
        return options_from_mapping(etl_args, settings)

    return build


@pytest.fixture
def make_sample() -> Callable[[list[tuple[str, bytes]]], Sample]:
    """The single sample that a tar of these (name, bytes) members groups into."""
    from testbed.shardgen import make_tar
    from transformer.shards import read_samples

    def build(members: list[tuple[str, bytes]]) -> Sample:
        samples = list(read_samples(io.BytesIO(make_tar(members)), "test.tar", 2**30))
        assert len(samples) == 1, [s.key for s in samples]
        return samples[0]

    return build


@pytest.fixture
def pool() -> Iterator[TransformPool]:
    from transformer.pool import TransformPool

    pool = TransformPool(workers=2, max_inflight=8)
    yield pool
    pool.shutdown()


@pytest.fixture
def run_shard(pool: TransformPool) -> Callable[..., tuple[bytes, ShardReport]]:
    """``run_shard(tar_bytes, options, window=4)`` -> (output tar bytes, report)."""
    from transformer.engine import ShardReport, transform_shard

    def run(
        data: bytes, options: TransformOptions, window: int = 4, shard: str = "test.tar"
    ) -> tuple[bytes, ShardReport]:
        report = ShardReport(shard, shard, options.on_error)
        chunks = transform_shard(
            io.BytesIO(data), options, pool, shard=shard, object_name=shard, window=window, report=report
        )
        return b"".join(bytes(c) for c in chunks), report

    return run
