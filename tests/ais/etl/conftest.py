"""The ``ais_etl`` tests: AIS's real ETL path, target -> pod -> target -> reader, with only Kubernetes faked.

One cluster (``testbed/etl_cluster.py``: a proxy and two targets in Kubernetes mode, the fake
Kubernetes that runs each ETL pod as ``wds-transform serve``, or, under ``make test-image``, as a
podman container of the built image) serves every test of this package. The
test process's main thread enters the cluster's network namespace when the first test asks for it
and leaves it when the package ends; the ``ais_etl`` tests are moved to the end of the run, and under
``make test``'s ``-n 2 --dist loadfile`` a worker that cannot leave (an unprivileged run: root in a user
namespace) takes no file after ``tests/ais/`` (``tests/conftest.py``'s scheduler), so it runs nothing else
inside it; should any test come after anyway, it fails, naming why. At the end
the fixture checks that no aisnode and no pod process is left, and that AIS asked the fake
Kubernetes for nothing it does not serve. Without the privileges a network namespace needs, these
tests fail with the reason, never skip. With ``AIS_WDS_KUBE=real`` (``make test-k8s``) the same tests run
on the cluster users run instead (``testbed/k8s/``: two real Kubernetes nodes, AIS itself as pods), and
``test_kubernetes.py`` and ``test_two_nodes.py`` join them.
"""

from __future__ import annotations

import contextlib
import io
import re
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from testbed import userns
from testbed.cluster import AisnodeUnavailable
from testbed.etl_cluster import (
    NODES,
    REAL_KUBERNETES,
    EtlCluster,
    settings,
    start_etl_cluster,
)
from testbed.netns import NamespaceUnavailable, enter_network_namespace
from testbed.pods import PodRuntimeUnavailable
from testbed.shardgen import shard_bytes
from transformer.client import register, unregister

from .secret_last import _secret_watches_the_cluster, secret_checked_last  # noqa: F401 (the secret, checked last)

if TYPE_CHECKING:
    from testbed.k8s.ais import AisCluster


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    only_k8s = [item for item in items if item.get_closest_marker("k8s")]
    if only_k8s and "k8s" not in (config.option.markexpr or ""):  # they need a real Kubernetes: make test-k8s
        config.hook.pytest_deselected(items=only_k8s)
        items[:] = [item for item in items if item not in only_k8s]
    etl = [item for item in items if here in Path(str(item.path)).parents]
    if etl:
        rest = [item for item in items if here not in Path(str(item.path)).parents]
        # a node lost aborts every ETL the package shares: that test comes last
        loss = [item for item in etl if Path(str(item.path)).name == "test_node_loss.py"]
        items[:] = rest + [item for item in etl if item not in loss] + loss


@pytest.fixture(scope="package")
def etl_cluster(aisnode: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtlCluster]:
    if REAL_KUBERNETES:
        yield from _on_real_kubernetes(aisnode, tmp_path_factory)
        return
    try:
        namespace = enter_network_namespace(list(NODES.values()))
    except NamespaceUnavailable as exc:
        why = f" (a user namespace could not be entered: {userns.problem})" if userns.problem else ""
        pytest.fail(f"{exc}{why}", pytrace=False)
    try:
        try:
            cluster = start_etl_cluster(aisnode, tmp_path_factory.mktemp("ais-etl"))
        except (AisnodeUnavailable, PodRuntimeUnavailable) as exc:
            pytest.fail(str(exc), pytrace=False)
        yield from _until_it_ends_by_itself(cluster)
        running = [node.role for node in cluster.nodes() if node.process.poll() is None]
        pods = [pod.name for pod in cluster.kube.running_pods()] + cluster.kube.runtime.leftovers()
        assert not running and not pods, f"left running: aisnode {running}, pods {pods}"
        if cluster.kube.runtime.kind == "container":  # make test-image: no pod may have run any other way
            other = [(pod.name, pod.runtime, pod.user) for pod in cluster.kube.started
                     if pod.runtime != "container" or pod.user not in (None, (10001, 0))]
            assert cluster.kube.started and not other, f"ETL pods not run as the image's containers: {other}"
        unexpected = cluster.kube.unexpected
        assert not unexpected, f"AIS made Kubernetes calls the fake does not serve: {unexpected}"
    finally:
        try:
            namespace.leave()
        except OSError as exc:  # root in a user namespace cannot go back: these tests then are this process's last
            userns.stuck_in.append(str(exc))


def _until_it_ends_by_itself(cluster: AisCluster) -> Iterator[AisCluster]:
    """Yields ``cluster`` to the tests, then stops it: it must end without a process or pod forced down."""
    try:
        yield cluster
    finally:
        forced = cluster.stop()
    assert not forced, "the cluster did not end by itself:\n" + "\n".join(forced)


def _on_real_kubernetes(aisnode: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AisCluster]:
    """The cluster users run (``testbed/k8s/``): two Kubernetes nodes, AIS's proxy and targets as pods, each
    target's ETL pods scheduled on its node by AIS's node affinity and run by that node's kubelet from the image
    ``make image`` built, pulled from the cluster's registry. At the end nothing may be left on the host."""
    from testbed.k8s.build import KubernetesUnavailable
    from testbed.k8s.up import start_ais_cluster

    root = tmp_path_factory.mktemp("k8s")
    try:
        cluster = start_ais_cluster(root, log=lambda message: print(message, flush=True))
    except (KubernetesUnavailable, AisnodeUnavailable) as exc:
        pytest.fail(str(exc), pytrace=False)
    yield from _until_it_ends_by_itself(cluster)
    seen = [(pod.name, pod.user) for pod in cluster.kube.started if pod.user is not None]  # None: ended unseen
    other = [(name, user) for name, user in seen if user != (10001, 0)]
    assert seen and not other, f"ETL pods not run as the image's user 10001:0: {other}"
    left = cluster.cluster.leftovers()
    assert not left, f"left on the host: {left}"


@pytest.fixture(scope="package")
def etl_client(etl_cluster: EtlCluster):
    return etl_cluster.client()


@pytest.fixture(scope="package")
def etls(etl_client, etl_cluster: EtlCluster) -> Iterator[dict[str, str]]:
    """One ETL per communication type (``settings()``, pods logging at DEBUG), shared by the package's
    tests that do not stop, break or reconfigure it: comm type -> ETL name."""
    names = {comm: f"etl-{comm}" for comm in ("hpush", "hpull", "ws")}
    for comm, name in names.items():
        register(etl_client, name, settings(comm, env={"ETL_LOG_LEVEL": "debug"}))
    yield names
    for name in names.values():
        unregister(etl_client, name)


@pytest.fixture
def etl(etl_client, etl_cluster: EtlCluster) -> Iterator[Callable[..., str]]:
    """``etl(name, comm_type, **settings)`` registers an ETL for this test; it is removed afterwards."""
    made: list[str] = []

    def make(name: str, comm_type: str = "hpush", **kwargs) -> str:
        register(etl_client, name, settings(comm_type, **kwargs))
        made.append(name)
        return name

    yield make
    for name in made:
        unregister(etl_client, name)


def put_shards(client, bucket: str, names: list[str], samples: int = 6, namespace=None) -> dict[str, bytes]:
    """Create ``bucket`` (if needed) and put one shard per name; returns name -> bytes."""
    from aistore.sdk.errors import AISError

    handle = client.bucket(bucket, namespace=namespace) if namespace is not None else client.bucket(bucket)
    with contextlib.suppress(AISError):  # exists already
        handle.create(exist_ok=True)
    shards = {}
    for index, name in enumerate(names):
        data = shard_bytes(index, samples)
        handle.object(name).get_writer().put_content(data)
        shards[name] = data
    return shards


def tar_names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return archive.getnames()


def delivered(cluster: EtlCluster, etl: str) -> dict[str, float]:
    """``etl_delivered_total`` summed over the ETL's pods, read from each pod's /metrics."""
    totals: dict[str, float] = {}
    for pod in cluster.kube.pods_of(etl):
        text = httpx.get(f"http://{pod.host}:{pod.port}/metrics", timeout=10).text
        for to, value in re.findall(r'^etl_delivered_total\{to="(\w+)"\} (\S+)$', text, re.M):
            totals[to] = totals.get(to, 0) + float(value)
    return totals


def owner_of(cluster: EtlCluster, bucket: str, name: str) -> int:
    """Which target (0 or 1) stores the object, from the files on the two mountpaths."""
    found = [i for i, mp in enumerate(cluster.mountpaths) if (mp / "@ais" / bucket / "%ob" / name).is_file()]
    assert len(found) == 1, (bucket, name, found)
    return found[0]

