"""The consuming side: a PyTorch DataLoader over ETL'd shards, batched inside the workers, resumable.

Per DataLoader worker (``stream.SampleStream``)::

    shard list (epoch URLs, seeded shard shuffle, identical on every rank and worker: epoch.shard_order)
      -> split by rank -> split by worker          (or: seeded draws with replacement, for endless streams)
      -> read each shard whole over HTTP           (reading.whole_shard_samples: end marker, cut reads continued;
                                                    each .npy read in one copy, straight into its batch row)
      -> pick by keys, decode labels -> one of the open batches, drawn at random (batching: the shuffle)
      -> the batch, in memory filled again once the training process lets it go (batchmemory)

Errors are counted and skipped (``epoch.ErrorCounter``). Each batch a worker sends carries that
worker's stream state right after it; the loader keeps the last one per worker, and
``state_dict()``/``load_state_dict()`` save and restore it (``resume``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from webdataset.utils import pytorch_worker_info

from .batching import Batcher
from .batchmemory import SHARED_SLOTS, Lent, SharedSlots, ShmBudget
from .epoch import ErrorCounter, epoch_urls, shard_order
from .errors import ClientError
from .resume import LoaderConfig, LoaderPosition, Snapshot, position_of, state_of
from .stream import SampleStream, ShardReader, StreamSpec, generator_key, sample_tuples

log = logging.getLogger("transformer.client")

LAST_BATCH = ("partial", "drop", "pad")
DEFAULT_KEYS = ("npy;image.npy", "cls")


class _Streams(torch.utils.data.IterableDataset):
    """What the DataLoader iterates: in each worker, (batch, ``Snapshot``) pairs of that worker's stream.

    ``epoch``, ``start`` (logical worker -> the state to continue from), ``first`` (the logical
    worker that physical worker 0 runs) and ``flags`` (the workers' shared-memory slots, one row per
    logical worker: ``SharedSlots``; None: no shared slots) are set before each DataLoader
    iteration; the workers get a copy when they start.
    """

    def __init__(self, config: LoaderConfig, errors: ErrorCounter, reader: ShardReader):
        super().__init__()
        self.config = config
        self.errors = errors
        self.reader = reader
        self.epoch = 0
        self.start: dict[int, dict[str, Any]] = {}
        self.first = 0
        self.flags: torch.Tensor | None = None
        self.budget: ShmBudget | None = None  # set with flags: what a worker's error says the loader needs

    def spec(self, worker: int) -> StreamSpec:
        c = self.config
        urls = epoch_urls(c.urls, self.epoch)
        order = None
        if not c.resampled:
            split = c.split_by_node and c.world_size > 1
            mine = shard_order(len(urls), shuffle=c.shuffle_shards, seed=c.seed, epoch=self.epoch,
                               part=c.rank if split else 0, parts=c.world_size if split else 1)
            order = mine[worker::c.streams]
        key = (c.seed, self.epoch, c.rank, worker)  # every rank and worker shuffles its own way
        # The stream does not shuffle: its samples go to open batches drawn at random (Batcher).
        return StreamSpec(urls, order, generator_key(*key, "shards"), generator_key(*key, "buffer"), 0, c.keys)

    def __iter__(self) -> Iterator[tuple[tuple, Snapshot]]:
        info = torch.utils.data.get_worker_info()
        physical, count = (info.id, info.num_workers) if info is not None else (0, 1)
        if count != self.config.streams:
            raise RuntimeError(f"the DataLoader runs {count} workers, the loader was made for {self.config.streams}")
        worker = (self.first + physical) % count
        start = self.start.get(worker)
        spec = self.spec(worker)
        config = self.config
        slots = (SharedSlots(self.flags[worker].numpy(), self.budget)
                 if info is not None and self.flags is not None else None)
        batcher = Batcher(config.batch_size, config.keys, config.last_batch, config.open_batches, spec.buffer_key,
                           slots)
        shuffles = len(batcher.batches) > 1
        stream = SampleStream(spec, self.reader, self.errors, start)
        stream.placer = batcher if shuffles else batcher.batches[0]  # arrays are read into their batch rows
        stream.reader = dataclasses.replace(self.reader, place=stream.place)
        made = start["batches"] if start else 0
        if start:  # the samples the open batches held are read again into their rows
            batcher.restore(start, _held_values(stream.restore(), config.keys, self.errors))
        def after(batch: tuple) -> tuple[tuple, Snapshot]:
            nonlocal made
            made += 1
            sent, batcher.recycler.sent = tuple(batcher.recycler.sent), []
            return batch, Snapshot(worker, {"worker": worker, "batches": made, **stream.snapshot(),
                                             **batcher.snapshot()}, sent)

        for values in stream.tuples():
            batch = batcher.add(values, stream.identity() if shuffles else None)
            if batch is not None:
                yield after(batch)
        for batch in batcher.drain():
            yield after(batch)


def _held_values(held: list[tuple[int, int, dict[str, Any]]], keys: tuple[str, ...], handler: Callable
                 ) -> dict[tuple[int, int], tuple]:
    """The values of samples read again for the open batches, by (URL index, position)."""
    found = {}
    for index, position, sample in held:
        for values in sample_tuples(iter([sample]), keys, handler):
            found[index, position] = values
    return found


class EtlLoader:
    """An iterable of batches (tuples of tensors), one epoch per ``iter()``, resumable mid-epoch.

    Each ``iter()`` starts the next epoch (``set_epoch`` to choose it, as with ``DistributedSampler``):
    the epoch picks the shard order, the shuffle buffer's seed, and, with ``EpochUrls``, the ETL's
    augmentation draws. Workers are restarted per epoch so they see it. ``errors`` counts the samples
    and shards skipped so far.

    ``state_dict()`` is where the loader is: after the last batch it yielded (the start of the next
    epoch once an epoch is over). ``load_state_dict(state)`` makes the next ``iter()`` yield exactly
    the batches that would have followed. The state is small and JSON-serialisable.
    """

    def __init__(self, dataloader: torch.utils.data.DataLoader, streams: _Streams, errors: ErrorCounter,
                 batches: int | None, num_workers: int, epoch: int = 0):
        self.dataloader = dataloader
        self.streams = streams
        self.errors = errors
        self.batches_per_epoch = batches
        self.num_workers = num_workers
        self._next_epoch = epoch
        self._progress: LoaderPosition | None = None  # the epoch being (or last) iterated
        self._pending: LoaderPosition | None = None  # a loaded state, for the next iter()

    @property
    def config(self) -> LoaderConfig:
        return self.streams.config

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` yields."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` yields, from its start; a loaded state of that same epoch is kept."""
        if epoch < 0:
            raise ValueError("set_epoch: epoch must be non-negative")
        if self._pending is not None and self._pending.epoch != epoch:
            self._pending = None
        self._progress = None
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[tuple]:
        epoch = self._next_epoch
        position, self._pending = self._pending or LoaderPosition(epoch), None
        self._next_epoch = epoch + 1
        self._progress = position
        return self._epoch(position)

    def _epoch(self, position: LoaderPosition) -> Iterator[tuple]:
        streams, total = self.streams, self.batches_per_epoch
        count = streams.config.streams
        start, first = dict(position.workers), position.next_worker
        if total is not None and position.batches >= total:
            position.finished = True
            return
        while True:
            streams.epoch, streams.start, streams.first = position.epoch, start, first
            lent = self._lend()
            yielded = 0
            for batch, snapshot in self.dataloader:
                if lent is not None:
                    lent.receive(batch, snapshot.worker, snapshot.slots)
                position.workers[snapshot.worker] = snapshot.state
                position.next_worker = (snapshot.worker + 1) % count
                position.batches += 1
                yielded += 1
                yield batch
                if total is not None and position.batches >= total:
                    position.finished = True
                    return
            if total is None or (yielded == 0 and not start):  # the end, or an empty stream
                position.finished = True
                return
            # epoch_batches over a finite stream: it starts again until the epoch has its batches.
            position.passes += 1
            position.workers, position.next_worker = {}, 0
            start, first = {}, 0

    def _lend(self) -> Lent | None:
        """New shared-memory slots for the workers about to start (``SharedSlots``): fresh flags for
        every DataLoader iteration, so a batch of an earlier one handed back late frees nothing of it."""
        streams = self.streams
        if self.num_workers == 0 or not SHARED_SLOTS:
            streams.flags = None
            return None
        config = streams.config
        prefetch = self.dataloader.prefetch_factor or 2
        per_worker = (config.open_batches + prefetch + 4) * len(config.keys)
        streams.flags = torch.zeros((config.streams, per_worker), dtype=torch.int8).share_memory_()
        streams.budget = ShmBudget(config.streams, prefetch, config.open_batches)
        return Lent(streams.flags)

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("this loader has no fixed length; give epoch_batches to make_loader")
        return self.batches_per_epoch

    # ---- state --------------------------------------------------------------------------------------

    def _position(self) -> LoaderPosition:
        """Where the loader is now (a copy; cheap: the worker states are shared, never changed)."""
        if self._pending is not None:
            return self._pending.copy()
        progress, total = self._progress, self.batches_per_epoch
        if progress is None or progress.finished or (total is not None and progress.batches >= total):
            return LoaderPosition(self._next_epoch)  # the epoch is over: the next one, from its start
        return progress.copy()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the last batch it yielded, as plain JSON data: about 200 bytes per
        worker and 30 per sample in its shuffle buffer. Store it with the model; ``load_state_dict`` resumes."""
        return self.state_at(self._position())

    def state_at(self, position: LoaderPosition) -> dict[str, Any]:
        """The state at ``position``, one this loader reported with a batch (what ``CudaPrefetcher`` saves)."""
        return state_of(position, self.config)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s output at the next ``iter()``: the rest of its epoch, exactly.

        Refused (``LoaderStateError``, naming each difference) when this loader was made with other
        URLs, seed, batch size, workers, shuffle buffer, last_batch, keys, resampling, epoch length, or
        rank/world size; or when the state is not one this version reads.
        """
        self._pending = position_of(state, self.config)
        self._progress = None
        self._next_epoch = self._pending.epoch


def make_loader(
    urls: Sequence[str] | Callable[[int], Sequence[str]],
    batch_size: int,
    *,
    keys: Sequence[str] = DEFAULT_KEYS,
    num_workers: int = 2,
    shuffle_shards: bool = True,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    epoch: int = 0,
    split_by_node: bool = True,
    last_batch: str = "partial",
    resampled: bool = False,
    epoch_batches: int | None = None,
    errors: ErrorCounter | None = None,
    timeout: tuple[float, float] = (10.0, 300.0),
    pin_memory: bool | None = None,
    prefetch_factor: int = 2,
    retries: int = 2,
    require_marker: bool = True,
) -> EtlLoader:
    """A loader of ``(images, labels, ...)`` batches (torch tensors) from ETL'd shard URLs.

    ``keys`` picks the tuple (webdataset ``to_tuple``; ``a;b`` means a, else b): by default the image
    ``.npy`` and the ``.cls`` label. ``last_batch``: ``partial`` (a smaller last batch per worker),
    ``drop``, or ``pad`` (repeat the last sample; a bool ``valid`` tensor is appended to each batch).
    ``shuffle_buffer``: about how many samples each worker mixes, held in ``shuffle_buffer /
    batch_size`` batches (rounded up, at least two) that fill at once; 0 or 1: stream order.
    ``resampled`` draws shards with replacement forever; ``epoch_batches`` then sets the epoch
    length (it also caps a finite stream, restarting it as needed). ``split_by_node`` splits shards by
    rank when ``WORLD_SIZE``/``torch.distributed`` say there are several (DDP). Workers beyond the
    number of shards this rank gets would have nothing to read: they are not started.

    Every shard must end with the ETL's end marker (``require_marker``; turn it off to read shards
    not written by this ETL, e.g. a source bucket directly). A shard cut short is read again up to
    ``retries`` times and continued after the samples already delivered; one still cut is an error
    (``errors`` counts it, naming the URL and how many of its samples arrived), never a shorter epoch.

    The loader resumes mid-epoch: save ``loader.state_dict()`` with the model, and after a restart
    ``loader.load_state_dict(state)`` makes the next ``iter()`` yield exactly the batches that would
    have followed (bit for bit with ``seed`` in the ETL's ``etl_args``, e.g. ``EpochUrls``). Restoring
    reads again only the shards that were open or had samples in a shuffle buffer, from the first
    sample needed (the ETL skips the ones before it).
    """
    if batch_size < 1:
        raise ValueError("make_loader: batch_size must be at least 1")
    if last_batch not in LAST_BATCH:
        raise ValueError(f"make_loader: last_batch {last_batch!r} is not one of {', '.join(LAST_BATCH)}")
    if resampled and epoch_batches is None:
        raise ValueError("make_loader: a resampled stream is endless; give epoch_batches")
    if epoch_batches is not None and epoch_batches < 1:
        raise ValueError("make_loader: epoch_batches must be at least 1")
    if retries < 0:
        raise ValueError("make_loader: retries must be non-negative")
    errors = errors or ErrorCounter()
    rank, world, _, _ = pytorch_worker_info()
    if not resampled:
        count = len(epoch_urls(urls, epoch))
        mine = len(range(rank, count, world)) if split_by_node else count
        if mine == 0:
            raise ClientError(f"rank {rank} of {world} gets no shard out of {count}; use fewer ranks or more shards")
        if num_workers > mine:
            log.info("using %d loader workers, not %d: this rank reads %d shards", mine, num_workers, mine)
            num_workers = mine
    config = LoaderConfig(urls=urls, keys=tuple(keys), batch_size=batch_size, last_batch=last_batch, seed=seed,
                     shuffle_shards=shuffle_shards, shuffle_buffer=shuffle_buffer if shuffle_buffer > 1 else 0,
                     resampled=resampled, epoch_batches=epoch_batches, split_by_node=split_by_node, rank=rank,
                     world_size=world, streams=max(1, num_workers))
    streams = _Streams(config, errors, ShardReader(timeout=timeout, retries=retries, require_marker=require_marker))
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    dataloader = torch.utils.data.DataLoader(
        streams,
        batch_size=None,  # batches are built in the workers (fewer, larger IPC messages)
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,  # restarted per epoch, so they see the new epoch (see EtlLoader)
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
    return EtlLoader(dataloader, streams, errors, epoch_batches, num_workers, epoch)
