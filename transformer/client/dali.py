"""Feed a DALI pipeline from ETL'd shards through ``fn.external_source`` (as in DALI's WebDataset notebook).

DALI's own ``fn.readers.webdataset`` reads local tar files with index files; ETL'd shards are HTTP
streams, so the samples come in through ``external_source``. ``EtlBatchSource`` is the iterable it
consumes: each ``iter()`` is one epoch, one ``stream.SampleStream`` (its shards split DALI-style by
``shard_id``/``num_shards`` after a shuffle every shard_id agrees on, read whole as the loader reads
them, shuffled in a seeded buffer, ``.npy``/``.cls`` decoded), its last batch optionally padded by
repeating the last sample, grouped into batches (a tuple with one list of numpy arrays per key).
``read_etl_shards`` wires it into a pipeline with DALI's epoch semantics: ``cycle="raise"`` ends each
epoch with ``StopIteration`` (call ``pipeline.reset()``), ``"quiet"`` starts the next epoch silently.

The source resumes as the loader does (``state_dict``/``load_state_dict``). DALI asks its source for
batches ahead of the ones ``pipeline.run()`` returned (``prefetch_queue_depth``), so the source keeps
its state after each of the last batches it made: ``state_dict(epoch=e, batches=k)`` is the state
after the k-th batch of epoch e, the last one the training step got.
Everything but ``read_etl_shards`` works without DALI installed.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .epoch import ErrorCounter, epoch_urls, shard_order, urls_digest
from .errors import LoaderStateError
from .loader import DEFAULT_KEYS
from .resume import STATE_FORMAT, check_fingerprint, check_state, state_count
from .stream import SampleStream, ShardReader, StreamSpec, check_snapshot, generator_key, plain

CYCLES = ("raise", "quiet")
HISTORY = 64  # states kept of the last batches made: DALI reads a few ahead (prefetch_queue_depth)


@dataclasses.dataclass
class _Position:
    epoch: int
    batches: int = 0
    stream: dict[str, Any] | None = None  # the stream's state after the last batch (None: the epoch's start)
    finished: bool = False


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
        if random_shuffle and initial_fill < 1:
            raise ValueError("EtlBatchSource: initial_fill must be at least 1")
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
        self.reader = ShardReader(timeout=timeout, retries=retries, require_marker=require_marker)
        self.epoch = 0  # the epoch the next iter() yields
        self._progress: _Position | None = None
        self._pending: _Position | None = None
        self._history: deque[tuple[int, int, dict[str, Any]]] = deque(maxlen=HISTORY)

    def epoch_urls(self, epoch: int) -> list[str]:
        """This shard_id's URLs of ``epoch``, in reading order."""
        urls = epoch_urls(self.urls, epoch)
        return [urls[i] for i in self._order(len(urls), epoch)]

    def _order(self, count: int, epoch: int) -> tuple[int, ...]:
        return shard_order(count, shuffle=self.random_shuffle, seed=self.seed, epoch=epoch, part=self.shard_id,
                           parts=self.num_shards)

    def _spec(self, epoch: int) -> StreamSpec:
        urls = epoch_urls(self.urls, epoch)
        key = (self.seed, epoch, self.shard_id)
        return StreamSpec(urls, self._order(len(urls), epoch), generator_key(*key, "shards"),
                          generator_key(*key, "buffer"), self.initial_fill if self.random_shuffle else 0, self.keys)

    def __iter__(self) -> Iterator[tuple[list, ...]]:
        epoch = self.epoch
        pending, self._pending = self._pending, None
        position = pending if pending is not None and pending.epoch == epoch else _Position(epoch)
        self.epoch = epoch + 1
        self._progress = position
        return self._batches(position)

    def _batches(self, position: _Position) -> Iterator[tuple[list, ...]]:
        stream = SampleStream(self._spec(position.epoch), self.reader, self.errors, position.stream)
        batch: list[tuple[np.ndarray, ...]] = []
        for values in stream.tuples():
            batch.append(tuple(np.asarray(value) for value in values))  # labels: 0-d int64 arrays
            if len(batch) == self.batch_size:
                yield self._made(position, stream, batch)
                batch = []
        if batch:
            if self.pad:
                batch.extend([batch[-1]] * (self.batch_size - len(batch)))
            yield self._made(position, stream, batch)
        position.finished = True

    def _made(self, position: _Position, stream: SampleStream, batch: list[tuple]) -> tuple[list, ...]:
        position.batches += 1
        position.stream = stream.snapshot()
        self._history.append((position.epoch, position.batches, position.stream))
        return tuple(map(list, zip(*batch)))

    # ---- state --------------------------------------------------------------------------------------

    def _fingerprint(self, epoch: int) -> dict[str, Any]:
        urls = epoch_urls(self.urls, epoch)
        return {"urls": urls_digest(urls), "shards": len(urls), "seed": self.seed, "batch_size": self.batch_size,
                "keys": list(self.keys), "random_shuffle": self.random_shuffle,
                "initial_fill": self.initial_fill if self.random_shuffle else 0, "pad_last_batch": self.pad,
                "shard_id": self.shard_id, "num_shards": self.num_shards}

    def state_dict(self, *, epoch: int | None = None, batches: int | None = None) -> dict[str, Any]:
        """The source's state: after the last batch it made, or (``epoch``, ``batches``) after the
        ``batches``-th batch of ``epoch`` (one of the last 64 it made): the last one the training step got,
        since DALI asks for batches ahead of the ones ``pipeline.run()`` returned."""
        if epoch is None and batches is None:
            position = self._position()
        elif epoch is None or batches is None or epoch < 0 or batches < 0:
            raise ValueError("EtlBatchSource.state_dict: give epoch and batches (non-negative), or neither")
        elif batches == 0:
            position = _Position(epoch)
        else:
            found = [state for e, b, state in self._history if (e, b) == (epoch, batches)]
            if not found:
                raise ValueError(f"EtlBatchSource.state_dict: the state after batch {batches} of epoch {epoch} is "
                                 f"not held (the last {HISTORY} batches made are)")
            position = _Position(epoch, batches, found[-1])
        return {"format": STATE_FORMAT, "kind": "EtlBatchSource", "epoch": position.epoch,
                "batches": position.batches, "stream": plain(position.stream),
                "config": self._fingerprint(position.epoch)}

    def _position(self) -> _Position:
        if self._pending is not None:
            return dataclasses.replace(self._pending)
        progress = self._progress
        if progress is None or progress.finished:
            return _Position(self.epoch)
        return dataclasses.replace(progress)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next ``iter()`` yields the rest of the saved epoch, exactly. Refused (``LoaderStateError``)
        for another configuration (URLs, seed, batch size, shuffle, padding, shard_id/num_shards) or format."""
        epoch = check_state(state, "EtlBatchSource")
        check_fingerprint(state, self._fingerprint(epoch))
        batches = state_count(state, "batches")
        stream = state.get("stream")
        if stream is not None:
            problem = check_snapshot(stream, state["config"]["shards"], self.initial_fill if self.random_shuffle else 0)
            if problem:
                raise LoaderStateError(f"loader state: stream: {problem}")
        self._pending = _Position(epoch, batches, plain(stream))
        self._progress = None
        self.epoch = epoch


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
