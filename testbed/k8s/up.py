"""The cluster users run, on one machine: two Kubernetes nodes, AIS's proxy and targets as pods, the pod image
in the registry and unpacked on both nodes (``make cluster``, ``python -m testbed.k8s.up``).

``start_ais_cluster`` builds or finds everything (Kubernetes, CoreDNS, aisinit, aisnode and its image), starts
the cluster (``cluster.py``), pushes the aisnode image and the project's image (``make image``) into the
cluster's registry, has each node pull the project's image once, and starts AIS (``ais.py``). The calling
thread is left in the cluster's machine room, from where every address of the cluster answers.

``main`` keeps it up until SIGINT or SIGTERM and then stops it, leaving nothing behind: no process, mount,
network namespace, cgroup or container (``leftovers`` says what would be).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from scripts.image import IMAGE as BUILT

from ..cluster import install_aisnode
from . import cgroups
from .ais import AisCluster, start_ais
from .build import install_kubernetes
from .cluster import start_cluster
from .gobuilds import go_program
from .images import aisnode_image, push
from .topology import REGISTRY

# The names the project's image is pushed under: the deploy spec's (k8s/etl-spec.yaml: localhost:5000/...), and
# the one the tests' ETLs give (ais-wds-transformer:test, i.e. docker.io/library/...).
IMAGE_NAMES = ("ais-wds-transformer:0.1.0", "library/ais-wds-transformer:test")


def start_ais_cluster(root: Path, log=print) -> AisCluster:
    tools = install_kubernetes(log=log)
    image = aisnode_image(install_aisnode(log=log), go_program("aisinit", log=log), log=log)
    cluster = start_cluster(root, tools, log=log)
    try:
        (aisnode,) = push(image, image.split("/", 1)[1])
        log(f"pushing {BUILT} into the cluster's registry (once: later runs find its layers there)")
        reference = push(BUILT, *IMAGE_NAMES)[0]
        log(f"{reference} pulled and run on every node in {cluster.warm(reference):.0f} s")
        ais = start_ais(cluster, aisnode)
    except BaseException:
        cluster.stop()
        raise
    log(f"AIS up: {ais.proxy.pod} on {ais.proxy.node}, " +
        ", ".join(f"{target.pod} on {target.node}" for target in ais.targets))
    return ais


def leftovers(pid: int, root: Path) -> list[str]:
    """What a stopped cluster of process ``pid`` would have left: processes in other network namespaces started
    by it, mounts of its folders, cgroup roots, its folders."""
    left = []
    own = os.readlink(f"/proc/{pid}/ns/net") if Path(f"/proc/{pid}").exists() else ""
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if str(root) in (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ") \
                    and os.readlink(proc / "ns/net") != own:
                left.append(f"process {proc.name}")
    mounts = Path("/proc/self/mountinfo").read_text()
    left += [f"mount {line.split()[4]}" for line in mounts.splitlines() if str(root) in line or "ais-wds-k8s" in line]
    left += [f"cgroup {folder}" for folder in cgroups.leftovers() if folder.endswith(f"-{pid}")]
    return left


def main() -> int:
    # SIGINT (even when started in the background, where it is ignored by default) and SIGTERM stop the cluster
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.default_int_handler)
    root = Path(tempfile.mkdtemp(prefix="ais-wds-cluster-"))

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        ais = start_ais_cluster(root, log=say)
    except KeyboardInterrupt:
        shutil.rmtree(root, ignore_errors=True)
        return 130
    forced: list[str] = []
    try:
        print(f"AIS proxy: {ais.url} (in a network namespace of this process, pid {os.getpid()})\n"
              f"kubeconfig: {ais.cluster.kubeconfig()}\nkubectl: {ais.cluster.tools.kubectl}\n"
              f"image: {REGISTRY}/{IMAGE_NAMES[0]}", flush=True)
        say("Ctrl-C (or SIGTERM) stops it.")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            forced = ais.stop()
    left = leftovers(os.getpid(), root)
    shutil.rmtree(root, ignore_errors=True)
    for line in forced + left:
        say(f"left: {line}")
    say("stopped" + ("" if forced or left else ": nothing left behind"))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
