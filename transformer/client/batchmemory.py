"""Batch memory: the memory batches are read into, filled again once the consumer has let it go.

A fresh batch is fresh memory, which the kernel zeroes page by page on its first write; a batch
filled again costs none of that. In the training process (no DataLoader workers) a batch is a
numpy array under a tensor, kept in a small pool and reused once nothing refers to it
(``Recycler``). A DataLoader worker writes its batches into segments of shared memory it keeps
(``SharedSlots``), which the training process hands back once nothing there uses them (``Lent``).
Never is memory the consumer still holds filled again.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from .errors import SharedMemoryError


class Recycler:
    """The arrays of batches handed out, kept to be filled again once nothing else refers to them.

    A fresh batch array is fresh memory: Linux zeroes each page on its first write, and numpy's
    allocator (glibc) maps every array over 32 MB anew (a float32 batch of 64 is 38.5 MB), so
    filling it costs about half as much again as the reading itself (``python -m bench.reader``).
    A batch's array is reused only when its reference count says the batch tensor, its slices and
    every numpy view of it are gone (the training step dropped the batch); one the consumer still
    holds is never touched, and a new one is allocated. In a DataLoader worker the batch tensors live
    in shared memory instead (``SharedSlots``).
    """

    def __init__(self, keep: int, slots: SharedSlots | None = None):
        self.keep = keep
        self.arrays: list[np.ndarray] = []
        self.slots = slots
        self.sent: list[tuple[int, int]] = []  # (column, slot) of the batch just taken: they travel with it

    def array(self, shape: tuple, dtype: np.dtype) -> tuple[torch.Tensor, np.ndarray, int] | None:
        """A batch tensor, its numpy view, and its shared-memory slot (-1: none); None for a dtype torch
        does not hold."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if self.slots is not None and nbytes:
            try:
                kind = torch.from_numpy(np.empty(0, dtype)).dtype
            except TypeError:
                return None
            slot, storage = self.slots.take(nbytes)
            tensor = torch.empty(0, dtype=kind).set_(storage, 0, shape)
            return tensor, tensor.numpy(), slot
        # Allocated by numpy, which asks Linux for huge pages on large arrays (madvise): the first write
        # to a fresh 154 MB float32 batch costs 7 page faults per row instead of torch.empty's 147, about
        # a quarter of the time (python -m bench.reader; its floor reader allocates the same way).
        view = self._take(shape, dtype)
        if view is None:
            view = np.empty(shape, dtype)
        try:
            return torch.from_numpy(view), view, -1
        except TypeError:
            return None

    def give(self, view: np.ndarray, slot: int) -> None:
        """A batch array no longer filled: kept for another batch (a shared one's slot is free again)."""
        if slot >= 0:
            self.slots.free(slot)
            return
        if self.slots is not None:
            return
        self.arrays.append(view)
        if len(self.arrays) > self.keep:
            del self.arrays[0]

    def _take(self, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        arrays = self.arrays
        for index in range(len(arrays)):
            # 2: the list's reference and the argument's; any tensor, slice or view adds its own.
            if sys.getrefcount(arrays[index]) == 2 and arrays[index].shape == shape and arrays[index].dtype == dtype:
                return arrays.pop(index)
        return None


# torch's own count of the references to a storage (its C++ holders included: tensors, views, numpy
# arrays over it), and its allocation of a storage in shared memory (what torch.multiprocessing does to
# send a tensor); both private, so workers use SharedSlots only where both exist.
_use_count = getattr(torch._C, "_storage_Use_Count", None)
SHARED_SLOTS = _use_count is not None and hasattr(torch.UntypedStorage, "_new_shared")


class SharedSlots:
    """A DataLoader worker's batch tensors, in shared memory it keeps and fills again once the main
    process has let them go.

    A worker's batch reaches the main process through shared memory. Left to itself, torch copies each
    batch into a new shared-memory segment, and a new segment is new memory that the kernel hands out
    4 KB at a time on the first write (shared memory gets no huge pages by default): for float32 that
    cost three times the reading itself (``python -m bench.experiments.loader_ab``). Here the worker
    writes each batch into a segment of its own from the start, so torch sends it as it is, and
    reuses the segment for a later batch once ``flags`` says the main process is done with it.

    ``flags`` is this worker's row of a shared array ``EtlLoader`` makes for each pass over the
    DataLoader: 1 while a slot's batch is being filled or is held by the main process, 0 once the main
    process found nothing referring to it any more (``Lent``). When every slot is held, a batch gets
    a segment of its own that is not kept.
    """

    def __init__(self, flags: np.ndarray, budget: ShmBudget | None = None):
        self.flags = flags
        self.budget = budget
        self.storages: list[torch.UntypedStorage | None] = [None] * len(flags)

    def take(self, nbytes: int) -> tuple[int, torch.UntypedStorage]:
        free = -1
        for slot, storage in enumerate(self.storages):
            if self.flags[slot] == 0:
                if storage is not None and storage.nbytes() == nbytes:
                    self.flags[slot] = 1
                    return slot, storage
                if free < 0:
                    free = slot
        try:
            storage = torch.UntypedStorage._new_shared(nbytes)
        except RuntimeError as exc:  # torch's "unable to allocate shared memory(shm) ...: No space left on device"
            if "shared memory" not in str(exc) and "No space left" not in str(exc):
                raise
            raise SharedMemoryError(shm_message(nbytes, self.budget, str(exc))) from exc
        if free >= 0:  # an unused slot, or one whose segment has another size: this one replaces it
            self.storages[free] = storage
            self.flags[free] = 1
        return free, storage

    def free(self, slot: int) -> None:
        self.flags[slot] = 0


SHM = "/dev/shm"


@dataclass(frozen=True)
class ShmBudget:
    """What sets how many batches a loader keeps in shared memory at once (docs/client.md): per worker,
    its open batches (the shuffle), ``prefetch_factor`` more on their way, and 2 in the training loop
    (the batch it works on, and the one before, still referenced while the next one arrives)."""

    workers: int
    prefetch_factor: int
    open_batches: int

    @property
    def batches(self) -> int:
        return self.workers * (self.open_batches + self.prefetch_factor + 2)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB"


def shm_message(nbytes: int, budget: ShmBudget | None, reason: str) -> str:
    """Why a worker's batch found no room in /dev/shm, what the loader needs there, and the ways out."""
    try:
        stat = os.statvfs(SHM)
        room = f"{SHM} has {_mb(stat.f_bavail * stat.f_frsize)} free of {_mb(stat.f_blocks * stat.f_frsize)}"
    except OSError as exc:
        room = f"{SHM} cannot be read ({exc.strerror})"
    need, size = "", "8g"
    if budget is not None:
        total = budget.batches * nbytes
        size = f"{max(64, -(-total * 5 // 4 // 2**20))}m"  # a quarter more, for what else lives there
        need = (f" With {budget.workers} workers, prefetch_factor {budget.prefetch_factor} and "
                f"{budget.open_batches} open batches per worker (shuffle_buffer / batch_size) this loader keeps up "
                f"to {budget.workers} x ({budget.open_batches} + {budget.prefetch_factor} + 2) = {budget.batches} "
                f"such batches there, about {_mb(total)} (docs/client.md).")
    return (f"a DataLoader worker cannot allocate a {_mb(nbytes)} batch tensor in shared memory: {room} "
            f"({reason.strip()}). Batches from DataLoader workers live in {SHM}.{need} Docker and podman give a "
            f"container 64 MB unless run with --shm-size (here: --shm-size={size}); on Kubernetes mount an emptyDir "
            f"with medium: Memory (and a sizeLimit) at {SHM}. Or lower num_workers, prefetch_factor, "
            f"shuffle_buffer or batch_size.")


class Lent:
    """The main process's side of ``SharedSlots``: the slots of the batches it received, each handed
    back (its flag set to 0) once nothing in this process refers to its storage: not the batch, not a
    slice, a view or a numpy array over it (torch's count of the storage's users reads 1: the storage
    object held here), nor the storage object itself, which ``untyped_storage()`` and ``storage()``
    give the consumer too (Python's count of it reads 2: the entry here and the count's argument). A
    batch that arrives already copied (``pin_memory``) hands its slots back at once.

    A batch passed on to another process (a ``multiprocessing`` queue) is out of this count: copy it
    first (``clone()``), or the worker may fill its memory again while the other process reads it.
    """

    def __init__(self, flags: torch.Tensor):
        self.flags = flags.numpy()
        self.held: list[tuple[int, int, torch.UntypedStorage]] = []  # (worker, slot, storage)

    def receive(self, batch: tuple, worker: int, slots: tuple[tuple[int, int], ...]) -> None:
        self.hand_back()
        for column, slot in slots:
            tensor = batch[column]
            if isinstance(tensor, torch.Tensor) and tensor.is_shared():
                self.held.append((worker, slot, tensor.untyped_storage()))
            else:
                self.flags[worker, slot] = 0

    def hand_back(self) -> None:
        held = []
        for entry in self.held:
            if _use_count(entry[2]._cdata) == 1 and sys.getrefcount(entry[2]) == 2:
                self.flags[entry[0], entry[1]] = 0
            else:
                held.append(entry)
        self.held = held
