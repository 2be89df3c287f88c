"""A real two-node Kubernetes on one machine: start it, reach it, lose a node and bring it back, stop it.

``start_cluster`` moves the calling thread into a new network namespace, the machine room (``topology.py``): a
bridge whose address is the nodes' gateway, with a route to each node's pods. Each node is then its own
``unshare --net --mount --pid --fork --mount-proc`` running ``node.py``, plugged into the bridge by a veth pair.
node-0 brings up the control plane and the registry; the one-binary images (the pod sandbox, CoreDNS) go into
the registry; once both nodes are Ready, CoreDNS runs as the cluster DNS (``dns.py``).

Everything the thread starts afterwards (kubectl, podman push, the tests' clients) is in the machine room: it
reaches both nodes, their NodePorts and hostPorts and every pod, and nothing outside.

What stays off the host: every node's files, mounts and processes are in its own namespaces; its disk is a
folder of the cluster's. The one host-wide thing is each kubelet's cgroup root (``cgroups.py``), removed when
its node stops. What persists, in the cache (``build.py``): the registry's storage and each node's containerd
root, so that the project's 6 GB image is pushed once and unpacked once per node, not per run. A lock keeps two
clusters from using them at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ..cluster import _die_with_parent
from ..netns import NetworkNamespace, enter_network_namespace
from . import cgroups, pki
from .build import KubernetesUnavailable, Tools, cache_dir, install_kubernetes
from .gobuilds import COREDNS_VERSION, go_program
from .images import digest, put_binary_image
from .node import NodeConfig, sh
from .topology import (
    API_SERVICE_IP,
    API_URL,
    CONTROL_PLANE,
    LAN_BRIDGE,
    LAN_GATEWAY,
    NODES,
    PAUSE_IMAGE,
    REGISTRY,
    NodeSpec,
)
from .topology import node as node_spec

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    """One running node: the ``unshare`` process and the host pid of pid 1 in its namespaces."""

    spec: NodeSpec
    config: NodeConfig
    process: subprocess.Popen
    inside: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def root(self) -> Path:
        return Path(self.config.root)

    def alive(self) -> bool:
        return self.process.poll() is None

    def inside_path(self, path: str | Path) -> Path:
        """A path as the node's mount namespace sees it (its tmpfs ``/run``, ``/var/log/pods``)."""
        return Path(f"/proc/{self.inside}/root") / str(path).lstrip("/")

    def log_tail(self, chars: int = 4000) -> str:
        text = ""
        for log in sorted((self.root / "logs").glob("*.log")):
            text += f"--- {self.name} {log.name}\n{log.read_text(errors='replace')[-chars // 4:]}\n"
        return text


@dataclass
class Cluster:
    """The running cluster; ``stop`` ends it and removes what it made on the host."""

    root: Path
    tools: Tools
    lan: NetworkNamespace
    lock: object
    nodes: dict[str, Node] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)  # every net and pid namespace it made ("net:[4026...]")
    stopped: bool = False
    left: list[str] = field(default_factory=list)

    # -- talking to it
    @property
    def api_url(self) -> str:
        return API_URL

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def kubeconfig(self) -> Path:
        return self.pki / f"{pki.ADMIN}.kubeconfig"

    def session(self) -> requests.Session:
        """HTTPS to the API as its admin (from the machine room: the thread that started the cluster)."""
        return pki.admin_session(self.pki)

    def kubectl_command(self, *args: str) -> list[str]:
        return [str(self.tools.kubectl), f"--kubeconfig={self.kubeconfig()}", *args]

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True, input: str | None = None) -> str:
        """``kubectl`` as the cluster's admin, from the calling thread's network namespace (the machine room)."""
        done = subprocess.run(self.kubectl_command(*args), capture_output=True, text=True, timeout=timeout,
                              input=input)
        if check and done.returncode != 0:
            raise KubernetesUnavailable(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def node_ready(self, name: str) -> bool:
        response = self.session().get(f"{API_URL}/api/v1/nodes/{name}", timeout=5)
        conditions = response.json().get("status", {}).get("conditions", []) if response.ok else []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def log_tail(self) -> str:
        return "".join(node.log_tail() for node in self.nodes.values())

    def wait(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "not yet"
        while True:
            dead = [node.name for node in self.nodes.values() if not node.alive()]
            if dead:
                raise KubernetesUnavailable(f"node {', '.join(dead)} exited while waiting for {what}; logs under "
                                            f"{self.root}:\n{self.log_tail()}")
            try:
                if check():
                    return
            except (requests.RequestException, OSError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise KubernetesUnavailable(f"{what}: not within {timeout:.0f} s ({last}); logs under {self.root}:\n"
                                            f"{self.log_tail()}")
            time.sleep(0.2)

    def warm(self, image: str, timeout: float = 1800) -> float:
        """Have every node's kubelet pull ``image`` ahead of the pods, through a pod on each that runs ``true`` once:
        the first pull of a 6 GB image (unpacking it) takes minutes, more than an ETL's init_timeout, while later
        pulls (policy Always) find its layers unpacked. Returns the seconds it took."""
        started = time.monotonic()
        session, api = self.session(), f"{API_URL}/api/v1/namespaces/default/pods"
        names = {f"ais-wds-warm-up-{name}": name for name in self.nodes}
        for pod, node in names.items():
            session.post(api, timeout=30, json={
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "warm-up", "image": image, "command": ["true"]}]}}).raise_for_status()
        try:
            waiting = set(names)
            while waiting:
                for pod in sorted(waiting):
                    status = session.get(f"{api}/{pod}", timeout=30).json().get("status", {})
                    reasons = {c["state"]["waiting"].get("reason") for c in status.get("containerStatuses", [])
                               if "waiting" in c["state"]}
                    if status.get("phase") == "Failed" or {"ErrImagePull", "ImagePullBackOff"} & reasons:
                        raise KubernetesUnavailable(f"the kubelet of {names[pod]} could not run {image}: {status}")
                    if status.get("phase") == "Succeeded":
                        waiting.discard(pod)
                if time.monotonic() - started > timeout:
                    raise KubernetesUnavailable(f"{image} not pulled and run on {sorted(waiting)} "
                                                f"within {timeout:.0f} s")
                time.sleep(1)
        finally:
            for pod in names:
                session.delete(f"{api}/{pod}", params={"gracePeriodSeconds": 0}, timeout=30)
        return time.monotonic() - started

    # -- nodes
    def start_node(self, spec: NodeSpec) -> Node:
        """Start ``spec``'s node (again, after ``kill_node``): its namespaces, plugged into the machine room."""
        root = self.root / spec.name
        (root / "logs").mkdir(parents=True, exist_ok=True)
        disk = self.root / "disks" / spec.name
        disk.mkdir(parents=True, exist_ok=True)
        config = NodeConfig(spec.name, str(root), str(self.pki), str(cache_dir() / "state"), str(disk),
                            cgroups.root_name(spec.name, os.getpid()),
                            {k: str(v) for k, v in self.tools.paths().items()})
        cgroups.make_root(config.cgroup)
        unshare = shutil.which("unshare") or "/usr/bin/unshare"
        # --kill-child: if unshare dies (with the cluster's process, PDEATHSIG), so does the namespace's pid 1, and
        # with it every process of the node
        command = [unshare, "--net", "--mount", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
                   "--propagation", "private", "--", sys.executable, "-m", "testbed.k8s.node", str(config.write())]
        with open(root / "logs" / "node.log", "ab") as sink:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                       cwd=REPO, preexec_fn=_die_with_parent)
        inside = _child_of(process, 10)
        node = Node(spec, config, process, inside)
        self.nodes[spec.name] = node
        if not inside:
            raise KubernetesUnavailable(f"{spec.name} did not start:\n{node.log_tail()}")
        self.namespaces |= {os.readlink(f"/proc/{inside}/ns/{kind}") for kind in ("net", "pid")}
        # one end of a veth pair in the machine room, on its bridge; the other the node's eth0
        port = f"lan-{spec.name}"
        sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", str(inside))
        sh("ip", "link", "set", port, "master", LAN_BRIDGE, "up")
        sh("ip", "route", "replace", spec.pod_cidr, "via", spec.ip)
        return node

    def kill_node(self, name: str) -> list[str]:
        """The node lost at once: pid 1 of its namespaces killed, and with it its kubelet, containerd, kube-proxy
        and every pod; then its cgroup root removed. Returns what could not be removed."""
        node = self.nodes[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.inside, signal.SIGKILL)  # the kernel kills every other process of the pid namespace
        with contextlib.suppress(ProcessLookupError):
            node.process.kill()
        node.process.wait()
        _wait_gone(node.inside, 20)
        return cgroups.remove_root(node.config.cgroup)

    def restart_node(self, name: str, timeout: float = 120) -> Node:
        """A node back after ``kill_node``: the same name, address, disk and kubelet folder; Ready again."""
        node = self.start_node(node_spec(name))
        self.wait(f"{name} Ready", lambda: self.node_ready(name), timeout)
        return node

    # -- ending it
    def stop(self) -> list[str]:
        """Kill every node, remove the cgroup roots and the cluster's folders; returns what was left."""
        if self.stopped:
            return self.left
        self.stopped = True
        for name in list(self.nodes)[::-1]:
            self.left += self.kill_node(name)
        with contextlib.suppress(OSError):
            self.lan.leave()
        self.lock.close()
        return self.left

    def leftovers(self) -> list[str]:
        """After ``stop``: what is still on the host of this cluster. A process (or a thread) in one of its network
        or pid namespaces, which also keeps that namespace alive (a container's processes are in its node's pid
        namespace); a mount of its folder; a cgroup root of its nodes. This process and its children are left out:
        a thread or child started while its thread was in the machine room stays there (a library's thread pool,
        Python's multiprocessing resource tracker) and ends with this process."""
        left, own = [], str(os.getpid())
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
            with contextlib.suppress(OSError):
                process = task.parent.parent
                if own in (process.name, (process / "stat").read_text().rsplit(")", 1)[1].split()[1]):
                    continue
                held = {os.readlink(task / "ns" / kind) for kind in ("net", "pid")} & self.namespaces
                if held:
                    left.append(f"process {task.parent.parent.name} ({(task / 'comm').read_text().strip()}) in "
                                f"{', '.join(sorted(held))}")
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        left += [f"mount {line.split()[4]}" for line in mounts if str(self.root) in line]
        roots = {node.config.cgroup.strip("/") for node in self.nodes.values()}
        left += [f"cgroup {folder}" for folder in cgroups.leftovers() if Path(folder).name in roots]
        return left


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _child_of(process: subprocess.Popen, timeout: float) -> int:
    """The host pid of the first child of ``process`` (unshare's forked pid 1), or 0 if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        for task in Path(f"/proc/{process.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = (task / "children").read_text().split()
                if children:
                    return int(children[0])
        time.sleep(0.02)
    return 0


def _lock_state() -> object:
    state = cache_dir() / "state"
    state.mkdir(parents=True, exist_ok=True)
    lock = open(state / ".lock", "w")  # noqa: SIM115 (held until stop)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise KubernetesUnavailable(f"another cluster of this test bed runs with {state} (its lock is held)") from None
    return lock


def _machine_room() -> NetworkNamespace:
    """The calling thread in a new network namespace: a bridge, the nodes' gateway, forwarding between them."""
    lan = enter_network_namespace([])
    try:
        sh("ip", "link", "add", LAN_BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{LAN_GATEWAY}/24", "dev", LAN_BRIDGE)
        sh("ip", "link", "set", LAN_BRIDGE, "up")
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
    except BaseException:
        lan.leave()
        raise
    return lan


def start_cluster(root: Path, tools: Tools | None = None, timeout: float = 180.0, log=None) -> Cluster:
    """Build or find the tools; start both nodes under ``root`` and the cluster DNS; returns once all are Ready.
    The calling thread is left in the machine room (``Cluster.stop`` brings it back)."""
    from .dns import start_dns

    log = log or (lambda message: None)
    tools = tools or install_kubernetes(log=log)
    pause, coredns = go_program("pause", log=log), go_program("coredns", log=log)
    lock = _lock_state()
    cgroups.remove_orphaned()
    root.mkdir(parents=True, exist_ok=True)
    pki.make_pki(root / "pki", [spec.name for spec in NODES], CONTROL_PLANE.ip, API_SERVICE_IP, API_URL)
    started = time.monotonic()
    try:
        lan = _machine_room()
    except BaseException:
        lock.close()
        raise
    cluster = Cluster(root, tools, lan, lock)
    cluster.namespaces.add(os.readlink("/proc/thread-self/ns/net"))
    try:
        for spec in NODES:
            cluster.start_node(spec)
        control = cluster.nodes[CONTROL_PLANE.name]
        cluster.wait("the control plane", lambda: (control.root / "started").exists(), timeout)
        put_binary_image(PAUSE_IMAGE, pause)
        coredns_image = f"{REGISTRY}/ais-wds-coredns:{COREDNS_VERSION}-{digest(coredns)}"  # a rebuild: a new tag
        put_binary_image(coredns_image, coredns)
        for spec in NODES:
            cluster.wait(f"{spec.name} Ready", lambda name=spec.name: cluster.node_ready(name), timeout)
        start_dns(cluster, coredns_image, timeout)
    except BaseException:
        cluster.stop()
        raise
    log(f"Kubernetes {tools.version}: {len(NODES)} nodes Ready, cluster DNS up, in {time.monotonic() - started:.1f} s")
    return cluster
