"""The ``ais`` tests: the client and the pod against a real AIStore (``aisnode``) on 127.0.0.1.

When any selected test is marked ``ais``, aisnode is built (or found in its cache) once, after
collection and before the first test, so a first build's minutes do not count against a test's
timeout. Without Go these tests fail, each with the message saying how to get it: they never skip.
One cluster (a proxy and a target) serves the whole session; it is stopped at the end, and the
fixture fails if a node did not exit on SIGTERM within its grace time (it is killed then) or is left
running.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.cluster import AisnodeUnavailable, LocalCluster, install_aisnode, start_cluster

_BINARY = pytest.StashKey[object]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("ais") for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(message: str) -> None:
        if reporter is not None:
            reporter.write_line(f"ais: {message}")

    try:
        session.config.stash[_BINARY] = install_aisnode(log=say)
    except AisnodeUnavailable as exc:
        session.config.stash[_BINARY] = exc


@pytest.fixture(scope="session")
def aisnode(request: pytest.FixtureRequest) -> Path:
    binary = request.config.stash.get(_BINARY, None)
    if binary is None:  # collected without the hook's knowledge (e.g. a marker added later): build now
        try:
            binary = install_aisnode()
        except AisnodeUnavailable as exc:
            binary = exc
    if isinstance(binary, AisnodeUnavailable):
        pytest.fail(str(binary), pytrace=False)
    return binary


@pytest.fixture(scope="session")
def ais_cluster(aisnode: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    try:
        cluster = start_cluster(aisnode, tmp_path_factory.mktemp("ais-cluster"))
    except AisnodeUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    yield cluster
    forced = cluster.stop()
    assert not forced, "the cluster did not stop by itself:\n" + "\n".join(forced)
    running = [node.role for node in (cluster.proxy, cluster.target) if node.process.poll() is None]
    assert not running, f"aisnode {running} still running after stop"


@pytest.fixture(scope="session")
def ais_client(ais_cluster: LocalCluster):
    return ais_cluster.client()


@pytest.fixture
def bucket_name(request: pytest.FixtureRequest) -> str:
    """A bucket name of its own for each test (AIS: letters, digits, '-', '_', '.')."""
    import re

    return re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:48].strip("-")
