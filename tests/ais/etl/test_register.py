"""Registration through AIS's real ETL API: every communication type, idempotence, a spec mismatch,
removal, and an ETL brought back from every stage AIS has (after ``stop``, after a pod died)."""

from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest

from testbed.etl_cluster import EtlCluster
from transformer.client import EtlSpecMismatch, register, unregister

from .conftest import settings

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]


def stage(client, name: str) -> str:
    for info in client.cluster().list_etls(stages=["Initializing", "Running", "Aborted"]):
        if info.id == name:
            return info.stage
    return ""


def wait_stage(client, name: str, wanted: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (current := stage(client, name)) != wanted:
        assert time.monotonic() < deadline, f"ETL {name}: stage {current!r}, expected {wanted!r}"
        time.sleep(0.2)


def etl_job(client, name: str) -> str:
    """The ETL's own job (xaction) id, whose error says why AIS aborted it."""
    return next(info.xaction_id for info in client.cluster().list_etls(stages=["Running"]) if info.id == name)


def running_pods(cluster: EtlCluster, name: str) -> list:
    return cluster.kube.running_pods(name)


@pytest.mark.parametrize("comm_type", ["hpush", "hpull", "ws"])
def test_register_each_comm_type_runs_one_pod_per_target(etl_client, etl_cluster: EtlCluster, comm_type: str) -> None:
    name = f"reg-{comm_type}"
    first = register(etl_client, name, settings(comm_type))
    try:
        assert first.created
        assert stage(etl_client, name) == "Running"
        pods = running_pods(etl_cluster, name)
        assert sorted(etl_cluster.target_of(pod) for pod in pods) == [0, 1]  # one per target, on its node:
        assert all(pod.host == urlparse(etl_cluster.targets[etl_cluster.target_of(pod)].url).hostname
                   for pod in pods)
        env = {e["name"]: e["value"] for e in pods[0].obj["spec"]["containers"][0]["env"]}
        target = etl_cluster.targets[etl_cluster.target_of(pods[0])]
        assert env["AIS_TARGET_URL"].startswith(f"{target.data_url}/v1/etl/_object/{name}/")  # its intra-data URL
        assert env["ETL_OBJ_TIMEOUT"] == "60s" and env["direct_put"] == "true"
        again = register(etl_client, name, settings(comm_type))
        assert not again.created and running_pods(etl_cluster, name) == pods  # idempotent: same pods
        with pytest.raises(EtlSpecMismatch, match="obj_timeout"):
            register(etl_client, name, settings(comm_type, obj_timeout="90s"))
    finally:
        assert unregister(etl_client, name)
    assert stage(etl_client, name) == ""
    etl_cluster.kube.wait(lambda: not etl_cluster.kube.pods_of(name), 30, f"the pods of {name} deleted")
    assert not any(pod.running for pod in pods)


def test_stopped_etl_comes_back_with_the_same_spec(etl_client, etl_cluster: EtlCluster) -> None:
    name = "reg-stopped"
    register(etl_client, name, settings())
    try:
        etl_client.etl(name).stop()
        wait_stage(etl_client, name, "Aborted")
        assert not running_pods(etl_cluster, name)
        again = register(etl_client, name, settings())
        assert not again.created
        assert stage(etl_client, name) == "Running" and len(running_pods(etl_cluster, name)) == 2
    finally:
        unregister(etl_client, name)
    assert stage(etl_client, name) == ""


def test_etl_aborted_by_a_dead_pod_comes_back_and_can_be_removed(etl_client, etl_cluster: EtlCluster) -> None:
    name = "reg-crashed"
    register(etl_client, name, settings())
    try:
        job = etl_job(etl_client, name)
        victim = running_pods(etl_cluster, name)[0]
        etl_cluster.kube.oom_kill(victim)
        wait_stage(etl_client, name, "Aborted")
        # AIS stops the ETL on every target: the other pod is deleted too.
        etl_cluster.kube.wait(lambda: not running_pods(etl_cluster, name), 30, "every pod of the aborted ETL gone")
        # Asked of the targets' own job records, as `ais show job` does. The proxy's summary
        # (`what=status`) can lose a finished ETL job: AIS 5.0's housekeeping may drop a finished
        # notification listener before its end time is set, and the proxy then answers 404.
        snaps = etl_client.job(job).get_details().list_snapshots()
        assert snaps and all(snap.aborted for snap in snaps)
        assert any("OOMKilled" in snap.abort_err and "exitCode: 137" in snap.abort_err for snap in snaps), snaps
        again = register(etl_client, name, settings())
        assert not again.created and stage(etl_client, name) == "Running"
        assert len(running_pods(etl_cluster, name)) == 2
    finally:
        assert unregister(etl_client, name)
    assert stage(etl_client, name) == ""
    # an aborted ETL can be removed too
    register(etl_client, name, settings())
    etl_cluster.kube.oom_kill(running_pods(etl_cluster, name)[0])
    wait_stage(etl_client, name, "Aborted")
    assert unregister(etl_client, name)
    assert stage(etl_client, name) == ""
