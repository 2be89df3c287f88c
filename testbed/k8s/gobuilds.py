"""The small Go programs the cluster runs besides Kubernetes, each built once into the cache's ``bin/``.

- ``pause``: the process of a pod sandbox, a static binary that sleeps until SIGTERM or SIGINT and exits 0. It
  runs as pid 1 of its container, where no signal has a default action, so it handles them itself.
- ``coredns``: the cluster DNS, ``github.com/coredns/coredns`` at the version Kubernetes ``K8S_VERSION`` ships
  (kubeadm's), through the Go module proxy. Built as CoreDNS documents a build with a chosen set of plugins: a
  wrapper ``main`` that sets the server's directives and imports their plugins, here the ones a Kubernetes
  cluster's Corefile uses (``forward`` aside: nothing outside may be asked).
- ``aisinit``: AIS's init container (``github.com/NVIDIA/aistore/cmd/aisinit``, the AIS version the project
  runs): it writes an aisnode's local and cluster config from the operator's templates and the pod's
  environment, in the pod.

Each binary is static (``CGO_ENABLED=0``) and carries a stamp saying how it was made; a stale one is made again.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..cluster import AISNODE_MODULE, AISNODE_VERSION
from .build import GO_MIN, cache_dir, current, locked, require_go, run

COREDNS_MODULE = "github.com/coredns/coredns"
COREDNS_VERSION = "v1.12.1"  # what kubeadm v1.34 deploys
# The directives of a Kubernetes cluster's Corefile, in CoreDNS's own order (core/dnsserver/zdirectives.go), and
# the package of each (the "prometheus" directive is plugin/metrics).
COREDNS_PLUGINS = {"reload": "reload", "ready": "ready", "health": "health", "prometheus": "metrics",
                   "errors": "errors", "loadbalance": "loadbalance", "cache": "cache",
                   "kubernetes": "kubernetes", "loop": "loop"}
AISINIT_PACKAGE = f"{AISNODE_MODULE}/cmd/aisinit"

PAUSE_SOURCE = """\
// The process of a pod sandbox: pid 1 of its container, where no signal has a default action.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
"""

Log = Callable[[str], None]
STATIC = "CGO_ENABLED=0 -trimpath -ldflags=-s -w"


def coredns_main() -> str:
    imports = "".join(f'\t_ "{COREDNS_MODULE}/plugin/{package}"\n' for package in COREDNS_PLUGINS.values())
    directives = "".join(f'\t"{name}",\n' for name in COREDNS_PLUGINS)
    return (f"// CoreDNS with the plugins of a Kubernetes cluster's Corefile.\npackage main\n\nimport (\n"
            f'\t"{COREDNS_MODULE}/core/dnsserver"\n\t"{COREDNS_MODULE}/coremain"\n\n{imports})\n\n'
            f"var directives = []string{{\n{directives}}}\n\n"
            "func init() {\n\tdnsserver.Directives = directives\n}\n\nfunc main() {\n\tcoremain.Run()\n}\n")


def stamps() -> dict[str, str]:
    """Program -> how it is made now (a cached binary with another stamp is made again)."""
    return {
        "pause": f"sha256={hashlib.sha256(PAUSE_SOURCE.encode()).hexdigest()} {STATIC}\n",
        "coredns": f"{COREDNS_MODULE}@{COREDNS_VERSION} sha256={hashlib.sha256(coredns_main().encode()).hexdigest()} "
                   f"{STATIC}\n",
        "aisinit": f"{AISINIT_PACKAGE}@{AISNODE_VERSION} {STATIC}\n",
    }


def _sources(name: str, work: Path) -> list[list[str]]:
    """Write the wrapper module of ``name`` into ``work``; returns the go commands that finish and build it."""
    if name == "pause":
        (work / "go.mod").write_text(f"module ais-wds-transformer/pause\n\ngo {GO_MIN}.0\n")
        (work / "main.go").write_text(PAUSE_SOURCE)
        return [["build"]]
    if name == "coredns":
        (work / "go.mod").write_text(f"module ais-wds-transformer/coredns\n\ngo {GO_MIN}.0\n\n"
                                     f"require {COREDNS_MODULE} {COREDNS_VERSION}\n")
        (work / "main.go").write_text(coredns_main())
        return [["mod", "tidy"], ["build"]]
    (work / "go.mod").write_text(f"module ais-wds-transformer/aisinit\n\ngo {GO_MIN}.0\n")
    (work / "tools.go").write_text(f'//go:build tools\n\npackage tools\n\nimport _ "{AISINIT_PACKAGE}"\n')
    return [["get", f"{AISNODE_MODULE}@{AISNODE_VERSION}"], ["mod", "tidy"], ["build", AISINIT_PACKAGE]]


def go_program(name: str, timeout: float = 1800.0, log: Log | None = None) -> Path:
    """``<cache>/bin/<name>``, built first where it is missing or stale."""
    cache = cache_dir()
    binary, stamp, expected = cache / "bin" / name, cache / "bin" / f"{name}.build", stamps()[name]
    if current(binary, stamp, expected):
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    with locked(cache):
        if current(binary, stamp, expected):
            return binary
        go = require_go(cache)
        work = cache / "build" / name
        work.mkdir(parents=True, exist_ok=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        stamp.unlink(missing_ok=True)
        steps = _sources(name, work)
        started = time.monotonic()
        (log or (lambda message: None))(f"building {binary}")
        env = {**os.environ, "CGO_ENABLED": "0"}
        deadline = time.monotonic() + timeout
        for step in steps:
            command = [go, *step]
            if step[0] == "build":
                command = [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), *step[1:]]
            run(command, env, work, deadline)
        stamp.write_text(expected)
        (log or (lambda message: None))(f"{name} built in {time.monotonic() - started:.0f} s")
    return binary


def go_programs(log: Log | None = None) -> dict[str, Path]:
    return {name: go_program(name, log=log) for name in stamps()}
