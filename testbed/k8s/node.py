"""One Kubernetes node: pid 1 of private network, mount and pid namespaces (``python -m testbed.k8s.node``).

``cluster.py`` starts each node under ``unshare --net --mount --pid --fork --mount-proc`` and plugs one end of a
veth pair into the new network namespace as ``eth0``. This process, pid 1 there, then:
- makes the node's private files: tmpfs on ``/run`` and ``/var/log``; an overlay on ``/var/lib`` whose writes land
  in the node's folder; the node's own disk, a host folder of its own, bound at ``DISK`` (so the same path holds
  different data on each node, as on real machines); a ``resolv.conf`` that leads nowhere; copies shadowing the
  host-wide sysctls the kubelet writes;
- sets up the node's network: its address on ``eth0``, the default route to the machine room's bridge, a route
  to the other node's pod CIDR through that node, IP forwarding and bridged traffic through iptables (Services
  between pods on one bridge);
- on the control-plane node, starts the control plane and the registry (``control.py``);
- starts containerd (runc, the CNI bridge on the node's pod CIDR, every image from the cluster's registry),
  kube-proxy (iptables) and the kubelet (its own client certificate, the cluster DNS for pods);
- reaps whatever is orphaned in the namespace, until it is killed. Killing it ends the pid namespace and every
  process in it, pods included: a node lost at once. The network and mount namespaces go with their last process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import pki
from .topology import (
    API_URL,
    CLUSTER_CIDR,
    DNS_IP,
    DOMAIN,
    LAN_GATEWAY,
    NODES,
    PAUSE_IMAGE,
    REGISTRY,
    REGISTRY_ALIASES,
)
from .topology import node as node_spec

DISK = "/var/lib/ais"  # where each node's own disk is mounted; the AIS targets' hostPath volumes lie under it
# Files under /proc/sys the kubelet writes at start that are not per network namespace: shadowed by copies.
HOST_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


@dataclass
class NodeConfig:
    """What a node's pid 1 needs: written by ``cluster.py`` as JSON into the node's folder."""

    name: str
    root: str  # the node's folder
    pki: str  # the cluster's certificates
    state: str  # the cache folder whose containerd root (and, on node-0, registry) outlive a run
    disk: str  # the host folder that is this node's disk
    cgroup: str  # the kubelet's cgroup root
    tools: dict[str, str]

    def write(self) -> Path:
        path = Path(self.root) / "node.json"
        path.write_text(json.dumps(asdict(self), indent=1))
        return path


class Supervisor:
    """pid 1 of the node: starts each component with its output in ``logs/<name>.log`` and reaps orphans."""

    def __init__(self, root: Path, tools: dict[str, str]):
        self.root = root
        self.processes: dict[int, str] = {}
        path = [str(Path(tools["containerd"]).parent), str(Path(tools["runc"]).parent),
                str(Path(tools["iptables"]).parent), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        self.env = {"PATH": ":".join(dict.fromkeys(path)), "HOME": str(root), "LANG": "C.UTF-8"}

    def start(self, name: str, *command: str) -> None:
        with open(self.root / "logs" / f"{name}.log", "ab") as sink:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                       env=self.env, cwd=self.root)
        self.processes[process.pid] = name
        self.say(f"started {name} (pid {process.pid})")

    def say(self, message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.processes:
                self.say(f"{self.processes.pop(pid)} exited: status {status}")

    def wait_for(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "not yet"
        while True:
            self.reap()
            try:
                if check():
                    self.say(f"{what}: ok")
                    return
            except Exception as exc:  # noqa: BLE001 (not up yet: kept for the message)
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout:.0f} s ({last})")
            time.sleep(0.1)


def sh(*command: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


# --- what the node is made of ------------------------------------------------------------------------------


def containerd_config(config: NodeConfig) -> str:
    tools, root = config.tools, Path(config.root)
    return f"""\
version = 2
root = "{Path(config.state) / f'containerd-{config.name}'}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing",
  "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower a container's oom_score_adj below its own
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    # the registry keeps the compressed layers: once unpacked, containerd need not keep a second copy
    discard_unpacked_layers = true
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{tools['runc']}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{tools['cni_bin_dir']}"
    conf_dir = "{root / 'cni'}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{root / 'registry-hosts'}"
"""


def registry_hosts(root: Path, registry: str) -> None:
    """Every image name the cluster uses is pulled from its registry, over plain HTTP (``REGISTRY_ALIASES``)."""
    for host in REGISTRY_ALIASES:
        folder = root / "registry-hosts" / host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts.toml").write_text(
            f'server = "http://{registry}"\n[host."http://{registry}"]\n  capabilities = ["pull", "resolve"]\n')


def cni_config(root: Path, pod_cidr: str) -> None:
    """The bridge plugin (host-local addresses from the node's pod CIDR) and portmap (hostPorts)."""
    (root / "cni").mkdir(parents=True, exist_ok=True)
    (root / "cni" / "10-bridge.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0", "name": "ais-wds",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ]}, indent=1))


def kubelet_config(config: NodeConfig) -> str:
    root, spec, pem = Path(config.root), node_spec(config.name), Path(config.pki)
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs", "cgroupRoot": config.cgroup, "failSwapOn": False,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "address": spec.ip, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "resolvConf": str(root / "resolv.conf"), "clusterDNS": [DNS_IP], "clusterDomain": DOMAIN,
        "authentication": {"x509": {"clientCAFile": str(pem / "ca.crt")}, "anonymous": {"enabled": False},
                           "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        # a shared disk and memory must not evict the tests' pods, nor collect the 6 GB image
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "registerNode": True,
        "fileCheckFrequency": "1s", "syncFrequency": "5s", "nodeStatusUpdateFrequency": "2s",
    }, indent=1)


def kube_proxy_config(config: NodeConfig) -> str:
    spec = node_spec(config.name)
    return json.dumps({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clusterCIDR": CLUSTER_CIDR, "hostnameOverride": config.name, "bindAddress": spec.ip,
        "clientConnection": {"kubeconfig": str(Path(config.pki) / f"{pki.PROXY}.kubeconfig")},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        # conntrack's table size and timeouts are the host's (not per namespace): leave them alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }, indent=1)


# --- pid 1 of the node ------------------------------------------------------------------------------------


def _private_files(config: NodeConfig) -> None:
    root = Path(config.root)
    for folder in ("/run", "/var/log"):  # containerd's state and socket; the kubelet's pod logs
        sh("mount", "-t", "tmpfs", "-o", "mode=755,size=2g", "ais-wds-k8s", folder)
    for folder in ("/var/log/pods", "/var/log/containers"):
        Path(folder).mkdir()
    # the CNI plugins keep their state under /var/lib/cni: written to an overlay's upper folder, not to the host
    upper, work = root / "var-lib" / "upper", root / "var-lib" / "work"
    upper.mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    sh("mount", "-t", "overlay", "ais-wds-k8s", "-o", f"lowerdir=/var/lib,upperdir={upper},workdir={work}", "/var/lib")
    Path(DISK).mkdir(exist_ok=True)
    sh("mount", "--bind", config.disk, DISK)
    (root / "resolv.conf").write_text(f"nameserver {node_spec(config.name).ip}\noptions timeout:1 attempts:1\n")
    sh("mount", "--bind", str(root / "resolv.conf"), "/etc/resolv.conf")
    shadows = root / "sysctl"
    shadows.mkdir(exist_ok=True)
    for key in HOST_SYSCTLS:
        real = Path("/proc/sys") / key
        if real.exists():
            copy = shadows / key.replace("/", ".")
            copy.write_text(real.read_text())
            sh("mount", "--bind", str(copy), str(real))


def _network(config: NodeConfig, timeout: float = 30) -> None:
    """``eth0`` is plugged in from outside (``cluster.py``); wait for it, then address and route the node."""
    spec = node_spec(config.name)
    sh("ip", "link", "set", "lo", "up")
    deadline = time.monotonic() + timeout
    while not Path("/sys/class/net/eth0").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no eth0 plugged into {config.name} within {timeout:.0f} s")
        time.sleep(0.05)
    sh("ip", "addr", "add", f"{spec.ip}/24", "dev", "eth0")
    sh("ip", "link", "set", "eth0", "up")
    sh("ip", "route", "add", "default", "via", LAN_GATEWAY, "dev", "eth0")
    for other in NODES:
        if other.name != spec.name:
            sh("ip", "route", "add", other.pod_cidr, "via", other.ip, "dev", "eth0")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    bridged = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if bridged.exists():  # a Service's reply between two pods on one bridge must pass its NAT back
        bridged.write_text("1")


def _clear_containers(supervisor: Supervisor, tools: dict[str, str]) -> None:
    """containerd's root outlives a run (its images are cached): forget the containers a killed run left."""
    ctr = [tools["ctr"], "--address", "/run/containerd/containerd.sock", "-n", "k8s.io"]
    listed = subprocess.run([*ctr, "containers", "list", "-q"], capture_output=True, text=True, timeout=60)
    names = listed.stdout.split()
    if names:
        subprocess.run([*ctr, "containers", "delete", *names], capture_output=True, timeout=120)
        supervisor.say(f"removed {len(names)} containers left by an earlier run")


def inside(config: NodeConfig) -> None:
    from .control import start_control_plane

    root, tools, spec = Path(config.root), config.tools, node_spec(config.name)
    pem = Path(config.pki)
    supervisor = Supervisor(root, tools)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _private_files(config)
    _network(config)
    cni_config(root, spec.pod_cidr)
    registry_hosts(root, REGISTRY)
    (root / "containerd.toml").write_text(containerd_config(config))
    (root / "kubelet.json").write_text(kubelet_config(config))
    (root / "kube-proxy.json").write_text(kube_proxy_config(config))
    if spec.control_plane:
        start_control_plane(supervisor, config)
    supervisor.start("containerd", tools["containerd"], "--config", str(root / "containerd.toml"))
    supervisor.wait_for("containerd socket", lambda: Path("/run/containerd/containerd.sock").exists(), 30)
    _clear_containers(supervisor, tools)
    supervisor.start("kube-proxy", tools["proxy"], f"--config={root / 'kube-proxy.json'}", "--v=1")
    supervisor.start("kubelet", tools["kubelet"], f"--config={root / 'kubelet.json'}",
                     f"--kubeconfig={pem / (pki.kubelet_identity(config.name) + '.kubeconfig')}",
                     f"--node-ip={spec.ip}", f"--hostname-override={config.name}",
                     f"--root-dir={root / 'kubelet'}", "--v=1")
    (root / "started").write_text(str(os.getpid()))
    supervisor.say(f"{config.name} started; its apiserver is {API_URL}")
    while True:  # pid 1: reap what is orphaned in the namespace until killed
        supervisor.reap()
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    config = NodeConfig(**json.loads(Path(argv[0]).read_text()))
    inside(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
