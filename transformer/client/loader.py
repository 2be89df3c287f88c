"""The consuming side: a webdataset ``WebLoader`` over ETL'd shards, batched inside the workers.

Pipeline, per DataLoader worker (webdataset ``DataPipeline`` stages)::

    shard list (epoch URLs, seeded shard shuffle, identical on every rank and worker)
      -> split_by_node -> split_by_worker          (or: seeded resampling, for endless streams)
      -> open over HTTP -> tar members -> samples   (webdataset tariterators)
      -> seeded shuffle buffer -> decode .npy/.cls -> to_tuple(keys) -> batch

The shard order is shuffled *before* it is split, with a seed shared by all ranks and workers, so
each shard is read exactly once per epoch across the whole job. Errors go to ``ErrorCounter``, which
counts (across worker processes), logs the first few and skips: webdataset's ``warn_and_continue``
sleeps 0.5 s per error (performance doc section 1.2).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import webdataset as wds
from webdataset.filters import default_collation_fn, pipelinefilter
from webdataset.utils import pytorch_worker_info

from .errors import ClientError
from .reading import open_shard, whole_samples

log = logging.getLogger("transformer.client")

LAST_BATCH = ("partial", "drop", "pad")
DEFAULT_KEYS = ("npy;image.npy", "cls")


class ErrorCounter:
    """A webdataset handler that counts errors across worker processes, logs a few, and skips.

    ``max_errors`` turns a flood of errors (a dead endpoint, a wrong ETL name) into one exception
    instead of an empty epoch. Shared memory, so it must be created before the workers start.
    """

    def __init__(self, log_first: int = 10, max_errors: int | None = None):
        self._count = multiprocessing.get_context().Value("q", 0)
        self.log_first = log_first
        self.max_errors = max_errors

    @property
    def count(self) -> int:
        return self._count.value

    def reset(self) -> None:
        with self._count.get_lock():
            self._count.value = 0

    def __call__(self, exc: BaseException) -> bool:
        with self._count.get_lock():
            self._count.value += 1
            seen = self._count.value
        if seen <= self.log_first:
            log.warning("skipped after error %d: %s", seen, _describe(exc))
        if self.max_errors is not None and seen > self.max_errors:
            raise ClientError(f"more than {self.max_errors} loader errors; the last: {_describe(exc)}") from exc
        return True


def _describe(exc: BaseException) -> str:
    parts = [str(a) for a in exc.args if isinstance(a, (str, int)) and str(a)]
    text = "; ".join(parts) if parts else exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"[:500]


class ShardList(wds.utils.PipelineStage):
    """The epoch's shard URLs as ``{"url": ...}`` dicts: shuffled, then split by node and worker.

    ``urls`` is a list or a callable ``epoch -> list`` (e.g. ``EpochUrls``, whose etl_args carry the
    epoch). With ``resampled`` each worker draws shards at random, with replacement, forever (seeded
    per rank and worker); pair it with an epoch length.
    """

    def __init__(self, urls: Sequence[str] | Callable[[int], Sequence[str]], *, shuffle: bool, seed: int,
                 split_nodes: bool, resampled: bool = False):
        self.urls = urls
        self.shuffle = shuffle
        self.seed = seed
        self.split_nodes = split_nodes
        self.resampled = resampled
        self.epoch = 0

    def epoch_urls(self) -> list[str]:
        urls = list(self.urls(self.epoch) if callable(self.urls) else self.urls)
        if not urls:
            raise ClientError("no shard URLs for this epoch")
        return urls

    def run(self) -> Iterator[dict[str, str]]:
        urls = self.epoch_urls()
        rank, world, worker, workers = pytorch_worker_info()
        if self.resampled:
            rng = random.Random(_mix(self.seed, self.epoch, rank, worker))
            while True:
                yield {"url": rng.choice(urls)}
        if self.shuffle:
            random.Random(_mix(self.seed, self.epoch)).shuffle(urls)  # the same order on every rank/worker
        if self.split_nodes and world > 1:
            urls = urls[rank::world]
        for url in urls[worker::workers]:
            yield {"url": url}


def _mix(*values: int) -> str:
    """A seed for ``random.Random`` from several integers; str seeds are hashed with SHA-512, so every
    process derives the same generator (unlike ``hash``, which is salted per process for str)."""
    return ":".join(str(v) for v in values)


def _samples(data: Iterable[dict[str, Any]], handler: Callable[[BaseException], bool],
             timeout: tuple[float, float], retries: int = 2, require_marker: bool = True) -> Iterator[dict[str, Any]]:
    """Each shard's samples, whole (``reading.whole_samples``: end marker checked, a cut shard continued)."""
    return whole_samples(data, handler, opener=functools.partial(open_shard, timeout=timeout), retries=retries,
                         require_marker=require_marker)


def _seeded_shuffle(data: Iterable[Any], bufsize: int, seed: int, stage: ShardList) -> Iterator[Any]:
    """webdataset's shuffle buffer, seeded per (seed, epoch, rank, worker): reproducible, not repeated."""
    rank, _, worker, _ = pytorch_worker_info()
    seeded = _mix(seed, stage.epoch, rank, worker)
    return wds.filters._shuffle(iter(data), bufsize=bufsize, initial=bufsize, seed=seeded)


def _batches(data: Iterable[tuple], batch_size: int, last_batch: str) -> Iterator[tuple]:
    """Batches of ``batch_size``; the last one partial, dropped, or padded by repeating its last sample.

    With ``pad`` every batch gets one more element, a bool tensor marking the real samples, so that
    metrics can ignore the repeated ones.
    """
    batch: list[tuple] = []
    for sample in data:
        batch.append(sample)
        if len(batch) == batch_size:
            yield _collate(batch, batch_size if last_batch == "pad" else None)
            batch = []
    if batch and last_batch == "partial":
        yield _collate(batch, None)
    elif batch and last_batch == "pad":
        real = len(batch)
        batch.extend([batch[-1]] * (batch_size - real))
        yield _collate(batch, real)


def _collate(batch: list[tuple], real: int | None) -> tuple:
    collated = tuple(default_collation_fn(batch))
    if real is None:
        return collated
    valid = np.zeros(len(batch), dtype=bool)
    valid[:real] = True
    return (*collated, valid)


class EtlLoader:
    """An iterable of batches (tuples of tensors), one epoch per ``iter()``.

    Each ``iter()`` starts the next epoch (``set_epoch`` to choose it, as with ``DistributedSampler``):
    the epoch picks the shard order, the shuffle buffer's seed, and, with ``EpochUrls``, the ETL's
    augmentation draws. Workers are restarted per epoch so they see it. ``errors`` counts the samples
    and shards skipped so far.
    """

    def __init__(self, loader: wds.WebLoader, shards: ShardList, errors: ErrorCounter, batches: int | None,
                 num_workers: int):
        self.webloader = loader
        self.shards = shards
        self.errors = errors
        self.batches_per_epoch = batches
        self.num_workers = num_workers
        self._next_epoch = shards.epoch

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` yields."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError("set_epoch: epoch must be non-negative")
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[tuple]:
        self.shards.epoch = self._next_epoch  # copied into the workers when they start
        self._next_epoch += 1
        return iter(self.webloader)

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("this loader has no fixed length; give epoch_batches to make_loader")
        return self.batches_per_epoch


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
    ``resampled`` draws shards with replacement forever; ``epoch_batches`` then sets the epoch
    length (it also caps a finite stream, restarting it as needed). ``split_by_node`` splits shards by
    rank when ``WORLD_SIZE``/``torch.distributed`` say there are several (DDP). Workers beyond the
    number of shards this rank gets would have nothing to read: they are not started.

    Every shard must end with the ETL's end marker (``require_marker``; turn it off to read shards
    not written by this ETL, e.g. a source bucket directly). A shard cut short is read again up to
    ``retries`` times and continued after the samples already delivered; one still cut is an error
    (``errors`` counts it, naming the URL and how many of its samples arrived), never a shorter epoch.
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
    shards = ShardList(urls, shuffle=shuffle_shards, seed=seed, split_nodes=split_by_node, resampled=resampled)
    shards.epoch = epoch
    if not resampled:
        rank, world, _, _ = pytorch_worker_info()
        count = len(shards.epoch_urls())
        mine = len(range(rank, count, world)) if split_by_node and world > 1 else count
        if mine == 0:
            raise ClientError(f"rank {rank} of {world} gets no shard out of {count}; use fewer ranks or more shards")
        if num_workers > mine:
            log.info("using %d loader workers, not %d: this rank reads %d shards", mine, num_workers, mine)
            num_workers = mine

    stages: list[Any] = [
        shards,
        pipelinefilter(_samples)(errors, timeout, retries, require_marker),
    ]
    if shuffle_buffer > 1:
        stages.append(pipelinefilter(_seeded_shuffle)(shuffle_buffer, seed, shards))
    stages += [
        wds.decode(handler=errors),
        wds.to_tuple(*keys, handler=errors),
        pipelinefilter(_batches)(batch_size, last_batch),
    ]
    dataset = wds.DataPipeline(*stages)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    loader = wds.WebLoader(
        dataset,
        batch_size=None,  # batches are built in the workers (fewer, larger IPC messages)
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,  # restarted per epoch, so they see the new epoch (see EtlLoader)
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
    if epoch_batches is not None:
        loader = loader.with_epoch(epoch_batches)
    return EtlLoader(loader, shards, errors, epoch_batches, num_workers)
