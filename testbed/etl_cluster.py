"""A real AIStore that runs ETL, in a private network namespace, with only Kubernetes faked.

One proxy and two targets on two "nodes", in Kubernetes mode; the fake Kubernetes is ``testbed/fake_kube.py``.

AIS 5.0 refuses ETL unless aisnode believes it runs in Kubernetes (``cmn/k8s``: client-go's
``rest.InClusterConfig`` finds ``KUBERNETES_SERVICE_HOST``/``_PORT`` and a service-account token, and
``MY_NODE``/``MY_POD`` name the node and the node's pod). So each aisnode gets that environment, and a
service account (token, ``ca.crt`` of the fake API's throw-away CA, namespace) at the fixed path
``/var/run/secrets/kubernetes.io/serviceaccount``, mounted on a tmpfs in a mount namespace of its own
(``unshare --mount``): the host's ``/run`` is never touched.

The network: a namespace of its own (``testbed/netns.py``), where each node gets an address of the
documentation range 198.51.100.0/24 on ``lo`` (aisnode drops loopback addresses in Kubernetes mode,
so it needs one more).

Layout: node-0 (198.51.100.10) runs the proxy, node-1 (.11) and node-2 (.12) a target each; the pods AIS
creates for a target run on that target's node, so every ETL has two pods and a bucket's objects
spread over both. ``python -m testbed.etl_cluster`` starts one by hand (see ``main``). ``settings()`` is
the small, quick ETL the real-ETL tests and the benchmarks through AIS register on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import transformer
from transformer.client import EtlSettings

from .ais_view import AisView
from .cluster import (
    Node,
    _die_with_parent,
    _node_env,
    cluster_config,
    local_config,
    owner_gone,
    stop_nodes,
    wait_ready,
)
from .fake_kube import FakeKubernetes
from .netns import enter_network_namespace
from .pods import ContainerRuntime, PodRuntime, ProcessRuntime
from .ports import free_ports
from .tlscerts import make_tls_files

REAL_KUBERNETES = os.environ.get("AIS_WDS_KUBE") == "real"  # make test-k8s: AIS on the real cluster (testbed/k8s)
IMAGE = "ais-wds-transformer:test"  # process pods: wds-transform serve; container pods: the built image (pods.py)
NODES = {"node-0": "198.51.100.10", "node-1": "198.51.100.11", "node-2": "198.51.100.12"}
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# The wrapper each aisnode runs in: a mount namespace of its own with the service account on a tmpfs
# over /run (/var/run is /run here; if not, over /var/run), then aisnode itself (same process).
_WITH_SERVICE_ACCOUNT = (
    'set -e; run=$(readlink -f /var/run); mount -t tmpfs -o size=1m,mode=755 ais-k8s-sa "$run"; '
    f'mkdir -p {SERVICE_ACCOUNT}; cp "$AIS_WDS_SA"/token "$AIS_WDS_SA"/ca.crt "$AIS_WDS_SA"/namespace '
    f'{SERVICE_ACCOUNT}/; exec "$@"'
)


@dataclass
class EtlCluster(AisView):
    """One proxy and two targets in Kubernetes mode, the fake Kubernetes that runs their ETL pods."""

    root: Path
    kube: FakeKubernetes
    proxy: Node
    targets: list[Node]
    mountpaths: list[Path]
    kube_port: int
    disks: Path | None = None  # where the mountpaths live, when apart from root (removed by stop)
    _stopped: bool = field(default=False, repr=False)

    @property
    def pod_mountpaths(self) -> list[Path]:
        """Each target's mountpath as its ETL pods see it: the same path as on the host here."""
        return self.mountpaths

    def target_logs(self) -> str:
        """The targets' whole INFO logs (AIS's own account of each ETL)."""
        return "\n".join((node.folder / "log" / "aistarget.INFO").read_text(errors="replace")
                         for node in self.targets if (node.folder / "log" / "aistarget.INFO").is_file())

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM the targets, then the proxy; then the fake Kubernetes, which kills any pod still there.

        Returns what had to be forced, recorded before anything is killed: an aisnode still running
        ``timeout`` after SIGTERM, and ETL pods that AIS did not delete (on unregister, stop or its own
        shutdown). Empty when everything ended by itself.
        """
        if self._stopped:
            return []
        self._stopped = True
        forced = stop_nodes([self.targets, [self.proxy]], timeout)
        forced += [f"pod {pod.name} ({pod.runtime}, {'running' if pod.running else 'exited'}) was never deleted by AIS"
                   for pod in self.kube.etl_pods()]
        self.kube.stop()
        for runtime in {id(r): r for r in (self.kube.runtime, *self.kube.runtimes.values())}.values():
            forced += [f"container {name} outlived its pod" for name in runtime.leftovers()]
            runtime.remove_all()
        if self.disks is not None:
            shutil.rmtree(self.disks, ignore_errors=True)
        return forced

    def __enter__(self) -> EtlCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _service_account(folder: Path, ca: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "token").write_text(secrets.token_urlsafe(24))
    shutil.copy(ca, folder / "ca.crt")
    (folder / "namespace").write_text("default")
    return folder


def _start_node(binary: Path, role: str, node: str, folder: Path, config: Path, env: dict[str, str],
                mountpath_root: Path | None = None, public_port: int | None = None) -> Node:
    """One aisnode on ``node``'s address, inside its own mount namespace with the service account."""
    host = NODES[node]
    picked = [port for port in free_ports(4, host) if port != public_port]  # none taken twice
    ports = (public_port or picked[2], picked[0], picked[1])
    folder.mkdir(parents=True)
    (folder / "conf").mkdir()
    (folder / "log").mkdir()
    local = local_config(folder, ports, mountpath_root)
    local["host_net"].update(hostname=host, hostname_intra_control=host, hostname_intra_data=host)
    (folder / "local.json").write_text(json.dumps(local, indent=1))
    command = [str(binary), f"-config={config}", f"-local_config={folder / 'local.json'}", f"-role={role}"]
    if role == "proxy":
        # No -skip_startup: with it the primary declares the cluster started as soon as one target has
        # joined, and a target that joins after that never learns it and stops after its startup timeout.
        command += ["-ntargets=2"]
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    wrapped = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", _WITH_SERVICE_ACCOUNT, "sh", *command]
    output = folder / "output.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen(wrapped, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                   stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    return Node(role, folder, f"http://{host}:{ports[0]}", f"http://{host}:{ports[2]}", process, output)


def pod_entrypoint() -> list[str]:
    """The image's ENTRYPOINT + CMD (``wds-transform serve``), as this Python runs it."""
    return [sys.executable, "-m", "transformer", "serve"]


def pod_base_env() -> dict[str, str]:
    """What a container gets besides its spec's env: the image's environment, not the test process's."""
    keep = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    # The pod runs the package under test, the one this process imported, even where the venv's install is of
    # another checkout (its cwd is the pod's folder, so ``-m transformer`` would find that install first).
    env["PYTHONPATH"] = str(Path(transformer.__file__).resolve().parent.parent)
    return env


def pod_runtime(kind: str | None = None) -> PodRuntime:
    """How ETL pods run: ``process`` (the default) or ``container`` (``AIS_WDS_POD_RUNTIME``; ``make test-image``)."""
    kind = kind or os.environ.get("AIS_WDS_POD_RUNTIME") or "process"
    if kind == "container":
        return ContainerRuntime.checked()
    if kind != "process":
        raise ValueError(f"AIS_WDS_POD_RUNTIME={kind!r}: use process or container")
    return ProcessRuntime(pod_entrypoint(), {"wds-transform": pod_entrypoint()[:-1]}, pod_base_env())


def _disks_root(runtimes: list[PodRuntime]) -> Path | None:
    """Container pods read objects as uid 10001 gid 0 through the mountpaths: these must then lie where group 0
    can reach them, as a node's data disks do (not under pytest's 0700 folder); AIS makes the rest 0750 root:root."""
    return None if all(runtime.kind != "container" for runtime in runtimes) else _make_disks()


def _make_disks() -> Path:
    """``/var/tmp/ais-wds-disks-<pid>-*``; those of test processes that no longer exist (killed before their
    teardown) are removed first."""
    for old in Path("/var/tmp").glob("ais-wds-disks-*-*"):
        if owner_gone(old.name.split("-")[3]):
            shutil.rmtree(old, ignore_errors=True)
    disks = Path(tempfile.mkdtemp(prefix=f"ais-wds-disks-{os.getpid()}-", dir="/var/tmp"))
    disks.chmod(0o750)
    return disks


def _abandon(nodes: list[Node], kube, disks: Path | None) -> None:
    """A start that failed half-way: kill the aisnodes started so far, stop the Kubernetes view, drop the disks."""
    for node in nodes:
        node.process.kill()
        node.process.wait()
    kube.stop()
    if disks is not None:
        shutil.rmtree(disks, ignore_errors=True)


def _ready(cluster: EtlCluster, timeout: float) -> EtlCluster:
    """The cluster once two targets have joined; stopped if they do not."""
    try:
        wait_ready(cluster.proxy, cluster.targets, cluster.root, cluster.logs, timeout)
    except BaseException:
        cluster.stop(timeout=5)
        raise
    return cluster


def start_etl_cluster(binary: Path, root: Path, timeout: float = 120.0, runtime: PodRuntime | None = None,
                      runtimes: dict[str, PodRuntime] | None = None) -> EtlCluster:
    """Start the fake Kubernetes and the three nodes under ``root``; wait until two targets have joined.

    ``runtime`` runs the ETL pods (default: ``pod_runtime()``), ``runtimes`` those of the images it names.
    The caller's thread must already be in the cluster's network namespace (``enter_network_namespace``).
    """
    root.mkdir(parents=True, exist_ok=True)
    tls = make_tls_files(root / "kube-tls")
    runtime = runtime or pod_runtime()
    disks = _disks_root([runtime, *(runtimes or {}).values()])
    kube = FakeKubernetes(root / "kube", dict(NODES), runtime, dict(runtimes or {}))
    kube.root.mkdir(parents=True)
    kube_port = kube.start(tls.server_cert, tls.server_key)
    nodes: list[Node] = []
    try:
        account = _service_account(root / "serviceaccount", tls.ca)
        (proxy_port,) = free_ports(1, NODES["node-0"])
        config = root / "cluster.json"
        config.write_text(json.dumps(cluster_config(f"http://{NODES['node-0']}:{proxy_port}"), indent=1))
        base = _node_env()

        def env(node: str, pod: str) -> dict[str, str]:
            return {**base, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube_port),
                    "MY_NODE": node, "MY_POD": pod, "K8S_NS": "default", "AIS_WDS_SA": str(account)}

        kube.add_static_pod("ais-proxy-0", "node-0", [])
        nodes.append(_start_node(binary, "proxy", "node-0", root / "proxy", config, env("node-0", "ais-proxy-0"),
                                 public_port=proxy_port))
        mountpaths = []
        for index in (1, 2):
            disk = (disks or root) / f"disk{index}"
            disk.mkdir()
            mountpaths.append(disk / "mp1")
            kube.add_static_pod(f"ais-target-{index}", f"node-{index}", [("ais-data", str(disk))])
            nodes.append(_start_node(binary, "target", f"node-{index}", root / f"target{index}", config,
                                     env(f"node-{index}", f"ais-target-{index}"), mountpath_root=disk))
        cluster = EtlCluster(root, kube, nodes[0], nodes[1:], mountpaths, kube_port, disks)
    except BaseException:
        _abandon(nodes, kube, disks)
        raise
    return _ready(cluster, timeout)


def settings(comm_type: str = "hpush", **kwargs) -> EtlSettings:
    """A small, quick ETL: uint8, one transform thread, seeded, short timeouts, logging at DEBUG."""
    kwargs["env"] = {"ETL_LOG_LEVEL": "debug", **kwargs.get("env", {})}
    kwargs.setdefault("dtype", "uint8")
    kwargs.setdefault("seed", 7)
    kwargs.setdefault("workers", 1)
    kwargs.setdefault("init_timeout", "60s")
    kwargs.setdefault("obj_timeout", "60s")
    kwargs.setdefault("preset", "imagenet-val")
    kwargs.setdefault("image", IMAGE)
    if REAL_KUBERNETES:  # a memory limit, so that the kernel's OOM killer ends the pod, not another process
        kwargs.setdefault("resources", {"requests": {"memory": "256Mi"}, "limits": {"memory": "4Gi"}})
    return EtlSettings(comm_type=comm_type, **kwargs)


@contextlib.contextmanager
def cluster_with_etl(name: str, etl: EtlSettings):
    """A benchmark's cluster: ``aisnode`` built once, a proxy and two targets in a network namespace of their own, in
    a temporary folder, with the ETL ``name`` registered from ``etl``; yields (cluster, client), and unregisters
    the ETL, stops the cluster and leaves the namespace after."""
    from transformer.client import register, unregister

    from .cluster import install_aisnode

    binary = install_aisnode(log=lambda message: print(message, file=sys.stderr))
    namespace = enter_network_namespace(list(NODES.values()))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ais-") as root, \
                start_etl_cluster(binary, Path(root) / "cluster") as cluster:
            client = cluster.client()
            register(client, name, etl)
            try:
                yield cluster, client
            finally:
                unregister(client, name)
    finally:
        namespace.leave()


def main() -> int:
    from .cluster import install_aisnode

    binary = install_aisnode(log=lambda message: print(message, file=sys.stderr))
    namespace = enter_network_namespace(list(NODES.values()))
    root = Path(tempfile.mkdtemp(prefix="ais-etl-"))
    # SIGINT (even when started in the background, where it is ignored by default) and SIGTERM stop the cluster
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.default_int_handler)
    with start_etl_cluster(binary, root) as cluster:
        print(f"AIS proxy: {cluster.url} (in a network namespace of this process, pid {os.getpid()})\n"
              f"logs: {root}/{{proxy,target1,target2}}/log, pods: {root}/kube/pods\n"
              f"ais CLI:  nsenter --net=/proc/{os.getpid()}/ns/net env AIS_ENDPOINT={cluster.url} ais ...\n"
              f"SDK:      nsenter --net=/proc/{os.getpid()}/ns/net python  ->  "
              f"aistore.sdk.Client('{cluster.url}')\nCtrl-C stops it.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    namespace.leave()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
