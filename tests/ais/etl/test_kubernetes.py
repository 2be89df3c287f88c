"""What only a real Kubernetes decides about the ETL pods AIS creates (``make test-k8s``): the scheduler places
them by AIS's node affinity, on the target's node; containerd pulls the image from the cluster's registry; the
kubelet runs it as the image's user with the spec's resources, probes ``/health``, mounts the target pod's
volumes read-only and has the kernel enforce the memory limit; kube-proxy serves the NodePort AIS dials; AIS
reads the pods' logs from the kubelets; a pod whose image does not exist never starts.

Selected only by a ``-m`` that names ``k8s``; the rest of the real-ETL suite runs on the same cluster.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlparse

import pytest
import requests
from aistore.sdk.etl import ETLConfig

from testbed.etl_cluster import EtlCluster
from transformer.client import etl_logs, register, unregister

from .conftest import put_shards, settings, tar_names
from .test_register import etl_job, stage, wait_stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl, pytest.mark.k8s]

ONE_CPU = {"requests": {"cpu": "1", "memory": "3Gi"}, "limits": {"cpu": "1", "memory": "3Gi"}}


def events(cluster: EtlCluster, pod: str) -> set[tuple[str, str]]:
    """(reason, component) of each event Kubernetes recorded about ``pod``."""
    out = cluster.node.kubectl("-n", cluster.kube.namespace, "get", "events", "-o", "json",
                               f"--field-selector=involvedObject.name={pod}")
    return {(e["reason"], (e.get("source") or {}).get("component") or e.get("reportingComponent", ""))
            for e in json.loads(out)["items"]}


def mount_options(pid: int, path: str) -> list[str]:
    """The options of the mount at ``path`` in the mount namespace of ``pid``."""
    with open(f"/proc/{pid}/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            if fields[4] == path:
                return fields[5].split(",")
    raise AssertionError(f"nothing mounted at {path} in pid {pid}")


def test_pods_are_scheduled_pulled_and_run_by_kubernetes_as_the_spec_says(etl_client, etl_cluster: EtlCluster, etl):
    name = etl("k8s-spec", "hpush", resources=ONE_CPU, workers=None)
    pods = etl_cluster.kube.running_pods(name)
    assert sorted(etl_cluster.target_of(pod) for pod in pods) == [0, 1]
    for pod in pods:
        spec, target = pod.obj["spec"], etl_cluster.targets[etl_cluster.target_of(pod)]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][0] == {"key": "kubernetes.io/hostname", "operator": "In",
                                                   "values": [target.node]}  # the target's MY_NODE
        seen = events(etl_cluster, pod.name)
        assert ("Scheduled", "default-scheduler") in seen, seen  # placed by the scheduler, not by AIS
        assert ("Pulling", "kubelet") in seen, seen  # imagePullPolicy Always: asked of the registry each time
        assert spec["nodeName"] == target.node and pod.host == urlparse(target.url).hostname  # the node's address
        container = spec["containers"][0]
        assert container["resources"] == ONE_CPU and pod.obj["status"]["qosClass"] == "Guaranteed"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert pod.user == (10001, 0)  # the image's USER, group 0: what reads AIS's 0640 root:root objects
        data = next(m for m in container["volumeMounts"] if m["mountPath"] == etl_cluster.mountpath)
        assert data.get("readOnly") is True and "ro" in mount_options(pod.pid, data["mountPath"])
        assert requests.get(f"http://{pod.host}:{pod.port}/health", timeout=5).status_code == 200  # kube-proxy
        assert "transformer ready: 1 workers" in pod.log_text()  # the kubelet's CPU limit, read from the cgroup
    shards = put_shards(etl_client, "k8s-spec-src", ["a.tar", "b.tar", "c.tar", "d.tar"])
    for shard in shards:  # objects on both targets: each pod reads its target's by FQN, through the volume
        got = etl_client.bucket("k8s-spec-src").object(shard).get_reader(etl=ETLConfig(name)).read_all()
        assert sum(member.endswith(".npy") for member in tar_names(got)) == 6, shard


def test_without_a_cpu_limit_the_pod_uses_every_cpu_it_may_run_on(etl_cluster: EtlCluster, etl):
    name = etl("k8s-nocpu", "hpush", workers=None)
    for pod in etl_cluster.kube.running_pods(name):
        assert "cpu" not in pod.obj["spec"]["containers"][0].get("resources", {}).get("limits", {})
        assert f"transformer ready: {len(os.sched_getaffinity(pod.pid))} workers" in pod.log_text()


def test_the_kernel_oom_kills_a_pod_at_its_memory_limit_and_ais_aborts_the_etl(etl_client, etl_cluster: EtlCluster):
    name = "k8s-oom"
    register(etl_client, name, settings("hpush", resources=ONE_CPU))
    try:
        job = etl_job(etl_client, name)
        pod = etl_cluster.kube.running_pods(name)[0]
        etl_cluster.kube.oom_kill(pod)
        wait_stage(etl_client, name, "Aborted", timeout=60)
        status = etl_client.job(job).status()
        assert status.aborted and "OOMKilled" in status.err and "exitCode: 137" in status.err, status.err
    finally:
        unregister(etl_client, name)
    etl_cluster.kube.wait(lambda: not etl_cluster.kube.pods_of(name), 60, f"the pods of {name} deleted")


def test_a_pod_whose_image_does_not_exist_never_starts_and_registration_fails(etl_client, etl_cluster: EtlCluster):
    name = "k8s-noimage"
    try:
        with pytest.raises(Exception) as caught:  # noqa: B017 (whichever error class: its text is what is checked)
            register(etl_client, name, settings("hpush", image="ais-wds-transformer-missing:none",
                                                init_timeout="20s"))
        assert "ais-wds-transformer-missing" in str(caught.value) or "ErrImagePull" in str(caught.value) \
            or "ImagePullBackOff" in str(caught.value), str(caught.value)
        assert not etl_cluster.kube.running_pods(name)
    finally:
        if stage(etl_client, name):
            unregister(etl_client, name)


def test_ais_reads_each_pods_log_from_the_kubelet(etl_client, etl_cluster: EtlCluster, etls):
    logs = etl_logs(etl_client, etls["hpush"])
    assert len(logs) == 2 and all("transformer ready" in text for text in logs.values()), logs
