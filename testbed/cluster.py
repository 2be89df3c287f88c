"""A real AIStore on loopback: ``aisnode`` built once into a cache, one proxy and one target per run.

``install_aisnode`` builds ``github.com/NVIDIA/aistore/cmd/aisnode`` at ``AISNODE_VERSION`` (AIS 5.0)
with the build tags ``dsort`` (dSort is left out of a plain build) and ``etl`` (so that ETL requests
reach the code that checks for Kubernetes, as in AIS's ``-etl`` images) into a cache folder reused
across runs: ``$AIS_WDS_AISNODE_CACHE``, else ``~/.cache/ais-wds-transformer/aisnode-<version>``
(``$XDG_CACHE_HOME`` is honoured). ``$AIS_WDS_AISNODE`` names a binary to use instead (no build);
``$AIS_WDS_GO`` the go command (default: ``go`` on PATH, else ``/usr/local/go/bin/go``).

``start_cluster`` writes the cluster config (the sections of AIS's ``deploy/dev/local`` playground)
and one local config per node, starts ``aisnode -role=proxy -ntargets=1 -skip_startup`` and ``aisnode -role=target``
on 127.0.0.1 with free ports, and one mountpath under the run's folder (AIS's testing layout,
``test_fspaths``: ``<root>/mp1``), then waits, bounded, until the primary reports itself ready and
the target has joined. ``LocalCluster.stop`` ends exactly the two processes it started (SIGTERM,
then SIGKILL); they also get SIGKILL from the kernel if the process that started them dies.

``python -m testbed.cluster`` starts one and keeps it up until Ctrl-C, for trying the client by hand;
``--build-only`` builds (or finds) aisnode and prints its path (``make aisnode``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .ports import free_ports

AISNODE_MODULE = "github.com/NVIDIA/aistore"
AISNODE_PACKAGE = f"{AISNODE_MODULE}/cmd/aisnode"
AISNODE_VERSION = "v1.5.0"  # AIS 5.0
BUILD_TAGS = ("dsort", "etl")
CACHE_ENV = "AIS_WDS_AISNODE_CACHE"
BINARY_ENV = "AIS_WDS_AISNODE"
GO_ENV = "AIS_WDS_GO"  # the go command to build with (default: go on PATH, else /usr/local/go/bin/go)
GO_MIN = "1.26"  # aistore v1.5.0's go.mod



def how_to_get_go(cache: Path) -> str:
    return (
        f"The 'ais' tests run a real AIStore ({AISNODE_PACKAGE}@{AISNODE_VERSION}) built from source, which "
        f"needs Go >= {GO_MIN}: no 'go' on PATH (nor /usr/local/go/bin/go, nor ${GO_ENV}). "
        "Install it from https://go.dev/dl "
        "(Linux: tar -C /usr/local -xzf go1.26.<n>.linux-amd64.tar.gz && export PATH=$PATH:/usr/local/go/bin), "
        "make sure the Go module proxy (https://proxy.golang.org, or $GOPROXY) is reachable, and run the tests "
        f"again: the build takes a few minutes once, then is reused from {cache}. Or point {BINARY_ENV} at an "
        f"aisnode built with -tags '{' '.join(BUILD_TAGS)}'. To leave these tests out: pytest -m 'not ais'."
    )


class AisnodeUnavailable(RuntimeError):
    """aisnode could not be built or started; the message says why and what to do."""


def build_cache(env: str, leaf: str) -> Path:
    """Where a build is kept: ``$env`` if set, else ``leaf`` under the user's cache folder."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ais-wds-transformer" / leaf


def cache_dir() -> Path:
    return build_cache(CACHE_ENV, f"aisnode-{AISNODE_VERSION}")


def find_go() -> str | None:
    given = os.environ.get(GO_ENV)
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    found = shutil.which("go")
    if found:
        return found
    fallback = Path("/usr/local/go/bin/go")
    return str(fallback) if fallback.is_file() and os.access(fallback, os.X_OK) else None


def _stamp() -> str:
    return f"{AISNODE_PACKAGE}@{AISNODE_VERSION} -tags={','.join(BUILD_TAGS)}\n"


def cached_binary() -> Path | None:
    """The aisnode to run, if one is already there (``$AIS_WDS_AISNODE`` or a finished cached build)."""
    given = os.environ.get(BINARY_ENV)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise AisnodeUnavailable(f"{BINARY_ENV}={given} is not an executable file")
        return path
    binary = cache_dir() / "bin" / "aisnode"
    stamp = cache_dir() / "bin" / "aisnode.build"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == _stamp():
        return binary
    return None


def install_aisnode(timeout: float = 1800.0, log=None) -> Path:
    """The cached aisnode, built first if needed (under a lock, so concurrent runs build it once)."""
    ready = cached_binary()
    if ready is not None:
        return ready
    cache = cache_dir()
    go = find_go()
    if go is None:
        raise AisnodeUnavailable(how_to_get_go(cache))
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be building it right now
        ready = cached_binary()
        if ready is not None:
            return ready
        _build(go, cache, timeout, log or (lambda message: None))
        (cache / "bin" / "aisnode.build").write_text(_stamp())
    return cache / "bin" / "aisnode"


def _build(go: str, cache: Path, timeout: float, log) -> None:
    bin_dir = cache / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {**os.environ, "GOBIN": str(bin_dir)}
    tags = ",".join(BUILD_TAGS)
    started = time.monotonic()
    log(f"building {AISNODE_PACKAGE}@{AISNODE_VERSION} (-tags {tags}) into {bin_dir}; the first time takes minutes")
    install = [go, "install", f"-tags={tags}", f"{AISNODE_PACKAGE}@{AISNODE_VERSION}"]
    first = _run(install, env, cache, timeout)
    if first.returncode == 0:
        log(f"aisnode built in {time.monotonic() - started:.0f} s")
        return
    # `go install pkg@version` also asks the proxy for the module's version list (to report a deprecation).
    # A proxy that serves the pinned version but not that list (some mirrors, some firewalls) fails it,
    # although the build itself needs nothing more: then build the same package, same version, same
    # dependency versions (aistore's go.mod, no replace directives), from a throwaway module.
    if "@v/list" not in first.stderr and "loading deprecation" not in first.stderr:
        raise AisnodeUnavailable(f"{' '.join(install)} failed (exit {first.returncode}):\n{first.stderr[-4000:]}")
    log("go install could not list the module's versions; building the pinned version from a throwaway module")
    work = cache / "build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    steps = [
        [go, "mod", "init", "aisnode-build"],
        [go, "get", f"{AISNODE_PACKAGE}@{AISNODE_VERSION}"],
        [go, "build", f"-tags={tags}", "-o", str(bin_dir / "aisnode"), AISNODE_PACKAGE],
    ]
    for step in steps:
        result = _run(step, env, work, timeout - (time.monotonic() - started))
        if result.returncode != 0:
            raise AisnodeUnavailable(
                f"{' '.join(install)} failed:\n{first.stderr[-1500:]}\nthen {' '.join(step)} (in {work}) failed "
                f"(exit {result.returncode}):\n{result.stderr[-3000:]}"
            )
    shutil.rmtree(work, ignore_errors=True)
    log(f"aisnode built in {time.monotonic() - started:.0f} s")


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        raise AisnodeUnavailable(f"{' '.join(command)} did not finish within {timeout:.0f} s") from None


# --- the cluster ------------------------------------------------------------------------------------------


def cluster_config(primary_url: str) -> dict:
    """The cluster (global) config: the sections AIS's local playground writes, for one loopback node pair."""
    return {
        "backend": {},
        "timeout": {"cplane_operation": "2s", "max_keepalive": "5s", "cold_get_conflict": "5s",
                    "max_host_busy": "20s", "startup_time": "30s", "join_startup_time": "1m",
                    "send_file_time": "5m", "ec_streams_time": "10m", "object_md": "2h"},
        "proxy": {"primary_url": primary_url, "original_url": primary_url, "discovery_url": "",
                  "non_electable": False},
        # The tests' objects take a few MB of a disk that others fill: AIS's defaults (cleanup from 65% used, refuse
        # writes from 90%) would make them depend on the host's disk (a target above its low watermark also
        # spends its CPU looking for space to free).
        "space": {"cleanupwm": 97, "lowwm": 98, "highwm": 99, "out_of_space": 100, "batch_size": 32768,
                  "dont_cleanup_time": "120m"},
        "resilver": {"enabled": True},
        "memsys": {"min_free": "512mb", "default_buf": "32kb", "to_gc": "1gb", "hk_time": "3m",
                   "min_pct_total": 0, "min_pct_free": 0},
        "versioning": {"enabled": True, "validate_warm_get": False},
        "net": {
            "l4": {"proto": "tcp", "sndrcv_buf_size": 131072},
            "http": {"use_https": False, "server_crt": "server.crt", "server_key": "server.key", "domain_tls": "",
                     "client_ca_tls": "", "client_auth_tls": 0, "idle_conn_time": "6s", "idle_conns_per_host": 32,
                     "idle_conns": 256, "write_buffer_size": 65536, "read_buffer_size": 65536,
                     "chunked_transfer": True, "skip_verify": False},
            "use_ipv6": False,
        },
        "auth": {},
        "distributed_sort": {"duplicated_records": "ignore", "missing_shards": "ignore",
                             "ekm_malformed_line": "abort", "ekm_missing_key": "abort",
                             "default_max_mem_usage": "80%", "call_timeout": "10m",
                             "dsorter_mem_threshold": "100GB", "compression": "never", "bundle_multiplier": 4},
    }


def local_config(folder: Path, ports: tuple[int, int, int], mountpath_root: Path | None) -> dict:
    """One node's local config; a target gets one mountpath, ``<mountpath_root>/mp1``."""
    public, control, data = ports
    return {
        "confdir": str(folder / "conf"),
        "log_dir": str(folder / "log"),
        "host_net": {"hostname": "127.0.0.1", "hostname_intra_control": "", "hostname_intra_data": "",
                     "port": str(public), "port_intra_control": str(control), "port_intra_data": str(data)},
        "fspaths": {},
        "test_fspaths": {"root": str(mountpath_root or ""), "count": 1 if mountpath_root else 0, "instance": 0},
    }


def owner_gone(pid: str) -> bool:
    """Whether ``pid``, the test process named in a leftover's name or label, is a number and no process now:
    what a run killed before its teardown left is removed by the next run."""
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Node:
    role: str
    folder: Path
    url: str  # public
    data_url: str  # intra-data
    process: subprocess.Popen
    output: Path

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for path in (self.output, self.folder / "log" / f"ais{self.role}.INFO"):
            if path.is_file():
                parts.append(f"--- {path}:\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def stop_nodes(groups: list[list[Node]], timeout: float) -> list[str]:
    """SIGTERM each group of nodes in turn and wait up to ``timeout`` for it; SIGKILL whatever is left of it.
    Returns one line for each node that had to be killed."""
    forced = []
    for group in groups:
        for node in group:
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in group:
            try:
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                forced.append(f"aisnode {node.role} ({node.url}) still ran {timeout:.0f} s after SIGTERM: killed")
                node.process.kill()
                node.process.wait(timeout=10)
    return forced


@dataclass
class LocalCluster:
    """One proxy and one target on 127.0.0.1; objects live under ``mountpath``."""

    root: Path
    proxy: Node
    target: Node
    mountpath: Path
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return self.proxy.url

    def client(self, **kwargs):
        from aistore.sdk import Client

        kwargs.setdefault("timeout", (5, 120))
        return Client(self.url, **kwargs)

    def fqn(self, bucket: str, name: str, provider: str = "ais", namespace: str = "") -> Path:
        """Where the target keeps an object: ``<mountpath>/@<provider>/[#<ns>/]<bucket>/%ob/<name>``."""
        ns = f"#{namespace}/" if namespace else ""
        return self.mountpath / f"@{provider}" / f"{ns}{bucket}" / "%ob" / name

    def processes(self) -> list[subprocess.Popen]:
        return [self.target.process, self.proxy.process]

    def logs(self) -> str:
        return self.proxy.log_tail() + "\n" + self.target.log_tail()

    def stop(self, timeout: float = 20.0) -> list[str]:
        """SIGTERM the target, then the proxy; SIGKILL what is still running after ``timeout``.

        Returns what had to be forced (empty when both nodes exited on SIGTERM in time), so that a hung
        shutdown fails the fixture instead of being hidden by the kill.
        """
        if self._stopped:
            return []
        self._stopped = True
        return stop_nodes([[self.target, self.proxy]], timeout)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _node_env() -> dict[str, str]:
    """The environment of the nodes: nothing that would make them believe they run in Kubernetes, or join
    another cluster (``AIS_*``, ``KUBERNETES_*``, ``MY_NODE``/``MY_POD``)."""
    drop = ("AIS_", "KUBERNETES_")
    return {k: v for k, v in os.environ.items()
            if not k.startswith(drop) and k not in ("MY_NODE", "MY_POD", "K8S_NS")}


def _start_node(binary: Path, role: str, folder: Path, config: Path, ports: tuple[int, int, int],
                mountpath_root: Path | None) -> Node:
    folder.mkdir(parents=True)
    (folder / "conf").mkdir()
    (folder / "log").mkdir()
    local = folder / "local.json"
    local.write_text(json.dumps(local_config(folder, ports, mountpath_root), indent=1))
    command = [str(binary), f"-config={config}", f"-local_config={local}", f"-role={role}"]
    if role == "proxy":
        # -skip_startup: the primary does not sit out its quiet period (startup_time / 20 x 4, at least 6 s)
        # before serving; the readiness wait below still waits for the target to have joined.
        command += ["-ntargets=1", "-skip_startup"]
    output = folder / "output.log"
    with open(output, "wb") as sink:
        process = subprocess.Popen(command, cwd=folder, env=_node_env(), stdin=subprocess.DEVNULL, stdout=sink,
                                   stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    return Node(role, folder, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}", process, output)


def start_cluster(binary: Path, root: Path, timeout: float = 90.0) -> LocalCluster:
    """Start a proxy and a target under ``root`` (a fresh folder) and wait until the cluster is ready."""
    root.mkdir(parents=True, exist_ok=True)
    ports = free_ports(6)
    primary = f"http://127.0.0.1:{ports[0]}"
    config = root / "cluster.json"
    config.write_text(json.dumps(cluster_config(primary), indent=1))
    mountpath_root = root / "disk"
    mountpath_root.mkdir()
    proxy = _start_node(binary, "proxy", root / "proxy", config, tuple(ports[:3]), None)
    try:
        target = _start_node(binary, "target", root / "target", config, tuple(ports[3:]), mountpath_root)
    except BaseException:
        proxy.process.kill()
        proxy.process.wait()
        raise
    cluster = LocalCluster(root, proxy, target, mountpath_root / "mp1")
    try:
        _wait_ready(cluster, timeout)
    except BaseException:
        cluster.stop(timeout=5)
        raise
    return cluster


def _wait_ready(cluster: LocalCluster, timeout: float) -> None:
    wait_ready(cluster.proxy, [cluster.target], cluster.root, cluster.logs, timeout)


def wait_ready(proxy: Node, targets: list[Node], root: Path, logs, timeout: float) -> None:
    """The primary answers ``/v1/health?prr=true`` (ready, rebalance state settled) with ``targets`` joined,
    and each target answers its health; an aisnode that exits meanwhile is an error with ``logs()``."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            for node in (proxy, *targets):
                if node.process.poll() is not None:
                    raise AisnodeUnavailable(f"aisnode {node.role} ({node.url}) exited with {node.process.returncode} "
                                             f"while starting:\n{logs()}")
            try:
                health = http.get(f"{proxy.url}/v1/health", params={"prr": "true"})
                if health.status_code == 200:
                    smap = http.get(f"{proxy.url}/v1/daemon", params={"what": "smap"}).json()
                    joined = len(smap.get("tmap") or {})
                    if joined == len(targets) and all(http.get(f"{t.url}/v1/health").is_success for t in targets):
                        return
                    last = f"targets in the cluster map: {joined}"
                else:
                    last = f"primary health: {health.status_code} {health.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{exc.__class__.__name__}: {exc}"
            time.sleep(0.2)
    raise AisnodeUnavailable(f"the AIS cluster in {root} was not ready within {timeout:.0f} s ({last}):\n{logs()}")


def main() -> int:
    binary = install_aisnode(log=lambda message: print(message, file=sys.stderr))
    if "--build-only" in sys.argv[1:]:
        print(binary)
        return 0
    root = Path(tempfile.mkdtemp(prefix="ais-loopback-"))
    with start_cluster(binary, root) as cluster:
        print(f"AIS proxy: {cluster.url}\nmountpath: {cluster.mountpath}\nlogs: {root}/{{proxy,target}}/log\n"
              "Ctrl-C stops it.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
