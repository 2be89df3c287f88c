"""The cluster users run, on one machine: two Kubernetes nodes, AIS's proxy and targets as pods, the pod image
in the registry and unpacked on both nodes (``make cluster``, ``python -m testbed.k8s.up``).

``start_ais_cluster`` builds or finds everything (Kubernetes, CoreDNS, aisinit, aisnode and its image), starts
the cluster (``cluster.py``), pushes the aisnode image and the project's image (``make image``) into the
cluster's registry, has each node pull the project's image once, and starts AIS (``ais.py``). The calling
thread is left in the cluster's machine room, from where every address of the cluster answers.

``main`` keeps it up until SIGINT or SIGTERM and then stops it, leaving nothing behind: no process, mount,
network namespace, cgroup or container (``Cluster.leftovers`` says what would be).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from scripts.image import IMAGE as BUILT

from ..cluster import install_aisnode
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
        started = time.monotonic()
        reference = push(BUILT, *IMAGE_NAMES)[0]  # the first time minutes; then only the layers that changed
        log(f"{BUILT} in the cluster's registry in {time.monotonic() - started:.0f} s")
        log(f"{reference} pulled and run on every node in {cluster.warm(reference):.0f} s")
        started = time.monotonic()
        ais = start_ais(cluster, aisnode)
    except BaseException:
        cluster.stop()
        raise
    log(f"AIS up in {time.monotonic() - started:.0f} s: {ais.proxy.pod} on {ais.proxy.node}, " +
        ", ".join(f"{target.pod} on {target.node}" for target in ais.targets))
    return ais


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
    left = ais.cluster.leftovers()
    shutil.rmtree(root, ignore_errors=True)
    for line in forced:  # ETL pods still registered when it stopped: ended with their nodes
        say(f"ended with the cluster: {line}")
    for line in left:
        say(f"left on the host: {line}")
    say("stopped: " + ("see above" if left else "nothing left behind (process, mount, network namespace, cgroup, "
                                                 "container)"))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
