"""What every transform worker process tells the others, in shared memory: ``Board``.

One slot per worker, each field written by that worker alone and read by everyone: its heartbeat
(``time.monotonic()``, one clock for every process of the host), how many samples its threads hold
(queued or running), how many threads it has, how many shards it leads now and how many it finished leading. The server
reads the heartbeats to find a stuck worker and the finished shards to know how many a worker still
leads; a shard's leader reads the loads to choose where a sample runs (``spread.SpreadPool``). A
single writer per field and 8-byte aligned stores: no lock, and a reader sees the old value or the
new one.
"""

from __future__ import annotations

import ctypes
import mmap
import os


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
    """The slots of ``workers`` worker processes in one shared memory file (``fd``, passed to each worker)."""

    def __init__(self, workers: int, fd: int | None = None):
        size = workers * ctypes.sizeof(Slot)
        if fd is None:
            fd = os.memfd_create("wds-transform-board", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd, self.workers = fd, workers
        self._map = mmap.mmap(fd, size)
        self.slots = (Slot * workers).from_buffer(self._map)

    @classmethod
    def attach(cls, fd: int, workers: int) -> Board:
        """The board the server made, in a worker (``fd`` is the worker's copy)."""
        return cls(workers, fd)

    def reset(self, index: int) -> None:
        """A new worker in slot ``index``: no heartbeat, no load, no shards (server, before it starts)."""
        slot = self.slots[index]
        slot.beat, slot.busy, slot.threads, slot.finished, slot.pid, slot.leading = 0.0, 0, 0, 0, 0, 0

    def age(self, index: int, now: float) -> float:
        """Seconds since slot ``index``'s last heartbeat (infinite before the first)."""
        beat = self.slots[index].beat
        return now - beat if beat else float("inf")
