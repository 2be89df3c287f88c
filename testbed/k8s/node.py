"""A real single-node Kubernetes inside private network, mount and pid namespaces.

``start_node`` runs ``python -m testbed.k8s.node --inside <config>`` under
``unshare --net --mount --pid --fork --mount-proc``: pid 1 of the new pid namespace sets the namespaces up,
then starts etcd, a local image registry, containerd (runc, the CNI bridge), kube-apiserver,
kube-controller-manager, kube-scheduler, kube-proxy (iptables) and the kubelet, and reaps whatever is
orphaned, until it is killed. Killing it ends the pid namespace and every process in it (the pods too);
the network and mount namespaces go with their last process.

What stays off the host:
- the network: the node's address (198.51.100.10) is on one end of a veth pair, pods get 203.0.113.0/24 on a
  bridge, Services 192.0.2.0/24 (documentation ranges, routed nowhere); the default route leads into the
  veth pair and ends there, so no packet leaves the namespace;
- the files: tmpfs on ``/run`` and ``/var/log``, an overlay on ``/var/lib`` (its writes land in the test's
  folder); a ``resolv.conf`` of the test's own; the host-wide sysctls the kubelet writes are shadowed by bind-mounted
  copies;
- cgroups: the kubelet (cgroupfs driver) uses a cgroup root of its own, ``/ais-wds-k8s-<pid>``, made in
  every hierarchy before the start and removed, depth first, after the pid namespace is gone.

What persists, in the cache (``testbed/k8s/build.py``): the registry's storage and containerd's root, so
that the project's 6 GB image is pushed and pulled once, not per run. A lock keeps two clusters from using
them at once.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from ..cluster import _die_with_parent, owner_gone
from .build import KubernetesUnavailable, Tools, cache_dir, install_kubernetes, pause_binary

NODE = "ais-node"
NODE_IP = "198.51.100.10"
POD_CIDR = "203.0.113.0/24"
SERVICE_CIDR = "192.0.2.0/24"
API_SERVICE_IP = "192.0.2.1"  # the first address of the Service range: the "kubernetes" Service
API_PORT = 6443
REGISTRY = "127.0.0.1:5000"
PAUSE_IMAGE = f"{REGISTRY}/ais-wds-pause:1"
CLONE_NEWNET = 0x40000000
CGROUP_PREFIX = "/ais-wds-k8s-"  # + the test process's pid: the kubelet's cgroup root
# Files under /proc/sys the kubelet writes at start that are not per network namespace: shadowed by copies.
HOST_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


@dataclass
class Config:
    """What the inside process needs: written by ``start_node`` as JSON beside the cluster's files."""

    root: str
    cache: str
    cgroup: str  # the kubelet's cgroup root, "/ais-wds-k8s-<pid>"
    tools: dict[str, str]
    pause: str


# --- outside: start, enter, stop -------------------------------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies (v1 controllers and the v2/unified one)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] in ("cgroup", "cgroup2"):
            found.append(Path(left.split()[4]))
    return found


def make_cgroup_root(name: str) -> list[Path]:
    """``/<name>`` in every hierarchy; cpuset's ``cpus`` and ``mems`` copied from its parent."""
    made = []
    for hierarchy in cgroup_hierarchies():
        folder = hierarchy / name.strip("/")
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        made.append(folder)
        for key in ("cpuset.cpus", "cpuset.mems"):
            if (folder / key).exists() and not (folder / key).read_text().strip():
                (folder / key).write_text((hierarchy / key).read_text())
    return made


def remove_cgroup_tree(folder: Path, timeout: float = 10.0) -> list[str]:
    """``rmdir`` depth first; returns the folders that could not be removed (with why)."""
    if not folder.is_dir():
        return []
    left = []
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        left += _rmdir(sub, timeout)
    return left + _rmdir(folder, timeout)


def _rmdir(folder: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            folder.rmdir()
            return []
        except FileNotFoundError:
            return []
        except OSError as exc:  # EBUSY while its last process is being reaped
            if time.monotonic() > deadline:
                return [f"{folder}: {exc.strerror}"]
            time.sleep(0.1)


def remove_orphaned_cgroups() -> None:
    """The cgroup roots of nodes whose test process is gone (killed before its teardown): their pid namespace
    died with it, so they are empty."""
    for hierarchy in cgroup_hierarchies():
        for folder in hierarchy.glob(f"{CGROUP_PREFIX.strip('/')}*"):
            if owner_gone(folder.name.rsplit("-", 1)[-1]):
                remove_cgroup_tree(folder, timeout=1.0)


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


@dataclass
class KubeNode:
    """A running single-node Kubernetes; ``stop`` ends it and removes what it made on the host."""

    root: Path
    tools: Tools
    cgroup: str
    process: subprocess.Popen  # unshare
    inside: int  # host pid of pid 1 in the node's pid namespace
    lock: object
    _original_netns: int = -1
    stopped: bool = False
    left: list[str] = field(default_factory=list)

    # -- talking to it
    @property
    def api_url(self) -> str:
        return f"https://{NODE_IP}:{API_PORT}"

    def kubeconfig(self) -> Path:
        return self.root / "pki" / "admin.kubeconfig"

    def kubectl(self, *args: str, timeout: float = 60, check: bool = True, input: str | None = None) -> str:
        """``kubectl`` as the cluster's admin; run inside the node's network namespace."""
        done = subprocess.run(self.kubectl_command(*args),
                              capture_output=True, text=True, timeout=timeout, input=input,
                              preexec_fn=self.enter_netns)
        if check and done.returncode != 0:
            raise KubernetesUnavailable(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def kubectl_command(self, *args: str) -> list[str]:
        """The command line of ``kubectl`` as the cluster's admin; run it with ``preexec_fn=enter_netns``."""
        return [str(self.tools.kubectl), f"--kubeconfig={self.kubeconfig()}", *args]

    def enter_netns(self) -> None:  # between fork and exec: the child joins the node's network namespace
        fd = os.open(f"/proc/{self.inside}/ns/net", os.O_RDONLY)
        _libc().setns(fd, CLONE_NEWNET)
        os.close(fd)

    def session(self) -> requests.Session:
        """An HTTPS session to the API as its admin (the caller's thread must be in the node's network)."""
        return admin_session(self.root / "pki")

    def inside_path(self, path: str | Path) -> Path:
        """A path as the node's mount namespace sees it (its tmpfs ``/run``, ``/var/log/pods``)."""
        return Path(f"/proc/{self.inside}/root") / str(path).lstrip("/")

    def enter(self) -> None:
        """Move the calling thread into the node's network namespace (``leave`` returns it)."""
        self._original_netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/proc/{self.inside}/ns/net", os.O_RDONLY)
        try:
            if _libc().setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into the node's network namespace: {os.strerror(err)}")
        finally:
            os.close(fd)

    def leave(self) -> None:
        if self._original_netns < 0:
            return
        if _libc().setns(self._original_netns, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns back to the original network namespace: {os.strerror(err)}")
        os.close(self._original_netns)
        self._original_netns = -1

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        text = ""
        for log in sorted((self.root / "logs").glob("*.log")):
            text += f"--- {log.name}\n{log.read_text(errors='replace')[-chars // 4:]}\n"
        return text

    def push(self, local: str, *names: str) -> None:
        """Push a local podman image into the node's registry as each of ``names`` (``repo:tag``)."""
        for name in names:
            done = subprocess.run(["podman", "push", "--quiet", "--tls-verify=false", "--format", "v2s2", local,
                                   f"docker://{REGISTRY}/{name}"], capture_output=True, text=True, timeout=1800,
                                  preexec_fn=self.enter_netns)
            if done.returncode != 0:
                raise KubernetesUnavailable(f"podman push {local} -> {REGISTRY}/{name}: {done.stderr.strip()}")

    def warm(self, image: str, timeout: float = 1800) -> float:
        """Have the kubelet pull ``image`` ahead of the pods, through a pod that runs ``true`` once: the first pull
        of a 6 GB image (unpacking it) takes minutes, more than an ETL's init_timeout, while later pulls (policy
        Always) find its layers unpacked. Returns the seconds it took."""
        started = time.monotonic()
        name = "ais-wds-image-warm-up"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
               "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                        "containers": [{"name": "warm-up", "image": image, "command": ["true"]}]}}
        session, api = self.session(), f"{self.api_url}/api/v1/namespaces/default/pods"
        session.post(api, json=pod, timeout=30).raise_for_status()
        try:
            while True:
                status = session.get(f"{api}/{name}", timeout=30).json().get("status", {})
                if status.get("phase") == "Succeeded":
                    return time.monotonic() - started
                waiting = [c["state"]["waiting"].get("reason") for c in status.get("containerStatuses", [])
                           if "waiting" in c["state"]]
                if status.get("phase") == "Failed" or {"ErrImagePull", "ImagePullBackOff"} & set(waiting):
                    raise KubernetesUnavailable(f"the kubelet could not run {image}: {status}")
                if time.monotonic() - started > timeout:
                    raise KubernetesUnavailable(f"the kubelet did not pull and run {image} within {timeout:.0f} s")
                time.sleep(1)
        finally:
            session.delete(f"{api}/{name}", params={"gracePeriodSeconds": 0}, timeout=30)

    # -- ending it
    def stop(self) -> list[str]:
        """Kill the pid namespace, remove the cgroup root and the folders made on the host; returns what was left."""
        if self.stopped:
            return self.left
        self.stopped = True
        with contextlib.suppress(OSError):
            self.leave()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.inside, signal.SIGKILL)  # pid 1 of the namespace: the kernel kills every other process in it
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        _wait_gone(self.inside, 20)
        for hierarchy in cgroup_hierarchies():
            self.left += remove_cgroup_tree(hierarchy / self.cgroup.strip("/"))
        self.lock.close()
        return self.left


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(x) for x in (task / "children").read_text().split()]
    return found


def start_node(root: Path, tools: Tools | None = None, timeout: float = 120.0, log=None) -> KubeNode:
    """Build or find the tools, then start the node under ``root``; returns once the node is Ready."""
    log = log or (lambda message: None)
    tools = tools or install_kubernetes(log=log)
    pause = pause_binary()
    cache = cache_dir() / "state"
    cache.mkdir(parents=True, exist_ok=True)
    lock = open(cache / ".lock", "w")  # noqa: SIM115 (held until stop)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise KubernetesUnavailable(f"another real Kubernetes of these tests runs with {cache} (its lock is held)") \
            from None
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    remove_orphaned_cgroups()
    cgroup = f"{CGROUP_PREFIX}{os.getpid()}"
    make_cgroup_root(cgroup)
    config = Config(str(root), str(cache), cgroup, {k: str(v) for k, v in tools.paths().items()}, str(pause))
    (root / "config.json").write_text(json.dumps(asdict(config), indent=1))
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    # --kill-child: if unshare dies (with the test process, PDEATHSIG), so does the namespace's pid 1, and with it
    # every process of the node
    command = [unshare, "--net", "--mount", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
               "--propagation", "private", "--",
               sys.executable, "-m", "testbed.k8s.node", "--inside", str(root / "config.json")]
    sink = open(root / "logs" / "node.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                               cwd=Path(__file__).resolve().parents[2], preexec_fn=_die_with_parent)  # the repo
    sink.close()
    deadline = time.monotonic() + 10
    inside = 0
    while not inside and time.monotonic() < deadline and process.poll() is None:
        children = _children(process.pid)
        inside = children[0] if children else 0
        time.sleep(0.02)
    node = KubeNode(root, tools, cgroup, process, inside, lock)
    started = time.monotonic()
    while not (root / "ready").exists():
        if process.poll() is not None or not inside or time.monotonic() - started > timeout:
            why = "exited" if process.poll() is not None else f"not Ready within {timeout:.0f} s"
            node.stop()
            raise KubernetesUnavailable(f"the Kubernetes node {why}; logs under {root / 'logs'}:\n{node.log_tail()}")
        time.sleep(0.1)
    log(f"Kubernetes {tools.version} node Ready in {time.monotonic() - started:.1f} s")
    return node


# --- inside: pid 1 of the node's namespaces ------------------------------------------------------------


def _sh(*command: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


_OPENSSL_EXT = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, \
DNS:kubernetes.default.svc.cluster.local, DNS:localhost, IP:127.0.0.1, IP:{node}, IP:{service}
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
"""


def make_pki(folder: Path) -> None:
    """A throw-away CA; the apiserver's certificate; admin and kubelet clients; the service-account key pair."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openssl.cnf").write_text(_OPENSSL_EXT.format(node=NODE_IP, service=API_SERVICE_IP))

    def openssl(*args: str) -> None:
        _sh("openssl", *args, cwd=folder)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=ais-wds-k8s-ca", "-config", "openssl.cnf", "-extensions", "ca")
    for name, subject, ext in (("apiserver", "/CN=kube-apiserver", "server"),
                               ("admin", "/O=system:masters/CN=admin", "client"),
                               ("kubelet", f"/O=system:nodes/CN=system:node:{NODE}", "client")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                subject, "-config", "openssl.cnf")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", "openssl.cnf", "-extensions", ext)
    openssl("genrsa", "-out", "sa.key", "2048")
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
    for name in ("admin", "kubelet"):
        (folder / f"{name}.kubeconfig").write_text(kubeconfig(folder, name))


def admin_session(pki: Path) -> requests.Session:
    """HTTPS to the API as its admin, trusting the node's CA alone (``trust_env`` off: requests would let
    ``REQUESTS_CA_BUNDLE`` replace ``verify``, and a proxy variable route the call out of the namespace)."""
    session = requests.Session()
    session.trust_env = False
    session.cert = (str(pki / "admin.crt"), str(pki / "admin.key"))
    session.verify = str(pki / "ca.crt")
    return session


def kubeconfig(folder: Path, user: str) -> str:
    def b64(name: str) -> str:
        return base64.b64encode((folder / name).read_bytes()).decode()

    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "ais",
        "clusters": [{"name": "ais", "cluster": {"server": f"https://{NODE_IP}:{API_PORT}",
                                                 "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "ais", "context": {"cluster": "ais", "user": user}}],
    }, indent=1)


def _containerd_config(config: Config, root: Path) -> str:
    tools = config.tools
    cache = Path(config.cache)
    return f"""\
version = 2
root = "{cache / 'containerd'}"
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


def _registry_hosts(root: Path) -> None:
    """Every image comes from the node's registry: docker.io's names too (``ais-wds-transformer:test`` is
    ``docker.io/library/ais-wds-transformer:test``), so nothing is asked of any registry outside."""
    for host in ("docker.io", REGISTRY, "localhost:5000"):
        folder = root / "registry-hosts" / host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts.toml").write_text(
            f'server = "http://{REGISTRY}"\n[host."http://{REGISTRY}"]\n  capabilities = ["pull", "resolve"]\n')


def _cni(root: Path) -> None:
    (root / "cni").mkdir(exist_ok=True)
    (root / "cni" / "10-bridge.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0", "name": "ais-wds",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ]}, indent=1))


def _kubelet_config(config: Config, root: Path) -> str:
    pki = root / "pki"
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs", "cgroupRoot": config.cgroup, "failSwapOn": False,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "resolvConf": str(root / "resolv.conf"), "podCIDR": POD_CIDR,
        "authentication": {"x509": {"clientCAFile": str(pki / "ca.crt")}, "anonymous": {"enabled": False},
                           "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        # a shared disk and memory must not evict the tests' pods, nor collect the 6 GB image
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "registerNode": True,
        "fileCheckFrequency": "1s", "syncFrequency": "5s", "nodeStatusUpdateFrequency": "2s",
    }, indent=1)


def _kube_proxy_config(root: Path) -> str:
    return json.dumps({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": NODE, "bindAddress": NODE_IP,
        "clientConnection": {"kubeconfig": str(root / "pki" / "admin.kubeconfig")},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        # conntrack's table size and timeouts are the host's (not per namespace): leave them alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }, indent=1)


def _registry_config(cache: Path) -> str:
    return json.dumps({"version": 0.1, "log": {"level": "warn"},
                       "storage": {"filesystem": {"rootdirectory": str(cache / "registry")},
                                   "delete": {"enabled": True}},
                       "http": {"addr": REGISTRY}})


class Supervisor:
    """pid 1 of the node: starts each component with its output in ``logs/<name>.log`` and reaps orphans."""

    def __init__(self, root: Path, tools: dict[str, str]):
        self.root = root
        self.tools = tools
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


def _setup_namespaces(root: Path) -> None:
    for folder in ("/run", "/var/log"):  # containerd's state and socket; the kubelet's pod logs
        _sh("mount", "-t", "tmpfs", "-o", "mode=755,size=2g", "ais-wds-k8s", folder)
    for folder in ("/var/log/pods", "/var/log/containers"):
        Path(folder).mkdir()
    # the CNI plugins keep their state under /var/lib/cni: written to an overlay's upper folder, not to the host
    upper, work = root / "var-lib" / "upper", root / "var-lib" / "work"
    upper.mkdir(parents=True)
    work.mkdir()
    _sh("mount", "-t", "overlay", "ais-wds-k8s", "-o", f"lowerdir=/var/lib,upperdir={upper},workdir={work}", "/var/lib")
    (root / "resolv.conf").write_text(f"nameserver {NODE_IP}\noptions timeout:1 attempts:1\n")
    _sh("mount", "--bind", str(root / "resolv.conf"), "/etc/resolv.conf")
    shadows = root / "sysctl"
    shadows.mkdir(exist_ok=True)
    for key in HOST_SYSCTLS:
        real = Path("/proc/sys") / key
        if real.exists():
            copy = shadows / key.replace("/", ".")
            copy.write_text(real.read_text())
            _sh("mount", "--bind", str(copy), str(real))
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", "node0", "type", "veth", "peer", "name", "node0-end")
    _sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", "node0")
    _sh("ip", "link", "set", "node0", "up")
    _sh("ip", "link", "set", "node0-end", "up")
    _sh("ip", "route", "add", "default", "via", "198.51.100.1", "dev", "node0")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")


def inside(config_path: Path) -> None:
    config = Config(**json.loads(config_path.read_text()))
    root = Path(config.root)
    tools = config.tools
    cache = Path(config.cache)
    supervisor = Supervisor(root, tools)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _setup_namespaces(root)
    make_pki(root / "pki")
    pki = root / "pki"
    _cni(root)
    _registry_hosts(root)
    (cache / "registry").mkdir(parents=True, exist_ok=True)
    (root / "registry.json").write_text(_registry_config(cache))
    (root / "containerd.toml").write_text(_containerd_config(config, root))
    (root / "kubelet.json").write_text(_kubelet_config(config, root))
    (root / "kube-proxy.json").write_text(_kube_proxy_config(root))

    supervisor.start("etcd", tools["etcd"], "--data-dir", str(root / "etcd"), "--listen-client-urls",
                     "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
                     "--listen-peer-urls", "http://127.0.0.1:2380", "--log-level", "warn")
    supervisor.start("registry", tools["registry"], "serve", str(root / "registry.json"))
    supervisor.start("containerd", tools["containerd"], "--config", str(root / "containerd.toml"))
    supervisor.start("kube-apiserver", tools["apiserver"],
                     "--etcd-servers=http://127.0.0.1:2379", f"--advertise-address={NODE_IP}",
                     f"--bind-address={NODE_IP}", f"--secure-port={API_PORT}",
                     f"--service-cluster-ip-range={SERVICE_CIDR}", "--service-node-port-range=30000-32767",
                     f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                     f"--client-ca-file={pki / 'ca.crt'}", "--authorization-mode=Node,RBAC",
                     "--service-account-issuer=https://kubernetes.default.svc",
                     f"--service-account-key-file={pki / 'sa.pub'}",
                     f"--service-account-signing-key-file={pki / 'sa.key'}",
                     f"--kubelet-client-certificate={pki / 'admin.crt'}",
                     f"--kubelet-client-key={pki / 'admin.key'}",
                     "--kubelet-preferred-address-types=InternalIP", "--allow-privileged=true",
                     "--enable-admission-plugins=NodeRestriction", "--profiling=false", "--v=1",
                     # Debian's etcd 3.4 lets the watch cache fall behind: a watch without a resourceVersion then
                     # ends within 3 s ("Too large resource version"), and AIS 5.0's pod watcher spins on the
                     # closed channel (a CPU per ETL and target). Watches served by etcd itself stay open.
                     "--watch-cache=false")
    session = admin_session(pki)
    api = f"https://{NODE_IP}:{API_PORT}"
    supervisor.wait_for("apiserver /readyz", lambda: session.get(f"{api}/readyz", timeout=2).ok, 90)
    supervisor.start("kube-controller-manager", tools["controller_manager"],
                     f"--kubeconfig={pki / 'admin.kubeconfig'}", "--leader-elect=false",
                     f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                     "--use-service-account-credentials=false", f"--cluster-cidr={POD_CIDR}",
                     f"--service-cluster-ip-range={SERVICE_CIDR}", "--bind-address=127.0.0.1", "--v=1")
    supervisor.start("kube-scheduler", tools["scheduler"], f"--kubeconfig={pki / 'admin.kubeconfig'}",
                     "--leader-elect=false", "--bind-address=127.0.0.1", "--v=1")
    supervisor.wait_for("containerd socket", lambda: Path("/run/containerd/containerd.sock").exists(), 30)
    _clear_containers(supervisor, tools)
    supervisor.wait_for("registry", lambda: requests.get(f"http://{REGISTRY}/v2/", timeout=2).ok, 30)
    _pause_image(supervisor, Path(config.pause))
    supervisor.start("kube-proxy", tools["proxy"], f"--config={root / 'kube-proxy.json'}", "--v=1")
    supervisor.start("kubelet", tools["kubelet"], f"--config={root / 'kubelet.json'}",
                     f"--kubeconfig={pki / 'kubelet.kubeconfig'}", f"--node-ip={NODE_IP}",
                     f"--hostname-override={NODE}", f"--root-dir={root / 'kubelet'}", "--v=1")

    def node_ready() -> bool:
        status = session.get(f"{api}/api/v1/nodes/{NODE}", timeout=2).json()["status"]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))

    supervisor.wait_for("node Ready", node_ready, 90)
    supervisor.wait_for("default ServiceAccount",
                        lambda: session.get(f"{api}/api/v1/namespaces/default/serviceaccounts/default",
                                            timeout=2).ok, 60)
    (root / "ready").write_text(str(os.getpid()))
    while True:  # pid 1: reap what is orphaned in the namespace until killed
        supervisor.reap()
        time.sleep(0.2)


def _clear_containers(supervisor: Supervisor, tools: dict[str, str]) -> None:
    """containerd's root outlives a run (its images are cached): forget the containers a killed run left."""
    ctr = [tools["ctr"], "--address", "/run/containerd/containerd.sock", "-n", "k8s.io"]
    listed = subprocess.run([*ctr, "containers", "list", "-q"], capture_output=True, text=True, timeout=60)
    names = listed.stdout.split()
    if names:
        subprocess.run([*ctr, "containers", "delete", *names], capture_output=True, timeout=120)
        supervisor.say(f"removed {len(names)} containers left by an earlier run")


def _pause_image(supervisor: Supervisor, pause: Path) -> None:
    """The pod sandbox's image, the static ``pause`` binary alone, put into the node's registry once
    through the registry's HTTP API (no image tool is needed for a one-file image)."""
    import gzip
    import hashlib
    import io
    import tarfile

    name, tag = PAUSE_IMAGE.split("/", 1)[1].split(":")
    base = f"http://{REGISTRY}/v2/{name}"
    manifest_type = "application/vnd.docker.distribution.manifest.v2+json"
    if requests.head(f"{base}/manifests/{tag}", timeout=5, headers={"Accept": manifest_type}).ok:
        return
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as archive:
        info = tarfile.TarInfo("pause")
        info.size, info.mode = pause.stat().st_size, 0o755
        with open(pause, "rb") as binary:
            archive.addfile(info, binary)
    diff_id = "sha256:" + hashlib.sha256(layer.getvalue()).hexdigest()
    compressed = gzip.compress(layer.getvalue(), mtime=0)
    image_config = json.dumps({"architecture": "amd64", "os": "linux",
                               "config": {"Entrypoint": ["/pause"]},
                               "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()

    def put_blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        upload = requests.post(f"{base}/blobs/uploads/", timeout=30)
        upload.raise_for_status()
        location = upload.headers["Location"]
        location = location if location.startswith("http") else f"http://{REGISTRY}{location}"
        done = requests.put(location, params={"digest": digest}, data=data, timeout=60,
                            headers={"Content-Type": "application/octet-stream"})
        done.raise_for_status()
        return digest

    manifest = {"schemaVersion": 2, "mediaType": manifest_type,
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "size": len(image_config), "digest": put_blob(image_config)},
                "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                            "size": len(compressed), "digest": put_blob(compressed)}]}
    requests.put(f"{base}/manifests/{tag}", data=json.dumps(manifest), timeout=30,
                 headers={"Content-Type": manifest_type}).raise_for_status()
    supervisor.say(f"put {PAUSE_IMAGE} into the registry")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--inside"]:
        inside(Path(argv[1]))
        return 0
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ais-wds-k8s-"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    node = start_node(root, log=print)
    print(f"node Ready; kubectl: nsenter --net=/proc/{node.inside}/ns/net {node.tools.kubectl} "
          f"--kubeconfig={node.kubeconfig()} get nodes\nCtrl-C stops it.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()
    print("left:", node.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
