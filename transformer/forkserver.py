"""The fork server of the transform worker processes, started before the server imports torch.

Kept free of heavy imports: ``wds-transform serve`` starts it first, so that it imports torch and the
transforms (the module below, preloaded) in a process of its own while the server process imports
the same, and the workers forked from it later start at once (server/processes.py).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

PRELOAD = "transformer.server.processes"  # imported once by the fork server; every worker is forked with it


def start_fork_server() -> None:
    """Start the fork server if it does not run yet; returns at once (its imports go on in the background)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD])
    multiprocessing.forkserver.ensure_running()
