"""What only the two-node cluster shows (``make test-k8s``): AIS's nodes are pods that call each other by DNS
name, one target per node; each target's ETL pod runs on that target's node and reads ``etl_fqn`` from that
node's own disk; an offline job's pod puts a result straight into the target on the other node; hpull sends
each reader to the pod on the node that holds the object.

The same mountpath (``/ais/mp1`` in every pod) holds different data on each node, as on real machines, so a pod
on the wrong node would read the wrong file or none. Selected only by a ``-m`` that names ``k8s``.
"""

from __future__ import annotations

import re
import subprocess
from urllib.parse import quote, urlsplit

import httpx
import pytest
import requests
from aistore.sdk.etl import ETLConfig

from testbed.k8s.ais import MOUNTPATH, pod_dns
from testbed.k8s.topology import NODES
from testbed.shardgen import make_tar, read_output, read_tar
from transformer.client import etl_logs, shard_urls, transform_bucket

from .conftest import delivered, owner_of, put_shards

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl, pytest.mark.k8s]
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what settings() registers
NODE_NAMES = sorted(spec.name for spec in NODES)
NAME_PREFIX = "ais-"  # the operator names every object of an AIStore named "ais" after it


def keys(data: bytes) -> set[str]:
    """The first letters of a transformed shard's members: ``s`` for the shards put, ``d`` for a decoy."""
    return {name[0] for name, _ in read_output(data)}


def test_ais_runs_as_pods_one_target_per_node_calling_each_other_by_dns_name(etl_cluster) -> None:
    assert sorted(target.node for target in etl_cluster.targets) == NODE_NAMES
    smap = httpx.get(f"{etl_cluster.url}/v1/daemon", params={"what": "smap"}, timeout=10).json()
    addresses = {spec.ip for spec in NODES}
    for role, daemons in (("proxy", smap["pmap"]), ("target", smap["tmap"])):
        for snode in daemons.values():
            for net in ("intra_control_net", "intra_data_net"):  # written by aisinit: <pod>.<service>.<ns>.svc...
                assert re.fullmatch(rf"{NAME_PREFIX}{role}-\d\.{NAME_PREFIX}{role}\.ais\.svc\.cluster\.local",
                                    snode[net]["node_ip_addr"]), snode[net]
            assert snode["public_net"]["node_ip_addr"] in addresses  # the node's address, through the hostPort
    for pod in etl_cluster.kube.ais_pods():
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
               for e in pod.obj["spec"]["containers"][0]["env"]}
        assert env == {"MY_NODE": "spec.nodeName", "MY_POD": "metadata.name", "K8S_NS": "metadata.namespace"}


def test_each_kubelet_may_change_its_own_node_only(etl_cluster) -> None:
    """Each node's kubelet has a certificate of its own, and the NodeRestriction admission plugin holds it to
    its own node: node-1's kubelet may label node-1, not node-0."""
    kubectl = etl_cluster.cluster.tools.kubectl
    as_node_1 = [str(kubectl), f"--kubeconfig={etl_cluster.cluster.pki / 'kubelet-node-1.kubeconfig'}"]
    own = subprocess.run([*as_node_1, "label", "node", "node-1", "ais-wds-test=own", "--overwrite"],
                         capture_output=True, text=True, timeout=60)
    other = subprocess.run([*as_node_1, "label", "node", "node-0", "ais-wds-test=other", "--overwrite"],
                           capture_output=True, text=True, timeout=60)
    assert own.returncode == 0, own.stderr
    assert other.returncode != 0 and "Forbidden" in other.stderr, other.stderr
    etl_cluster.cluster.kubectl("label", "node", "node-1", "ais-wds-test-")


@pytest.mark.parametrize("comm", ["hpush", "hpull", "ws"])
def test_each_targets_etl_pod_runs_on_that_targets_node(etl_cluster, etls, comm: str) -> None:
    pods = etl_cluster.kube.running_pods(etls[comm])
    assert sorted(etl_cluster.target_of(pod) for pod in pods) == [0, 1]
    assert sorted(pod.node for pod in pods) == NODE_NAMES
    for pod in pods:
        target = etl_cluster.targets[etl_cluster.target_of(pod)]
        assert pod.node == target.node and pod.obj["metadata"]["labels"]["nvidia.com/ais-etl-node"] == target.node
        env = {e["name"]: e.get("value", "") for e in pod.obj["spec"]["containers"][0]["env"]}
        assert urlsplit(env["AIS_TARGET_URL"]).hostname == pod_dns(target.pod, "target")


def test_etl_fqn_is_read_from_the_disk_of_the_node_that_holds_the_object(etl_client, etl_cluster, etls) -> None:
    """Each of two objects (one per node) has a decoy of the same size at the same path on the other node's disk:
    every read through every communication type is the object's, never the decoy's. An object whose file lies on
    one node only, asked of the pod on the other node, is a 404 naming the path."""
    names = [f"fqn-{i}.tar" for i in range(8)]
    shards = put_shards(etl_client, "two-fqn", names, 3)
    owners = {name: owner_of(etl_cluster, "two-fqn", name) for name in names}
    assert set(owners.values()) == {0, 1}
    decoyed = [next(name for name in names if owners[name] == index) for index in (0, 1)]
    decoys = []
    try:
        for name in decoyed:
            decoy = make_tar([("d" + member[1:], data) for member, data in read_tar(shards[name])])
            assert len(decoy) == len(shards[name])  # same size: the pod's size check cannot tell them apart
            path = etl_cluster.mountpaths[1 - owners[name]] / "@ais" / "two-fqn" / "%ob" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(decoy)
            decoys.append(path)
        for comm in ("hpush", "hpull", "ws"):
            for name in decoyed:
                got = etl_client.bucket("two-fqn").object(name).get_reader(etl=ETLConfig(etls[comm])).read_all()
                assert keys(got) == {"s"}, (comm, name)  # the samples put, not the decoy's
        lonely = next(name for name in names if name not in decoyed)
        pod = etl_cluster.pod_on_target(etls["hpush"], 1 - owners[lonely])  # the pod on the other node
        fqn = f"{MOUNTPATH}/@ais/two-fqn/%ob/{lonely}"
        answer = requests.put(f"http://{pod.host}:{pod.port}/two-fqn/{lonely}", timeout=30,
                              params={"etl_fqn": quote(fqn, safe="")})  # AIS's encoding: PathEscape, then the query
        assert answer.status_code == 404 and "no such object file on this node" in answer.text, answer.text
    finally:
        for path in decoys:
            path.unlink()


def test_an_offline_copy_puts_straight_into_the_target_on_the_other_node(etl_client, etl_cluster, etls) -> None:
    """The pod of the object's node PUTs each result whose destination is the other target itself, to that
    target's intra-data URL by DNS name; every copy is whole and byte for byte the inline transform."""
    name = etls["hpush"]
    shards = [f"dp-{i:02d}.tar" for i in range(12)]
    put_shards(etl_client, "two-dp-src", shards, 3)
    before = delivered(etl_cluster, name)
    job = transform_bucket(etl_client, name, "two-dp-src", "two-dp-dst", options=OPTIONS, timeout=300)
    assert job.success and not job.object_errors and job.verified == len(shards), job
    across = [s for s in shards if owner_of(etl_cluster, "two-dp-dst", s) != owner_of(etl_cluster, "two-dp-src", s)]
    assert across and delivered(etl_cluster, name).get("target", 0) - before.get("target", 0) == len(across)
    for shard in shards:
        owner = owner_of(etl_cluster, "two-dp-dst", shard)
        copy = (etl_cluster.mountpaths[owner] / "@ais" / "two-dp-dst" / "%ob" / shard).read_bytes()
        assert copy == etl_client.bucket("two-dp-src").object(shard).get_reader(etl=ETLConfig(name)).read_all()
        read_output(copy)
    logs = "\n".join(etl_logs(etl_client, name).values())
    for target in etl_cluster.targets:  # each pod put to the other node's target, by its name (secret masked)
        assert f"PUT http://{pod_dns(target.pod, 'target')}:" in logs and "/v1/etl/_object/" in logs


def test_hpull_sends_each_reader_to_the_pod_on_the_node_that_holds_the_object(etl_client, etl_cluster, etls):
    names = [f"pull-{i}.tar" for i in range(8)]
    put_shards(etl_client, "two-pull", names, 3)
    nodes = set()
    for name, url in zip(names, shard_urls(etl_client, "two-pull", etls["hpull"], names=names), strict=True):
        first = requests.get(url, allow_redirects=False, timeout=30)  # the proxy: to the object's target
        second = requests.get(first.headers["Location"], allow_redirects=False, timeout=30)  # the target: its pod
        assert first.status_code in (301, 307) and second.status_code == 307
        target = etl_cluster.targets[owner_of(etl_cluster, "two-pull", name)]
        pod = etl_cluster.pod_on_target(etls["hpull"], owner_of(etl_cluster, "two-pull", name))
        location = urlsplit(second.headers["Location"])
        assert urlsplit(first.headers["Location"]).hostname == location.hostname == urlsplit(target.url).hostname
        assert (location.hostname, location.port) == (pod.host, pod.port) and pod.node == target.node
        nodes.add(pod.node)
        read_output(requests.get(second.headers["Location"], timeout=60).content)
    assert sorted(nodes) == NODE_NAMES
