"""What every transform worker process tells the others, in shared memory: ``Board``.

One slot per worker, each field written by that worker alone and read by everyone: its heartbeat
(``time.monotonic()``, one clock for every process of the host), how many samples its threads hold
(queued or running), how many threads it has, how many shards it leads now and how many it finished leading. The server
reads the heartbeats to find a stuck worker and the finished shards to know how many a worker still
leads; a shard's leader reads the loads to choose where a sample runs (``spread.SpreadPool``). A
single writer per field and 8-byte aligned stores: no lock, and a reader sees the old value or the
new one.

The board is also the one home of a worker's liveness, every threshold in one place: a worker beats every
``BEAT_SECONDS`` unless one of its samples has run longer than ``stall`` (ETL_WORKER_TIMEOUT); a heartbeat
older than ``LATE_SECONDS`` (two missed) makes it the last choice for a new shard, older than
``SUSPECT_SECONDS`` it gets no new shard and no sample of another's, older than ``stall`` the server kills
it (``late``, ``suspect``, ``stalled``).
"""

from __future__ import annotations

import ctypes
import mmap
import os

BEAT_SECONDS = 0.5  # how often a worker writes its heartbeat
LATE_SECONDS = 1.0  # two beats missed: maybe the start of a stop; the last choice for a new shard
SUSPECT_SECONDS = 2.0  # no new shard, no sample of another's shard (the server kills it at ``stall``)


class Slot(ctypes.Structure):
    _fields_ = [
        ("beat", ctypes.c_double),  # the worker's last heartbeat (time.monotonic()); 0: none yet
        ("busy", ctypes.c_int64),  # samples queued or running on its transform threads
        ("threads", ctypes.c_int64),  # its transform threads
        ("finished", ctypes.c_int64),  # shards it finished leading (the server counts those it sent)
        ("pid", ctypes.c_int64),
        ("leading", ctypes.c_int64),  # shards it leads now
        ("_pad", ctypes.c_int64 * 2),  # one cache line per slot: no false sharing between writers
    ]


class Board:
    """The slots of ``workers`` worker processes in one shared memory file (``fd``, passed to each worker);
    ``stall``: the seconds after which a worker whose heartbeat stopped is killed (ETL_WORKER_TIMEOUT)."""

    def __init__(self, workers: int, stall: float = 20.0, fd: int | None = None):
        size = workers * ctypes.sizeof(Slot)
        if fd is None:
            fd = os.memfd_create("wds-transform-board", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd, self.workers, self.stall = fd, workers, stall
        self._map = mmap.mmap(fd, size)
        self.slots = (Slot * workers).from_buffer(self._map)

    @classmethod
    def attach(cls, fd: int, workers: int, stall: float) -> Board:
        """The board the server made, in a worker (``fd`` is the worker's copy)."""
        return cls(workers, stall, fd)

    def reset(self, index: int) -> None:
        """A new worker in slot ``index``: no heartbeat, no load, no shards (server, before it starts)."""
        slot = self.slots[index]
        slot.beat, slot.busy, slot.threads, slot.finished, slot.pid, slot.leading = 0.0, 0, 0, 0, 0, 0

    def age(self, index: int, now: float) -> float:
        """Seconds since slot ``index``'s last heartbeat (infinite before the first)."""
        beat = self.slots[index].beat
        return now - beat if beat else float("inf")

    def beat(self, index: int, now: float, oldest: float) -> bool:
        """Worker ``index``'s heartbeat, unless its oldest running sample (started at ``oldest``; 0: none) has run
        longer than ``stall``: then it is withheld, for the server to replace the worker. Whether it beat."""
        if oldest and now - oldest > self.stall:
            return False
        self.slots[index].beat = now
        return True

    def late(self, index: int, now: float) -> bool:
        """Two heartbeats missed: maybe the start of a stop (the worker is the last choice for a new shard)."""
        return self.age(index, now) > LATE_SECONDS

    def suspect(self, index: int, now: float) -> bool:
        """No heartbeat for ``SUSPECT_SECONDS``: the worker gets no new shard and no sample of another's."""
        return self.age(index, now) > SUSPECT_SECONDS

    def stalled(self, index: int, now: float) -> bool:
        """No heartbeat for ``stall`` seconds: stopped, or stuck in a sample; the server kills it."""
        return self.age(index, now) > self.stall
