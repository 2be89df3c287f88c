"""Shared memory for arrays one worker process makes and another writes out: ``Arena`` and ``lease``.

A shard's leader puts each large input member of a sample it sends to another worker (``spread.py``)
in its arena, a memory file every worker maps, and sends only where it lies; the worker decodes it
from there. That worker puts each large output piece (the ``.npy`` array) in its own arena, and the
leader writes it to the caller from there: the one copy the threads design makes from its own
buffers, not two more through a socket each way.

A block starts with a flag byte: 1 while the other process may still read it. The reader clears it
once nothing refers to the bytes any more (``lease``: a numpy array over the block, whose finalizer
clears the flag when the last view of it is gone: after the socket took the bytes, after the decoder
read them), and the owner takes the block back at its next allocation. Only the owner sets the flag
and only the reader clears it, so no lock crosses the processes. Blocks come in power-of-two sizes;
the pages of a block that are never written cost no memory (the file is sparse), so the rounding
costs address space only. When the arena has no free block of the size asked for, the piece travels
inline instead: slower, never lost.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

HEADER = 64  # the flag byte, padded: payloads start 64-byte aligned
SIZE = 1 << 30  # address space per worker; only what blocks in use have written is memory
_MIN_CLASS = 16  # 64 KiB: smaller pieces travel inline
_MAX_CLASS = 27  # 128 MiB: larger pieces travel inline


class Arena:
    """A worker's arena: blocks it fills (``put``, ``allocate``) and lends to a reader on a link (``lend``),
    taken back once the reader cleared their flags, or at once when that link is gone (``release``)."""

    def __init__(self, size: int = SIZE):
        self.fd = os.memfd_create("wds-transform-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size = size
        self._map = mmap.mmap(self.fd, size)
        self._view = memoryview(self._map)
        self._base = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        self._lock = threading.Lock()
        self._top = 0  # blocks are carved from here until the end
        self._class: dict[int, int] = {}  # block offset -> its size class (a block keeps its size for good)
        self._free: dict[int, list[int]] = {}  # size class -> offsets of free blocks
        self._lent: dict[int, list[int]] = {}  # reader link -> offsets of the blocks lent to it
        self._released: set[int] = set()  # links gone: what is lent to them is free at once

    @staticmethod
    def fits(size: int) -> bool:
        """Whether a piece of ``size`` bytes goes in an arena (else inline)."""
        return size + HEADER <= 1 << _MAX_CLASS and size >= (1 << _MIN_CLASS) - HEADER

    def allocate(self, size: int) -> tuple[int, memoryview] | None:
        """A block for ``size`` bytes, flagged in use and lent to no one yet: its offset and its payload's view."""
        cls = max(_MIN_CLASS, (size + HEADER - 1).bit_length())
        with self._lock:
            offset = self._take(cls)
        if offset is None:
            return None
        self._map[offset] = 1
        return offset, self._view[offset + HEADER:offset + HEADER + size]

    def put(self, link: int, pieces: list) -> int | None:
        """Copy ``pieces`` back to back into a block lent to ``link``; the block's offset, or None when none
        is free (or the link is gone)."""
        if link in self._released:
            return None
        taken = self.allocate(sum(len(piece) for piece in pieces))
        if taken is None:
            return None
        offset, view = taken
        at = 0
        for piece in pieces:
            piece = memoryview(piece).cast("B")
            view[at:at + len(piece)] = piece
            at += len(piece)
        self.lend(link, [offset])
        return offset

    def lend(self, link: int, offsets: list[int]) -> None:
        """The reader on ``link`` releases these blocks (clears their flags) once done with them."""
        with self._lock:
            if link in self._released:
                for offset in offsets:
                    self._give_back(offset)
            else:
                self._lent.setdefault(link, []).extend(offsets)

    def free(self, offset: int) -> None:
        """A block allocated and not lent (its task's result did not use it)."""
        with self._lock:
            self._give_back(offset)

    def locate(self, piece: memoryview) -> int | None:
        """The offset of the block whose payload ``piece`` is, when it lies in this arena."""
        try:
            address = np.frombuffer(piece, np.uint8).ctypes.data
        except (TypeError, ValueError):
            return None
        offset = address - self._base - HEADER
        return offset if offset in self._class else None

    def _give_back(self, offset: int) -> None:
        self._map[offset] = 0
        self._free.setdefault(self._class[offset], []).append(offset)

    def _take(self, cls: int) -> int | None:
        free = self._free.get(cls)
        if not free:
            self._collect()
            free = self._free.get(cls)
        if free:
            return free.pop()
        if self._top + (1 << cls) <= self.size:
            offset, self._top = self._top, self._top + (1 << cls)
            self._class[offset] = cls
            return offset
        return None

    def _collect(self) -> None:
        """Take back every lent block whose reader cleared its flag."""
        for link, blocks in self._lent.items():
            kept = []
            for offset in blocks:
                if self._map[offset]:
                    kept.append(offset)
                else:
                    self._free.setdefault(self._class[offset], []).append(offset)
            self._lent[link] = kept

    def release(self, link: int) -> None:
        """The reader on ``link`` is gone: its blocks are free, and so is anything lent to it later."""
        with self._lock:
            self._released.add(link)
            for offset in self._lent.pop(link, []):
                self._give_back(offset)

    def lent(self) -> int:
        """Blocks lent and not yet taken back (tests, metrics)."""
        with self._lock:
            self._collect()
            return sum(len(blocks) for blocks in self._lent.values())


def attach(fd: int) -> mmap.mmap:
    """Another worker's arena, mapped from its memory file (read the pieces, clear the flags)."""
    return mmap.mmap(fd, os.fstat(fd).st_size)


def lease(arena: mmap.mmap, offset: int, size: int) -> memoryview:
    """The payload of the block at ``offset`` in another worker's arena, released when the last view of it goes."""
    array = np.frombuffer(arena, np.uint8, count=size, offset=offset + HEADER)
    # A weak reference whose callback clears the flag (kept until then in _leases): a finalize object
    # per lease cost several times as much, on the thread that leads the shard.
    ref = weakref.ref(array, _release)
    _leases[id(ref)] = (ref, arena, offset)
    return memoryview(array)


# Live leases by their reference's id (an array is not hashable): the reference itself, kept alive until its
# callback, the map (kept open until then) and the block.
_leases: dict[int, tuple[weakref.ref, mmap.mmap, int]] = {}


def _release(ref: weakref.ref) -> None:
    _, arena, offset = _leases.pop(id(ref))
    arena[offset] = 0
