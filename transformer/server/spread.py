"""One shard's samples spread over every transform worker process: ``SpreadPool``, ``Peers`` and ``RemoteTask``.

Why: a shard handed whole to one worker process runs on that process's threads, and one process's
GIL serves about four cores (docs/design.md, "Cores"), so one shard in flight could not use the
pod's cores. Here the worker that leads a shard (reads it, orders and writes its output) runs a
sample on its own threads while one is free, and otherwise sends it to the least busy worker (the
``Board``'s loads). That worker transforms it and puts the output arrays in its ``Arena`` (shared
memory the leader maps), so the leader writes them to the caller from there as it writes its own:
one copy, as in the threads design.

The samples travel over a ``Link`` between every two workers (``links.py``). A worker that dies or is
killed closes its links: each leader runs the samples it had sent there again on its own threads (seeded
output is the same bytes), so a dead worker fails only the shards it led; a sample whose run here cannot
complete fails its shard, never skipped. Nothing is sent to a worker the board holds suspect
(``Board.suspect``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

from ..errors import InternalError
from ..options import TransformOptions
from ..pool import Task, TransformPool
from ..samples import transform_sample
from ..shards import Sample
from . import arena as arenas
from .board import Board
from .links import Link, RemoteTask

log = logging.getLogger("transformer.server")


class Peers:
    """A worker's links to the other workers, its arena, its own threads and the board they share."""

    def __init__(self, index: int, board: Board, pool: TransformPool, arena: arenas.Arena):
        self.index, self.board, self.pool, self.arena = index, board, pool, arena
        self._lock = threading.Lock()
        self._links: dict[int, Link] = {}  # by worker index
        self.served = 0  # samples transformed here for other workers' shards
        self._served_lock = threading.Lock()

    def add(self, index: int, pid: int, sock: socket.socket, arena_fd: int) -> None:
        """A link to worker ``index`` (the server paired us): replaces the one to its predecessor."""
        link = Link(self, index, pid, sock, arena_fd)
        with self._lock:
            old = self._links.get(index)
            self._links[index] = link
        if old is not None:
            self.lost(old, "a new worker took its place")
        link.start()

    def count_served(self) -> None:
        with self._served_lock:
            self.served += 1

    def links(self) -> list[Link]:
        with self._lock:
            return [link for link in self._links.values() if not link.dead]

    def lost(self, link: Link, reason: str) -> None:
        """``link`` is gone: our samples there run here instead."""
        sent = link.close()
        with self._lock:
            if self._links.get(link.index) is link:
                del self._links[link.index]
        with contextlib.suppress(OSError):
            link.sock.close()
        if sent:
            shards = sorted({task.shard for task in sent})
            log.warning("transform worker %d (pid %d) is gone (%s) with %d samples of shard %s; running them here",
                        link.index, link.pid, reason, len(sent), ", ".join(f"'{s}'" for s in shards))
        for task in sent:
            task.run_here(self.pool)

    def close(self) -> None:
        """This process is stopping: every link ends; a sample of ours still out fails its shard by name."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            for task in link.close():
                task.finish(None, InternalError(f"shard '{task.shard}': transform worker {self.index} is stopping "
                                                f"with a sample out at worker {link.index}"))
            link.sock.close()


class SpreadPool:
    """The pool one shard's engine submits to in a worker process: its own threads first, then the
    least busy other worker (``Peers``); a sample goes elsewhere only when that worker is less busy than
    this one, in samples per thread, and a thread here is busy."""

    _option_ids = itertools.count(1)

    def __init__(self, peers: Peers, options: TransformOptions):
        self.peers, self.local, self.options = peers, peers.pool, options
        self._options_id = next(self._option_ids)
        self._shared: set[Link] = set()  # links that hold this shard's options

    def submit(self, fn: Callable, sample: Sample, options: TransformOptions, shard: str, object_name: str, *,
               cancel: threading.Event | None = None, on_done: Callable[[], None] | None = None):
        assert fn is transform_sample and options is self.options
        local = self.local
        local.acquire(cancel)
        link = self._target()
        if link is not None and link not in self._shared:
            if link.share(self._options_id, options):
                self._shared.add(link)
            else:
                link = None
        if link is not None:
            task = RemoteTask(link, sample, options, shard, object_name, on_done, local.release)
            if link.submit(task, self._options_id):
                return task
            task.on_done = None
        task = Task(fn, (sample, options, shard, object_name), on_done)
        local.enqueue(task)
        return task

    def _target(self) -> Link | None:
        """Where the next sample runs: None (here) while a thread here is free; else the least busy worker with a
        free thread, or one that leads no shard of its own and whose queue is shorter than this one's by a sample
        per thread. A sample sent away costs the messages and wake-ups of two processes, worth it only for a core
        that would idle: two workers that each lead a shard never trade samples to even out their queues."""
        local = self.local
        if local.busy < local.workers:
            return None
        board, now = self.peers.board, time.monotonic()
        mine = local.busy / local.workers
        best, best_load = None, float("inf")
        for link in self.peers.links():
            if board.suspect(link.index, now):
                continue
            slot = board.slots[link.index]
            load = max(slot.busy, link.outstanding) / max(1, slot.threads)
            if load < best_load and (load < 1 or (slot.leading == 0 and load + 1 <= mine)):
                best, best_load = link, load
        return best

    def close(self) -> None:
        """The shard ended: the links forget its options."""
        for link in self._shared:
            if not link.dead:
                link.forget(self._options_id)
        self._shared.clear()
