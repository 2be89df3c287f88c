"""The clusters' teardown reports what did not end by itself, before killing it: a node that ignores SIGTERM,
an ETL pod AIS never deleted, a container that outlived its pod. The fixtures fail on any of these."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from testbed.cluster import Node, stop_nodes
from testbed.etl_cluster import EtlCluster
from testbed.fake_kube import FakeKubernetes
from testbed.pods import ProcessRuntime

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
IGNORES_SIGTERM = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(60)"]


def _node(tmp_path: Path, role: str, command: list[str]) -> Node:
    output = tmp_path / f"{role}.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while b"ready" not in output.read_bytes() and command is IGNORES_SIGTERM and time.monotonic() < deadline:
        time.sleep(0.05)
    return Node(role, tmp_path, f"http://127.0.0.1/{role}", "", process, output)


def test_a_node_that_ends_on_sigterm_is_not_reported(tmp_path: Path) -> None:
    node = _node(tmp_path, "proxy", SLEEPER)
    assert stop_nodes([[node]], timeout=10) == []
    assert node.process.returncode is not None


def test_a_node_that_ignores_sigterm_is_reported_then_killed(tmp_path: Path) -> None:
    hung, fine = _node(tmp_path, "target", IGNORES_SIGTERM), _node(tmp_path, "proxy", SLEEPER)
    forced = stop_nodes([[hung], [fine]], timeout=1)
    assert len(forced) == 1 and "aisnode target" in forced[0] and "after SIGTERM" in forced[0], forced
    assert hung.process.returncode == -9 and fine.process.returncode is not None


def test_an_etl_pod_never_deleted_is_reported_before_it_is_killed(tmp_path: Path) -> None:
    runtime = ProcessRuntime(SLEEPER, {}, {})
    kube = FakeKubernetes(tmp_path / "kube", {"node-1": "127.0.0.1"}, runtime, ready_interval=0.05)
    kube.root.mkdir()
    kube.create_pod({"metadata": {"name": "etl-x-t1"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
    kube.wait(lambda: kube.running_pods(), 30, "the pod running")
    kept = kube.create_pod({"metadata": {"name": "etl-y-t1"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert kept[0] == 201
    kube.wait(lambda: len(kube.running_pods()) == 2, 30, "both pods running")
    kube.delete("pods", "etl-x-t1")  # as AIS does on unregister
    cluster = EtlCluster(tmp_path, kube, _node(tmp_path, "proxy", SLEEPER), [_node(tmp_path, "target", SLEEPER)],
                         [], 0)
    forced = cluster.stop(timeout=10)
    assert forced == ["pod etl-y-t1 (process, running) was never deleted by AIS"], forced
    assert not kube.running_pods() and not runtime.leftovers()
