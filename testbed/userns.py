"""Root in a user namespace of its own, for a test run by an unprivileged user (standard library only).

The real-ETL tests (``tests/ais/etl/``) need a network namespace and mounts: root has the rights, and
so has an unprivileged process once it is root in a user namespace of its own, where the kernel allows
them (``user.max_user_namespaces`` > 0). A process can only enter one while it has a single thread, so
``tests/conftest.py`` calls ``enter`` first thing, before numpy or torch start theirs. The process keeps
the host's network and files (as its own user), and the namespace ends with it. Not entered as root,
when the run leaves out the ``ais`` tests (``-m 'not ais...'``), or with ``AIS_WDS_NO_USERNS=1``;
``problem`` says why it could not be entered, for the fixture's message.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
problem = ""


def _wanted() -> bool:
    if os.geteuid() == 0 or os.environ.get("AIS_WDS_NO_USERNS") == "1":
        return False
    args = sys.argv[1:]
    expressions = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"] + [a[2:] for a in args if
                                                                                   a.startswith("-m") and len(a) > 2]
    return not any("not ais" in expression for expression in expressions)


def enter() -> None:
    global problem
    if not _wanted():
        return
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        problem = f"the test process already runs {threads} threads, and only a single-threaded one can enter"
        return
    uid, gid = os.getuid(), os.getgid()
    if ctypes.CDLL("libc.so.6", use_errno=True).unshare(CLONE_NEWUSER) != 0:
        problem = f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}"
        return
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as stream:
            stream.write(text)


def can_leave_a_network_namespace() -> bool:
    """Root on the host can go back to the host's network namespace after the real-ETL tests; root in a user
    namespace of its own (an unprivileged run) cannot: the host's belongs to the host's root."""
    with open("/proc/self/uid_map") as uid_map:
        return uid_map.read().split()[:3] == ["0", "0", "4294967295"]


stuck_in: list[str] = []  # why this process could not leave the real-ETL tests' network namespace
