"""Everything the test bed's Kubernetes needs, built or fetched once into a cache.

``install_kubernetes`` returns the absolute paths (``Tools``) of:

- kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, kubelet and kubectl at
  ``K8S_VERSION``, built from ``k8s.io/kubernetes`` through the Go module proxy. ``go install
  k8s.io/kubernetes/cmd/kubelet@<version>`` is refused (that go.mod has replace directives), so a wrapper
  module requires ``k8s.io/kubernetes`` and replaces each of its staging modules (``k8s.io/api``,
  ``k8s.io/client-go``, ...) by the same module's published ``v0.<minor>.<patch>``; a ``tools.go`` (build tag
  ``tools``) imports the commands, and the version is stamped in with the ``-X`` flags of Kubernetes' own
  ``hack/lib/version.sh``;
- containerd (with ``containerd-shim-runc-v2`` and ``ctr``), etcd and docker-registry from Debian packages,
  ``apt-get download``-ed and unpacked with ``dpkg-deb -x`` into the cache: nothing is installed on the host
  and no distro service is started;
- runc and the CNI plugins from the host where installed (``runc`` on PATH, ``/usr/lib/cni``), else from
  their Debian packages the same way; iptables from the host.

The cache is ``$AIS_WDS_K8S_CACHE``, else ``~/.cache/ais-wds-transformer/k8s-<version>`` (``$XDG_CACHE_HOME``
is honoured). Each part carries a stamp file saying how it was made; a part whose stamp differs from what
would be made now is made again, under a lock, so concurrent runs make it once. ``$AIS_WDS_GO`` names the go
command (default: ``go`` on PATH, else ``/usr/local/go/bin/go``).

The smaller Go programs the cluster runs (the pod sandbox, CoreDNS, AIS's ``aisinit``) are ``gobuilds.py``'s;
they share this module's cache, lock and stamps.

``python -m testbed.k8s.build`` makes everything and prints each path and each binary's version
(``make k8s-tools``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from ..cluster import GO_ENV, build_cache, find_go

K8S_MODULE = "k8s.io/kubernetes"
K8S_VERSION = "v1.34.4"
STAGING_VERSION = "v0." + K8S_VERSION.split(".", 1)[1]  # k8s.io/api etc. are published as v0.<minor>.<patch>
GO_MIN = "1.24"  # k8s.io/kubernetes v1.34.4's go.mod
CACHE_ENV = "AIS_WDS_K8S_CACHE"

# Tools field -> the command under k8s.io/kubernetes/cmd/ (also the binary's name).
COMMANDS = {
    "apiserver": "kube-apiserver",
    "controller_manager": "kube-controller-manager",
    "scheduler": "kube-scheduler",
    "proxy": "kube-proxy",
    "kubelet": "kubelet",
    "kubectl": "kubectl",
}
# Staging modules the module proxy refuses (403); no command needs them.
UNSERVED_STAGING = frozenset({"k8s.io/sample-cli-plugin", "k8s.io/sample-controller"})

# Debian 12 packages, at the versions the fixture was tried with.
DEBS = {
    "containerd": "1.6.20~ds1-1+deb12u3",
    "etcd-server": "3.4.23-4+b4",
    "etcd-client": "3.4.23-4+b4",
    "docker-registry": "2.8.2+ds1-1",
}
RUNC_DEB = ("runc", "1.1.5+ds1-1+deb12u1")
CNI_DEB = ("containernetworking-plugins", "1.1.1+ds1-3+b5")
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
HOST_CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))

Log = Callable[[str], None]


class KubernetesUnavailable(RuntimeError):
    """A part of the Kubernetes node could not be built or fetched; the message says why and what to do."""


@dataclass(frozen=True)
class Tools:
    """Absolute paths of everything a node of the Kubernetes runs, and the Kubernetes version."""

    apiserver: Path
    controller_manager: Path
    scheduler: Path
    proxy: Path
    kubelet: Path
    kubectl: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    etcd: Path
    etcdctl: Path
    registry: Path
    runc: Path
    cni_bin_dir: Path
    iptables: Path
    version: str = K8S_VERSION

    def paths(self) -> dict[str, Path]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "version"}


def cache_dir() -> Path:
    return build_cache(CACHE_ENV, f"k8s-{K8S_VERSION}")


def how_to_get_go(cache: Path) -> str:
    return (
        f"The real-Kubernetes tests build Kubernetes {K8S_VERSION} ({K8S_MODULE}) from source, which needs "
        f"Go >= {GO_MIN}: no usable 'go' on PATH (nor /usr/local/go/bin/go, nor ${GO_ENV}). Install it from "
        "https://go.dev/dl (Linux: tar -C /usr/local -xzf go1.<n>.linux-amd64.tar.gz && "
        "export PATH=$PATH:/usr/local/go/bin), make sure the Go module proxy (https://proxy.golang.org, or "
        f"$GOPROXY) is reachable, and run again: the build takes a few minutes once, then is reused from {cache} "
        f"(or point ${CACHE_ENV} at a folder holding a finished build)."
    )


# --- the Kubernetes binaries ------------------------------------------------------------------------------


def staging_replaces(go_mod: str) -> list[str]:
    """The staging modules ``k8s.io/kubernetes``'s go.mod replaces by ``./staging/...``, less the unserved ones."""
    found = re.findall(r"^\s*(?:replace\s+)?(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", go_mod, flags=re.MULTILINE)
    return sorted(set(found) - UNSERVED_STAGING)


def go_mod_text(staging: Iterable[str]) -> str:
    """The wrapper module's go.mod: ``k8s.io/kubernetes`` required, each staging module at its published version."""
    lines = ["module ais-wds-transformer/k8s-tools", "", f"go {GO_MIN}.0", ""]
    lines += [f"require {K8S_MODULE} {K8S_VERSION}", "", "replace ("]
    lines.extend(f"\t{module} => {module} {STAGING_VERSION}" for module in sorted(staging))
    lines.append(")")
    return "\n".join(lines) + "\n"


def tools_go_text() -> str:
    """A ``tools.go`` that keeps every command's package in the wrapper module's requirements."""
    imports = "".join(f'\t_ "{K8S_MODULE}/cmd/{name}"\n' for name in sorted(COMMANDS.values()))
    return f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n"


def ldflags() -> str:
    """``-s -w`` and the version variables Kubernetes' ``hack/lib/version.sh`` sets (kubectl reads client-go's)."""
    major, minor = K8S_VERSION.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        for key, value in (("gitVersion", K8S_VERSION), ("gitMajor", major), ("gitMinor", minor)):
            flags.append(f"-X {package}.{key}={value}")
    return " ".join(flags)


def kubernetes_stamp() -> str:
    return f"{K8S_MODULE}@{K8S_VERSION} {','.join(sorted(COMMANDS.values()))} CGO_ENABLED=0 -ldflags={ldflags()}\n"


def _build_kubernetes(go: str, cache: Path, deadline: float, log: Log) -> None:
    bin_dir, work = cache / "bin", cache / "build" / "kubernetes"
    bin_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (bin_dir / "kubernetes.build").unlink(missing_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0"}
    log(f"reading {K8S_MODULE}@{K8S_VERSION}'s staging modules from the Go module proxy")
    download = run([go, "mod", "download", "-json", f"{K8S_MODULE}@{K8S_VERSION}"], env, cache, deadline)
    go_mod = Path(json.loads(download.stdout)["GoMod"]).read_text()
    staging = staging_replaces(go_mod)
    if not staging:
        raise KubernetesUnavailable(f"{K8S_MODULE}@{K8S_VERSION}'s go.mod names no staging module to replace")
    (work / "go.mod").write_text(go_mod_text(staging))
    (work / "tools.go").write_text(tools_go_text())
    started = time.monotonic()
    log(f"go mod tidy in {work} ({len(staging)} staging modules at {STAGING_VERSION}; ~740 MB of modules once)")
    run([go, "mod", "tidy"], env, work, deadline)
    log(f"building {', '.join(COMMANDS.values())} into {bin_dir}; the first time takes minutes")
    packages = [f"{K8S_MODULE}/cmd/{name}" for name in COMMANDS.values()]
    run([go, "build", "-trimpath", f"-ldflags={ldflags()}", "-o", f"{bin_dir}/", *packages], env, work, deadline)
    (bin_dir / "kubernetes.build").write_text(kubernetes_stamp())
    log(f"Kubernetes {K8S_VERSION} built in {time.monotonic() - started:.0f} s")


def require_go(cache: Path) -> str:
    go = find_go()
    if go is None:
        raise KubernetesUnavailable(how_to_get_go(cache))
    try:
        found = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    numbers = re.match(r"go(\d+)\.(\d+)", found)
    if numbers is None or tuple(map(int, numbers.groups())) < tuple(map(int, GO_MIN.split("."))):
        raise KubernetesUnavailable(f"{go} is Go '{found or 'unknown'}'. " + how_to_get_go(cache))
    return go


# --- the Debian packages ----------------------------------------------------------------------------------


def host_runc() -> Path | None:
    found = shutil.which("runc") or ("/usr/sbin/runc" if os.access("/usr/sbin/runc", os.X_OK) else None)
    return Path(found) if found else None


def host_cni_dir() -> Path | None:
    for folder in HOST_CNI_DIRS:
        if all(os.access(folder / plugin, os.X_OK) for plugin in CNI_PLUGINS):
            return folder
    return None


def deb_packages() -> dict[str, str]:
    """The Debian packages to unpack here: ``DEBS``, and runc and the CNI plugins where the host lacks them."""
    packages = dict(DEBS)
    if host_runc() is None:
        packages[RUNC_DEB[0]] = RUNC_DEB[1]
    if host_cni_dir() is None:
        packages[CNI_DEB[0]] = CNI_DEB[1]
    return packages


def debs_stamp(packages: dict[str, str]) -> str:
    return "".join(f"{name}={version}\n" for name, version in sorted(packages.items()))


def _debian_tools() -> tuple[str, str] | None:
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
    return (apt, dpkg) if apt and dpkg else None


def _fetch_debs(cache: Path, packages: dict[str, str], deadline: float, log: Log) -> None:
    debian = _debian_tools()
    wanted = " ".join(f"{name}={version}" for name, version in sorted(packages.items()))
    if debian is None:
        raise KubernetesUnavailable(
            f"The real-Kubernetes tests take containerd, etcd and the registry from Debian 12 packages ({wanted}), "
            "fetched with apt-get download and unpacked with dpkg-deb -x, but apt-get or dpkg-deb is missing: run "
            f"them on Debian 12 (bookworm), or unpack those packages into {cache / 'debs' / 'root'} and write "
            f"{cache / 'debs' / 'root.stamp'} with one 'name=version' line each, sorted."
        )
    apt, dpkg = debian
    folder, root, stamp = cache / "debs", cache / "debs" / "root", cache / "debs" / "root.stamp"
    folder.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    files = {}
    for name, version in sorted(packages.items()):
        deb = folder / f"{name}_{version.replace(':', '%3a')}_{_arch(dpkg)}.deb"
        if not deb.is_file():
            log(f"apt-get download {name}={version} into {folder}")
            _apt_download(apt, f"{name}={version}", folder, deadline)
        if not deb.is_file():
            raise KubernetesUnavailable(f"apt-get download {name}={version} left no {deb.name} in {folder}")
        files[name] = deb
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    for deb in files.values():
        log(f"dpkg-deb -x {deb.name} {root}")
        run([dpkg, "-x", str(deb), str(root)], dict(os.environ), folder, deadline)
    stamp.write_text(debs_stamp(packages))


def _apt_download(apt: str, package: str, folder: Path, deadline: float) -> None:
    command = [apt, "download", "-qq", package]
    try:
        run(command, dict(os.environ), folder, deadline)
    except KubernetesUnavailable as first:
        # Package lists older than the archive name files it no longer has; refreshing them installs nothing.
        try:
            run([apt, "update", "-qq"], dict(os.environ), folder, deadline)
            run(command, dict(os.environ), folder, deadline)
        except KubernetesUnavailable as second:
            raise KubernetesUnavailable(
                f"{first}\nthen, after apt-get update: {second}\nThe fixture was tried with Debian 12's {package}; "
                "another release's package may need a change of build.py's versions."
            ) from None


def _arch(dpkg: str) -> str:
    dpkg_bin = Path(dpkg).with_name("dpkg")
    if dpkg_bin.is_file():
        result = subprocess.run([str(dpkg_bin), "--print-architecture"], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    return "amd64"


# --- all of it --------------------------------------------------------------------------------------------


def current(path: Path, stamp: Path, expected: str) -> bool:
    """Whether ``path`` exists and ``stamp`` says it was made the way it would be made now."""
    return path.exists() and stamp.is_file() and stamp.read_text() == expected


def _kubernetes_current(cache: Path) -> bool:
    bin_dir = cache / "bin"
    return current(bin_dir, bin_dir / "kubernetes.build", kubernetes_stamp()) and all(
        (bin_dir / name).is_file() for name in COMMANDS.values()
    )


def _debs_current(cache: Path) -> bool:
    return current(cache / "debs" / "root", cache / "debs" / "root.stamp", debs_stamp(deb_packages()))


def host_iptables() -> Path | None:
    """The host's iptables (kube-proxy's rules are the host's, so it cannot come from the cache), or None."""
    found = shutil.which("iptables") or ("/usr/sbin/iptables" if os.access("/usr/sbin/iptables", os.X_OK) else None)
    return Path(found) if found else None


def _iptables() -> Path:
    found = host_iptables()
    if found is None:
        raise KubernetesUnavailable(
            "kube-proxy needs iptables, which is not on PATH (nor /usr/sbin/iptables): apt-get install iptables"
            " (make test-k8s installs it when missing)"
        )
    return found


def _tools(cache: Path) -> Tools:
    bin_dir, root = cache / "bin", cache / "debs" / "root"
    tools = Tools(
        **{field: bin_dir / name for field, name in COMMANDS.items()},
        containerd=root / "usr/bin/containerd",
        containerd_shim=root / "usr/bin/containerd-shim-runc-v2",
        ctr=root / "usr/bin/ctr",
        etcd=root / "usr/bin/etcd",
        etcdctl=root / "usr/bin/etcdctl",
        registry=root / "usr/bin/docker-registry",
        runc=host_runc() or root / "usr/sbin/runc",
        cni_bin_dir=host_cni_dir() or root / "usr/lib/cni",
        iptables=_iptables(),
    )
    missing = [f"{name} ({path})" for name, path in tools.paths().items() if not path.exists()]
    missing += [f"CNI plugin {p}" for p in CNI_PLUGINS if not (tools.cni_bin_dir / p).is_file()]
    if missing:
        raise KubernetesUnavailable(f"missing after the build in {cache}: {', '.join(missing)}")
    return Tools(**{name: path.absolute() for name, path in tools.paths().items()})


def cached_tools() -> Tools | None:
    """The tools, if every part is already in the cache as it would be made now; else None."""
    cache = cache_dir()
    if _kubernetes_current(cache) and _debs_current(cache):
        return _tools(cache)
    return None


def install_kubernetes(timeout: float = 1800.0, log: Log | None = None) -> Tools:
    """The tools of the Kubernetes, each part built or fetched first where needed (see the module)."""
    say = log or (lambda message: None)
    _iptables()  # before minutes of building
    ready = cached_tools()
    if ready is not None:
        return ready
    cache = cache_dir()
    deadline = time.monotonic() + timeout
    cache.mkdir(parents=True, exist_ok=True)
    with locked(cache):
        if not _kubernetes_current(cache):
            _build_kubernetes(require_go(cache), cache, deadline, say)
        if not _debs_current(cache):
            _fetch_debs(cache, deb_packages(), deadline, say)
        return _tools(cache)


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    """An exclusive lock on the cache, so that concurrent runs make each part once."""
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(command: list[str], env: dict[str, str], cwd: Path, deadline: float) -> subprocess.CompletedProcess:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KubernetesUnavailable(f"no time left to run {' '.join(command)}")
    try:
        result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        raise KubernetesUnavailable(f"{' '.join(command)} (in {cwd}) did not finish within {left:.0f} s") from None
    if result.returncode != 0:
        raise KubernetesUnavailable(
            f"{' '.join(command)} (in {cwd}) failed (exit {result.returncode}):\n{result.stderr[-4000:]}"
        )
    return result


VERSION_COMMANDS = {
    "apiserver": ["--version"],
    "controller_manager": ["--version"],
    "scheduler": ["--version"],
    "proxy": ["--version"],
    "kubelet": ["--version"],
    "kubectl": ["version", "--client"],
    "etcd": ["--version"],
    "containerd": ["--version"],
    "registry": ["--version"],
    "runc": ["--version"],
    "iptables": ["--version"],
}


def main() -> int:
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"k8s: [{time.monotonic() - started:5.0f} s] {message}", flush=True)

    from .gobuilds import go_programs

    try:
        tools = install_kubernetes(log=say)
        programs = go_programs(log=say)
    except KubernetesUnavailable as exc:
        print(f"k8s: {exc}", file=sys.stderr)
        return 1
    say(f"ready in {cache_dir()}")
    for name, path in {**tools.paths(), **programs}.items():
        print(f"{name:20} {path}")
    for name, args in VERSION_COMMANDS.items():
        result = subprocess.run([str(getattr(tools, name)), *args], capture_output=True, text=True, timeout=60)
        text = (result.stdout or result.stderr).strip().replace("\n", "; ")
        print(f"{name:20} {text}" + (f" (exit {result.returncode})" if result.returncode else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
