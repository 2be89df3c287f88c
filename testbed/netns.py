"""A private network namespace for the real-ETL cluster and the image tests.

``enter_network_namespace`` moves the calling thread (the test process's main thread) into a new network
namespace (``unshare(CLONE_NEWNET)``), where ``lo`` is brought up with the given addresses on it. Every
process the thread starts afterwards (aisnode, the fake API, the pods, DataLoader workers) and every
socket it opens is in that namespace: every packet stays inside it, and the host's network is untouched.
``leave`` returns the thread to the namespace it came from; the namespace is gone with its last process.
This needs CAP_SYS_ADMIN: root, or a user namespace entered before the process started any thread
(``testbed/userns.py``, which ``tests/conftest.py`` enters first thing).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000


class NamespaceUnavailable(RuntimeError):
    """The network or mount namespace could not be made; the message says what is missing."""


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _ip(*args: str) -> None:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    result = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NamespaceUnavailable(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@dataclass
class NetworkNamespace:
    original: int  # a file descriptor of the namespace the thread came from

    def leave(self) -> None:
        if self.original < 0:
            return
        if _libc().setns(self.original, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns back to the original network namespace: {os.strerror(err)}")
        os.close(self.original)
        self.original = -1


def check_prerequisites() -> None:
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None
               and not Path(f"/usr/sbin/{tool}").exists() and not Path(f"/usr/bin/{tool}").exists()]
    if shutil.which("openssl") is None:  # run from PATH by testbed/tlscerts.py, for the fake API's TLS files
        missing.append("openssl")
    if missing:
        raise NamespaceUnavailable(f"the real-ETL cluster needs {', '.join(missing)}, not found (Debian: "
                                   "apt-get install iproute2 util-linux mount openssl)")


def enter_network_namespace(addresses: list[str]) -> NetworkNamespace:
    """Move this thread into a new network namespace with ``lo`` up and ``addresses`` on it."""
    check_prerequisites()
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    if _libc().unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        os.close(original)
        raise NamespaceUnavailable(
            f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}. The real-ETL tests need a network namespace of "
            "their own: run them as root, or where the kernel allows unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0); "
            "to leave them out: pytest -m 'not ais_etl'")
    namespace = NetworkNamespace(original)
    try:
        _ip("link", "set", "lo", "up")
        for address in addresses:
            _ip("addr", "add", f"{address}/32", "dev", "lo")
    except BaseException:
        namespace.leave()
        raise
    return namespace
