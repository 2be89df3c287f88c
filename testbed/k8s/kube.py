"""The real-ETL suite's view of the real cluster: the calls the fake Kubernetes answers, served by real nodes.

The fake is ``testbed/fake_kube.py``; the cluster is ``cluster.py``.

The tests ask Kubernetes for the ETL pods of an ETL, which of them run, on which node, their address
(``hostIP`` and the Service's ``nodePort``), the host pid and user of their main process, and their whole logs,
deleted pods' too; they kill a pod's main process or have the kernel's OOM killer end it. AIS's own pods (the
StatefulSets of ``ais.py``) are followed too, apart from the ETL pods.

Pods are followed by listing them every ``poll`` seconds. The kubelet removes a pod's log files with the
pod, so each log is copied, as it grows, from its node into ``<root>/pods/<pod>-<uid>/log`` (the message of
each CRI log line: what the container wrote).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..fake_kube import wait_until
from .cluster import Cluster

ETL_LABEL = ("app.kubernetes.io/name", "etl")  # what AIS labels its ETL pods with (ext/etl/boot.go)
AIS_LABEL = ("app.kubernetes.io/name", "ais")  # the operator's label of AIS's own pods


def cri_messages(data: bytes) -> bytes:
    """What a container wrote, from the kubelet's CRI log lines (``<time> <stream> <P|F> <message>``; P: part of
    a line, F: its end)."""
    out = []
    for line in data.splitlines():
        parts = line.split(b" ", 3)
        out.append((parts[3] if len(parts) == 4 else b"") + (b"\n" if parts[2:3] == [b"F"] else b""))
    return b"".join(out)


@dataclass(frozen=True)
class MainProcess:
    """A container's main process as the host sees it, asked what a local process is asked: its pid, and
    ``poll`` (None while it runs, else its exit code as the kubelet reports it)."""

    pid: int
    exit_code: int | None = None

    def poll(self) -> int | None:
        return self.exit_code


@dataclass
class RealPod:
    """One pod as last listed, and where its log is copied."""

    obj: dict
    folder: Path
    kube: RealKubernetes
    kind: str = ""  # "etl", "ais" or "" (anything else)
    gone: bool = False
    runtime: str = "container"
    user: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    @property
    def uid(self) -> str:
        return self.obj["metadata"]["uid"]

    @property
    def host(self) -> str:
        return self.obj.get("status", {}).get("hostIP", "")

    @property
    def node(self) -> str:
        return self.obj.get("spec", {}).get("nodeName", "")

    @property
    def ready(self) -> bool:
        conditions = self.obj.get("status", {}).get("conditions") or []
        return not self.gone and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    @property
    def port(self) -> int:
        return self.kube.node_port(self.name)

    @property
    def log(self) -> Path:
        return self.folder / "log"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def container_id(self) -> str:
        statuses = self.obj.get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("containerID", "").partition("://")[2]

    @property
    def running(self) -> bool:
        """Listed, its container running, and its main process alive."""
        if self.gone:
            return False
        statuses = self.obj.get("status", {}).get("containerStatuses") or [{}]
        return "running" in statuses[0].get("state", {}) and self.pid > 0

    @property
    def pid(self) -> int:
        """The host pid of the container's main process (0 if none runs)."""
        return self.kube.main_pid(self)

    @property
    def container(self) -> MainProcess:
        """Its container's main process; exited (with the kubelet's exit code, or -1) when none runs."""
        pid = self.pid
        if pid:
            return MainProcess(pid)
        status = (self.obj.get("status", {}).get("containerStatuses") or [{}])[0]
        ended = status.get("state", {}).get("terminated") or status.get("lastState", {}).get("terminated") or {}
        return MainProcess(0, ended.get("exitCode", -1))


@dataclass(frozen=True)
class KubeletRuntime:
    """How the ETL pods run, as the fake Kubernetes' pod runtimes say it: containers of the image."""

    kind: str = "container"


@dataclass
class RealKubernetes:
    cluster: Cluster
    root: Path
    namespace: str = "default"
    poll: float = 0.2
    pods: dict[str, RealPod] = field(default_factory=dict)  # uid -> pod, deleted ones too
    started: list[RealPod] = field(default_factory=list)  # every ETL pod whose container started
    services: dict[str, dict] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _copying: threading.Lock = field(default_factory=threading.Lock)  # one log copy at a time
    _offsets: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.runtime = KubeletRuntime()
        self.session = self.cluster.session()
        self.api = f"{self.cluster.api_url}/api/v1/namespaces/{self.namespace}"

    # -- following the cluster
    def start(self) -> None:
        """Start following pods (the caller's thread is in the cluster's machine room)."""
        self.refresh()
        self._thread = threading.Thread(target=self._follow, name="k8s-follow", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            with contextlib.suppress(Exception):
                self.refresh()

    def refresh(self) -> None:
        pods = self.session.get(f"{self.api}/pods", timeout=10).json()["items"]
        services = self.session.get(f"{self.api}/services", timeout=10).json()["items"]
        with self._lock:
            self.services = {s["metadata"]["name"]: s for s in services}
            listed = set()
            for obj in pods:
                uid = obj["metadata"]["uid"]
                listed.add(uid)
                pod = self.pods.get(uid)
                if pod is None:
                    labels = obj["metadata"].get("labels", {})
                    kind = next((label[1] for label in (ETL_LABEL, AIS_LABEL) if labels.get(label[0]) == label[1]), "")
                    pod = RealPod(obj, self.root / "pods" / f"{obj['metadata']['name']}-{uid[:8]}", self, kind)
                    pod.folder.mkdir(parents=True, exist_ok=True)
                    self.pods[uid] = pod
                pod.obj = obj
                if pod.kind == "etl" and pod not in self.started and pod.container_id():
                    self.started.append(pod)
                if pod.user is None and pod.container_id():
                    pod.user = self._user(pod)
            for uid, pod in self.pods.items():
                if uid not in listed:
                    pod.gone = True
        with self._copying:
            self._copy_logs()

    def _copy_logs(self) -> None:
        """Append what each ETL container wrote since the last look (CRI lines: time, stream, tag, message), from
        its node while that runs."""
        for pod in list(self.pods.values()):
            node = self.cluster.nodes.get(pod.node)
            if pod.kind != "etl" or node is None or not node.alive():
                continue
            folder = node.inside_path("/var/log/pods") / f"{self.namespace}_{pod.name}_{pod.uid}"
            with contextlib.suppress(OSError):
                for file in sorted(folder.glob("*/*.log")):
                    key = str(file)
                    with open(file, "rb") as source:
                        source.seek(self._offsets.get(key, 0))
                        data = source.read()
                    complete = data.rfind(b"\n") + 1
                    if not complete:
                        continue
                    self._offsets[key] = self._offsets.get(key, 0) + complete
                    with open(pod.log, "ab") as sink:
                        sink.write(cri_messages(data[:complete]))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(Exception):
            self.refresh()

    # -- what the tests ask
    def node_port(self, name: str) -> int:
        with self._lock:
            service = self.services.get(name)
        ports = (service or {}).get("spec", {}).get("ports") or [{}]
        return int(ports[0].get("nodePort", 0))

    def etl_pods(self) -> list[RealPod]:
        with self._lock:
            return [pod for pod in self.pods.values() if pod.kind == "etl" and not pod.gone]

    def ais_pods(self) -> list[RealPod]:
        with self._lock:
            return [pod for pod in self.pods.values() if pod.kind == "ais" and not pod.gone]

    def pod_named(self, name: str) -> RealPod | None:
        """The listed pod called ``name`` (a StatefulSet's pod keeps its name across restarts)."""
        with self._lock:
            return next((pod for pod in self.pods.values() if pod.name == name and not pod.gone), None)

    def pods_of(self, etl: str) -> list[RealPod]:
        """The listed ETL pods of ``etl`` (AIS names them ``<etl>-<target id>``)."""
        return [pod for pod in self.etl_pods() if pod.name.startswith(f"{etl}-")]

    def running_pods(self, etl: str | None = None) -> list[RealPod]:
        return [pod for pod in (self.pods_of(etl) if etl else self.etl_pods()) if pod.running]

    def wait(self, predicate: Callable[[], object], timeout: float, what: str) -> object:
        return wait_until(predicate, timeout, f"Kubernetes: {what}", 0.1)

    def container_cgroup(self, pod: RealPod, hierarchy: str = "memory") -> Path | None:
        container, node = pod.container_id(), self.cluster.nodes.get(pod.node)
        if not container or node is None:
            return None
        base = Path("/sys/fs/cgroup") / hierarchy / node.config.cgroup.strip("/")
        found = list(base.glob(f"kubepods*/pod{pod.uid}/{container}")) + \
            list(base.glob(f"kubepods*/*/pod{pod.uid}/{container}"))
        return found[0] if found else None

    def main_pid(self, pod: RealPod) -> int:
        """The container's first process (its parent, the shim, is outside the container's cgroup)."""
        cgroup = self.container_cgroup(pod)
        if cgroup is None:
            return 0
        with contextlib.suppress(OSError):
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
            for pid in sorted(pids):
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) not in pids:
                        return pid
        return 0

    def _user(self, pod: RealPod) -> tuple[int, int] | None:
        pid = self.main_pid(pod)
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if ":" in line}
            return int(fields["Uid"]), int(fields["Gid"])
        return None

    def kill(self, pod: RealPod) -> None:
        """SIGKILL the container's main process, as a node that loses it would."""
        os.kill(pod.pid, signal.SIGKILL)

    def oom_kill(self, pod: RealPod, timeout: float = 30.0) -> None:
        """Have the kernel's OOM killer end the pod's main process at its memory limit, at once: the main process
        is made the first choice (``oom_score_adj`` 1000), the container's limit is lowered to what it uses now, and
        a process run in it with ``kubectl exec`` allocates until the cgroup is out of memory. It writes every page
        it takes: untouched pages (``bytearray(n)`` is calloc, fresh zero pages) are never charged, and the kernel
        first reclaims the container's page cache (the image's libraries, counted in its usage), so only memory
        that keeps growing is sure to reach the OOM killer."""
        limits = pod.obj["spec"]["containers"][0].get("resources", {}).get("limits", {})
        if not limits.get("memory"):
            raise ValueError(f"pod {pod.name} has no memory limit: an OOM kill would be the whole node's")
        pid, cgroup = pod.pid, self.container_cgroup(pod)
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
        usage = int((cgroup / "memory.usage_in_bytes").read_text())
        (cgroup / "memory.limit_in_bytes").write_text(str(usage + (1 << 20)))
        allocate = self.cluster.kubectl_command("-n", self.namespace, "exec", pod.name, "--", "python", "-c",
                                                "b = []\nwhile True:\n    b.append(b'x' * (64 << 20))")
        exec_ = subprocess.Popen(allocate, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.wait(lambda: not Path(f"/proc/{pid}").exists(), timeout, f"the OOM kill of pod {pod.name}")
        finally:
            exec_.kill()
            exec_.wait()

    def leftover_containers(self) -> list[str]:
        """Containers the running nodes' containerd still run (the tasks of their k8s.io namespace), less the
        cluster's own (the DNS)."""
        left = []
        for node in self.cluster.nodes.values():
            if not node.alive():
                continue
            ctr = [str(self.cluster.tools.ctr), "--address", str(node.inside_path("/run/containerd/containerd.sock")),
                   "-n", "k8s.io"]
            tasks = subprocess.run([*ctr, "tasks", "list", "-q"], capture_output=True, text=True, timeout=30)
            for task in tasks.stdout.split():
                info = subprocess.run([*ctr, "containers", "info", task], capture_output=True, text=True, timeout=30)
                labels = json.loads(info.stdout or "{}").get("Labels") or {}
                if labels.get("io.kubernetes.pod.namespace") == self.namespace:
                    left.append(f"{node.name}/{labels.get('io.kubernetes.pod.name', task)}")
        return left
