"""Feed a DALI pipeline from ETL'd shards through ``fn.external_source`` (seed article 3, DALI's notebook).

DALI's own ``fn.readers.webdataset`` reads local tar files with index files; ETL'd shards are HTTP
streams, so the samples come in through ``external_source``. ``EtlBatchSource`` is the iterable it
consumes: each ``iter()`` is one epoch (its shards split DALI-style by ``shard_id``/``num_shards``,
read with the loader's opener, ``.npy``/``.cls`` decoded), shuffled in a seeded buffer, its last
batch optionally padded by repeating the last sample, and grouped into batches (a tuple with one list
of numpy arrays per key). ``read_etl_shards`` wires it into a pipeline with DALI's epoch semantics:
``cycle="raise"`` ends each epoch with ``StopIteration`` (call ``pipeline.reset()``), ``"quiet"``
starts the next epoch silently.

The generator helpers are written here rather than copied from the notebook: its ``buffered_shuffle``
fills the buffer with ``None`` holes and relies on ``initial_fill`` draws that can repeat a sample.
Everything but ``read_etl_shards`` works without DALI installed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .loader import DEFAULT_KEYS, ErrorCounter, _samples

CYCLES = ("raise", "quiet")


def buffered_shuffle(items: Iterable[Any], buffer_size: int, rng: random.Random) -> Iterator[Any]:
    """Each item exactly once, in an order drawn from a ``buffer_size`` window (seeded by ``rng``)."""
    if buffer_size < 1:
        raise ValueError("buffered_shuffle: buffer_size must be at least 1")
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


def pad_last_batch(items: Iterable[Any], batch_size: int) -> Iterator[Any]:
    """The items, then the last one repeated until the count is a multiple of ``batch_size``."""
    count, last = 0, None
    for item in items:
        count, last = count + 1, item
        yield item
    if count % batch_size:
        for _ in range(batch_size - count % batch_size):
            yield last


def collect_batches(samples: Iterable[tuple], batch_size: int) -> Iterator[tuple[list, ...]]:
    """Tuples of samples -> tuples of lists (one list per output), ``batch_size`` long but the last."""
    batch: list[tuple] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            yield tuple(map(list, zip(*batch)))
            batch = []
    if batch:
        yield tuple(map(list, zip(*batch)))


def etl_samples(urls: Sequence[str], keys: Sequence[str], errors: Callable[[BaseException], bool],
                timeout: tuple[float, float] = (10.0, 300.0), retries: int = 2,
                require_marker: bool = True) -> Iterator[tuple[np.ndarray, ...]]:
    """Decoded samples of ``urls`` in order, as tuples of numpy arrays (labels as 0-d int64 arrays).

    Shards are read whole, as the loader reads them (``reading.whole_samples``): a shard without the
    ETL's end marker is an error for ``errors``, and a cut one is read again from where it stopped.
    """
    from webdataset.filters import _decode, _to_tuple

    samples = _samples(({"url": url} for url in urls), errors, timeout, retries, require_marker)
    for values in _to_tuple(_decode(samples, handler=errors), *keys, handler=errors):
        yield tuple(np.asarray(value) for value in values)


class EtlBatchSource:
    """The iterable ``fn.external_source(source=..., batch=True)`` consumes; one ``iter()`` = one epoch.

    ``urls`` is a list or a callable ``epoch -> list`` (``EpochUrls``). Shards are split with
    ``shard_id``/``num_shards`` after a shuffle that every shard_id agrees on.
    """

    def __init__(
        self,
        urls: Sequence[str] | Callable[[int], Sequence[str]],
        batch_size: int,
        *,
        keys: Sequence[str] = DEFAULT_KEYS,
        random_shuffle: bool = False,
        initial_fill: int = 256,
        seed: int = 0,
        pad_last_batch: bool = False,
        shard_id: int = 0,
        num_shards: int = 1,
        errors: ErrorCounter | None = None,
        timeout: tuple[float, float] = (10.0, 300.0),
        retries: int = 2,
        require_marker: bool = True,
    ):
        if batch_size < 1:
            raise ValueError("EtlBatchSource: batch_size must be at least 1")
        if not 0 <= shard_id < num_shards:
            raise ValueError("EtlBatchSource: shard_id must be in [0, num_shards)")
        self.urls = urls
        self.batch_size = batch_size
        self.keys = tuple(keys)
        self.random_shuffle = random_shuffle
        self.initial_fill = initial_fill
        self.seed = seed
        self.pad = pad_last_batch
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.errors = errors or ErrorCounter()
        self.timeout = timeout
        self.retries = retries
        self.require_marker = require_marker
        self.epoch = 0

    def epoch_urls(self, epoch: int) -> list[str]:
        urls = list(self.urls(epoch) if callable(self.urls) else self.urls)
        if self.random_shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(urls)
        return urls[self.shard_id :: self.num_shards]

    def __iter__(self) -> Iterator[tuple[list, ...]]:
        epoch = self.epoch
        self.epoch += 1
        samples: Iterable[tuple] = etl_samples(self.epoch_urls(epoch), self.keys, self.errors, self.timeout,
                                                  self.retries, self.require_marker)
        if self.random_shuffle:
            rng = random.Random(f"{self.seed}:{epoch}:{self.shard_id}")
            samples = buffered_shuffle(samples, self.initial_fill, rng)
        if self.pad:
            samples = pad_last_batch(samples, self.batch_size)
        return collect_batches(samples, self.batch_size)


def read_etl_shards(
    urls: Sequence[str] | Callable[[int], Sequence[str]],
    *,
    keys: Sequence[str] = DEFAULT_KEYS,
    random_shuffle: bool = False,
    initial_fill: int = 256,
    seed: int = 0,
    pad_last_batch: bool = False,
    cycle: str = "raise",
    shard_id: int = 0,
    num_shards: int = 1,
    errors: ErrorCounter | None = None,
    require_marker: bool = True,
) -> Any:
    """Inside a ``@pipeline_def``: one DALI output per key, fed from ETL'd shards.

    ``cycle="raise"``: ``pipeline.run()`` raises ``StopIteration`` after the last batch of an
    epoch; ``pipeline.reset()`` starts the next one. ``"quiet"``: epochs follow each other silently.
    """
    import nvidia.dali as dali
    import nvidia.dali.fn as fn

    if cycle not in CYCLES:
        raise ValueError(f"read_etl_shards: cycle {cycle!r} is not one of {', '.join(CYCLES)}")
    batch_size = dali.pipeline.Pipeline.current().max_batch_size
    source = EtlBatchSource(urls, batch_size, keys=keys, random_shuffle=random_shuffle, initial_fill=initial_fill,
                            seed=seed, pad_last_batch=pad_last_batch, shard_id=shard_id, num_shards=num_shards,
                            errors=errors, require_marker=require_marker)
    return fn.external_source(source=source, num_outputs=len(source.keys), batch=True, cycle=cycle)
