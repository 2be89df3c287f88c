"""The real Kubernetes node's pieces that need no Kubernetes: its configuration, cgroup clean-up and log copy."""

from __future__ import annotations

import json
from pathlib import Path

from testbed.k8s import node
from testbed.k8s.kube import cri_messages


def test_cri_log_lines_become_what_the_container_wrote() -> None:
    data = (b"2026-11-27T00:00:00.1Z stdout F INFO: ready\n"
            b"2026-11-27T00:00:00.2Z stderr P a long \n"
            b"2026-11-27T00:00:00.3Z stderr F line\n"
            b"2026-11-27T00:00:00.4Z stdout F \n")
    assert cri_messages(data) == b"INFO: ready\na long line\n\n"


def test_cgroup_tree_is_removed_depth_first_and_what_stays_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ais-wds-k8s-1"
    (root / "kubepods" / "besteffort" / "pod1" / "c1").mkdir(parents=True)
    (root / "kubepods" / "burstable").mkdir()
    assert node.remove_cgroup_tree(root, timeout=0.1) == [] and not root.exists()
    (root / "busy").mkdir(parents=True)
    (root / "busy" / "tasks").write_text("1")  # a real cgroup folder with a process cannot be removed either
    left = node.remove_cgroup_tree(root, timeout=0.1)
    assert [entry.split(":")[0] for entry in left] == [str(root / "busy"), str(root)]


def test_kubelet_runs_in_a_cgroup_root_of_its_own_and_evicts_nothing(tmp_path: Path) -> None:
    config = node.Config(str(tmp_path), str(tmp_path / "cache"), "/ais-wds-k8s-7", {}, "")
    kubelet = json.loads(node._kubelet_config(config, tmp_path))
    assert kubelet["cgroupRoot"] == "/ais-wds-k8s-7" and kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["address"] == node.NODE_IP and kubelet["resolvConf"] == str(tmp_path / "resolv.conf")
    assert all(value.endswith(("Mi", "%")) for value in kubelet["evictionHard"].values())
    assert kubelet["imageGCHighThresholdPercent"] == 100


def test_every_image_name_is_pulled_from_the_nodes_registry(tmp_path: Path) -> None:
    node._registry_hosts(tmp_path)
    for host in ("docker.io", "127.0.0.1:5000", "localhost:5000"):
        text = (tmp_path / "registry-hosts" / host / "hosts.toml").read_text()
        assert text.startswith(f'server = "http://{node.REGISTRY}"'), host


def test_containerd_keeps_images_in_the_cache_and_state_in_the_private_run(tmp_path: Path) -> None:
    tools = {"runc": "/usr/sbin/runc", "cni_bin_dir": "/usr/lib/cni"}
    config = node.Config(str(tmp_path), str(tmp_path / "cache"), "/x", tools, "")
    text = node._containerd_config(config, tmp_path)
    assert f'root = "{tmp_path / "cache" / "containerd"}"' in text and 'state = "/run/containerd"' in text
    assert "restrict_oom_score_adj = true" in text and 'BinaryName = "/usr/sbin/runc"' in text


def test_kube_proxy_leaves_the_hosts_conntrack_settings_alone(tmp_path: Path) -> None:
    proxy = json.loads(node._kube_proxy_config(tmp_path))
    assert proxy["conntrack"] == {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    assert proxy["mode"] == "iptables" and proxy["bindAddress"] == node.NODE_IP
