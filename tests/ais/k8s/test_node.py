"""The real cluster's pieces that need no Kubernetes: each node's configuration, the certificates, cgroup clean-up
and the log copy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from testbed.k8s import cgroups, node, pki
from testbed.k8s.kube import cri_messages
from testbed.k8s.topology import API_URL, DNS_IP, NODES, REGISTRY, REGISTRY_ALIASES


def config(tmp_path: Path, name: str = "node-1") -> node.NodeConfig:
    tools = {"runc": "/usr/sbin/runc", "cni_bin_dir": "/usr/lib/cni"}
    return node.NodeConfig(name, str(tmp_path / name), str(tmp_path / "pki"), str(tmp_path / "state"),
                           str(tmp_path / "disks" / name), cgroups.root_name(name, 7), tools)


def test_cri_log_lines_become_what_the_container_wrote() -> None:
    data = (b"2026-11-27T00:00:00.1Z stdout F INFO: ready\n"
            b"2026-11-27T00:00:00.2Z stderr P a long \n"
            b"2026-11-27T00:00:00.3Z stderr F line\n"
            b"2026-11-27T00:00:00.4Z stdout F \n")
    assert cri_messages(data) == b"INFO: ready\na long line\n\n"


def test_cgroup_tree_is_removed_depth_first_and_what_stays_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ais-wds-k8s-node-0-1"
    (root / "kubepods" / "besteffort" / "pod1" / "c1").mkdir(parents=True)
    (root / "kubepods" / "burstable").mkdir()
    assert cgroups.remove_tree(root, timeout=0.1) == [] and not root.exists()
    (root / "busy").mkdir(parents=True)
    (root / "busy" / "tasks").write_text("1")  # a real cgroup folder with a process cannot be removed either
    left = cgroups.remove_tree(root, timeout=0.1)
    assert [entry.split(":")[0] for entry in left] == [str(root / "busy"), str(root)]


def test_each_kubelet_has_its_own_cgroup_root_named_after_its_node_and_the_starting_process() -> None:
    names = {cgroups.root_name(spec.name, 4242) for spec in NODES}
    assert names == {"/ais-wds-k8s-node-0-4242", "/ais-wds-k8s-node-1-4242"}
    assert all(name.rsplit("-", 1)[-1] == "4242" for name in names)  # what remove_orphaned reads


def test_each_kubelet_runs_on_its_node_with_the_cluster_dns_and_evicts_nothing(tmp_path: Path) -> None:
    for spec in NODES:
        kubelet = json.loads(node.kubelet_config(config(tmp_path, spec.name)))
        assert kubelet["cgroupRoot"] == cgroups.root_name(spec.name, 7) and kubelet["cgroupDriver"] == "cgroupfs"
        assert kubelet["address"] == spec.ip and kubelet["clusterDNS"] == [DNS_IP]
        assert kubelet["clusterDomain"] == "cluster.local"
        assert kubelet["resolvConf"] == str(tmp_path / spec.name / "resolv.conf")
        assert kubelet["authentication"]["x509"]["clientCAFile"] == str(tmp_path / "pki" / "ca.crt")
        assert all(value.endswith(("Mi", "%")) for value in kubelet["evictionHard"].values())
        assert kubelet["imageGCHighThresholdPercent"] == 100


def test_every_image_name_is_pulled_from_the_clusters_registry(tmp_path: Path) -> None:
    node.registry_hosts(tmp_path, REGISTRY)
    for host in REGISTRY_ALIASES:
        text = (tmp_path / "registry-hosts" / host / "hosts.toml").read_text()
        assert text.startswith(f'server = "http://{REGISTRY}"'), host
    assert REGISTRY.startswith(NODES[0].ip)  # the control-plane node's address: both nodes reach it


def test_each_nodes_pods_get_addresses_from_its_own_half_of_the_pod_range(tmp_path: Path) -> None:
    ranges = []
    for spec in NODES:
        node.cni_config(tmp_path / spec.name, spec.pod_cidr)
        plugins = json.loads((tmp_path / spec.name / "cni" / "10-bridge.conflist").read_text())["plugins"]
        assert [plugin["type"] for plugin in plugins] == ["bridge", "portmap"]  # portmap: AIS's hostPorts
        ranges.append(plugins[0]["ipam"]["ranges"][0][0]["subnet"])
    assert ranges == ["203.0.113.0/25", "203.0.113.128/25"]


def test_each_containerd_keeps_images_in_a_cached_root_of_its_own_and_state_in_the_private_run(tmp_path: Path):
    roots = set()
    for spec in NODES:
        text = node.containerd_config(config(tmp_path, spec.name))
        assert 'state = "/run/containerd"' in text and "restrict_oom_score_adj = true" in text
        assert 'BinaryName = "/usr/sbin/runc"' in text and f'sandbox_image = "{REGISTRY}/' in text
        roots.add(text.split('root = "', 1)[1].split('"', 1)[0])
    assert roots == {str(tmp_path / "state" / f"containerd-{spec.name}") for spec in NODES}


def test_kube_proxy_has_its_own_identity_and_leaves_the_hosts_conntrack_settings_alone(tmp_path: Path) -> None:
    proxy = json.loads(node.kube_proxy_config(config(tmp_path)))
    assert proxy["conntrack"] == {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    assert proxy["mode"] == "iptables" and proxy["bindAddress"] == NODES[1].ip
    assert proxy["clientConnection"]["kubeconfig"] == str(tmp_path / "pki" / "kube-proxy.kubeconfig")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    pki.make_pki(folder, [spec.name for spec in NODES], NODES[0].ip, "192.0.2.1", API_URL)
    return folder


def subject(folder: Path, name: str) -> str:
    done = subprocess.run(["openssl", "x509", "-in", str(folder / f"{name}.crt"), "-noout", "-subject", "-ext",
                           "subjectAltName"], capture_output=True, text=True, check=True)
    return done.stdout


def test_each_kubelet_has_a_certificate_of_its_own_node_the_one_node_restriction_knows(certificates: Path) -> None:
    for spec in NODES:
        text = subject(certificates, pki.kubelet_identity(spec.name))
        assert f"O = system:nodes, CN = system:node:{spec.name}" in text
        kubeconfig = json.loads((certificates / f"{pki.kubelet_identity(spec.name)}.kubeconfig").read_text())
        assert kubeconfig["clusters"][0]["cluster"]["server"] == API_URL
    assert "CN = system:kube-proxy" in subject(certificates, pki.PROXY)
    assert "O = system:masters" in subject(certificates, pki.ADMIN)


def test_the_apiserver_answers_to_its_node_address_and_its_service_address(certificates: Path) -> None:
    text = subject(certificates, "apiserver")
    for name in (f"IP Address:{NODES[0].ip}", "IP Address:192.0.2.1", "DNS:kubernetes.default.svc.cluster.local"):
        assert name in text
