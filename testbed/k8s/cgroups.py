"""The one host-wide thing a node makes: the kubelet's cgroup root (cgroupfs driver), in every hierarchy.

Each node's kubelet gets a root of its own, ``/ais-wds-k8s-<node>-<pid>`` (``pid``: the process that started
the cluster), made before the kubelet starts and removed depth first once the node's processes are gone. A
later start removes the roots of processes that no longer exist (killed before their teardown).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ..cluster import owner_gone

PREFIX = "ais-wds-k8s-"


def root_name(node: str, pid: int) -> str:
    return f"/{PREFIX}{node}-{pid}"


def hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies (v1 controllers and the v2/unified one)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] in ("cgroup", "cgroup2"):
            found.append(Path(left.split()[4]))
    return found


def make_root(name: str) -> list[Path]:
    """``/<name>`` in every hierarchy; cpuset's ``cpus`` and ``mems`` copied from its parent."""
    made = []
    for hierarchy in hierarchies():
        folder = hierarchy / name.strip("/")
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        made.append(folder)
        for key in ("cpuset.cpus", "cpuset.mems"):
            if (folder / key).exists() and not (folder / key).read_text().strip():
                (folder / key).write_text((hierarchy / key).read_text())
    return made


def remove_root(name: str, timeout: float = 10.0) -> list[str]:
    """``/<name>`` removed from every hierarchy; returns what could not be removed (with why)."""
    left = []
    for hierarchy in hierarchies():
        left += remove_tree(hierarchy / name.strip("/"), timeout)
    return left


def remove_tree(folder: Path, timeout: float = 10.0) -> list[str]:
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


def remove_orphaned() -> None:
    """The roots of clusters whose starting process is gone: their pid namespaces died with it, so they are empty."""
    for hierarchy in hierarchies():
        for folder in hierarchy.glob(f"{PREFIX}*"):
            if owner_gone(folder.name.rsplit("-", 1)[-1]):
                remove_tree(folder, timeout=1.0)


def leftovers() -> list[str]:
    """Every cgroup root of this test bed's kubelets still on the host (any cluster's)."""
    return sorted(str(folder) for hierarchy in hierarchies() for folder in hierarchy.glob(f"{PREFIX}*"))
