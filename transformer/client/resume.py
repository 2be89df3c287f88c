"""Resume state: where a loader is, as plain JSON data, and the checks a saved state must pass.

Each batch a worker sends carries that worker's stream state right after it (``Snapshot``: which
shard, how many of its samples, the open batches' samples by key, the draws made). The loader keeps
the last one per worker and the number of batches yielded (``LoaderPosition``); ``state_dict()`` is that
(``state_of``), ``load_state_dict()`` starts the next ``iter()`` where it was (``position_of``). A
state is refused, naming each difference, when the loader was made with another configuration
(``LoaderConfig``: everything an epoch's batches depend on) or when this version does not read it. The
DataLoader hands batches out round-robin over its workers, skipping the ones that are done, and
restarts its cycle at worker 0: so after a batch of worker w, the resumed DataLoader's worker j runs
the stream of worker (w + 1 + j) mod W.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .epoch import epoch_urls, urls_digest
from .errors import LoaderStateError
from .stream import check_snapshot, plain

STATE_FORMAT = "ais-wds-loader-state/2"


class Snapshot:
    """A worker's stream state right after one of its batches, and the shared-memory slots of the
    batch's tensors as (column, slot); travels with the batch, untouched by the DataLoader's
    conversions (they do not look into objects of other types)."""

    __slots__ = ("worker", "state", "slots")

    def __init__(self, worker: int, state: dict[str, Any], slots: tuple[tuple[int, int], ...] = ()):
        self.worker = worker
        self.state = state
        self.slots = slots

    def __reduce__(self):
        return Snapshot, (self.worker, self.state, self.slots)


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Everything the batches of an epoch depend on, except the epoch."""

    urls: Sequence[str] | Callable[[int], Sequence[str]]
    keys: tuple[str, ...]
    batch_size: int
    last_batch: str
    seed: int
    shuffle_shards: bool
    shuffle_buffer: int
    resampled: bool
    epoch_batches: int | None
    split_by_node: bool
    rank: int
    world_size: int
    streams: int  # logical workers: max(1, num_workers)

    @property
    def open_batches(self) -> int:
        """Batches filled at once (Batcher): as many as hold ``shuffle_buffer`` samples, at least two to
        shuffle at all; one without a shuffle buffer."""
        return 1 if self.shuffle_buffer <= 1 else max(2, -(-self.shuffle_buffer // self.batch_size))

    def fingerprint(self, epoch: int) -> dict[str, Any]:
        """What a saved state must match (JSON-able)."""
        urls = epoch_urls(self.urls, epoch)
        return {"urls": urls_digest(urls), "shards": len(urls), "seed": self.seed, "batch_size": self.batch_size,
                "workers": self.streams, "shuffle_buffer": self.shuffle_buffer, "shuffle_shards": self.shuffle_shards,
                "last_batch": self.last_batch, "keys": list(self.keys), "resampled": self.resampled,
                "epoch_batches": self.epoch_batches, "split_by_node": self.split_by_node, "rank": self.rank,
                "world_size": self.world_size}


@dataclasses.dataclass
class LoaderPosition:
    """Where a loader is: in ``epoch``, after ``batches`` batches (in pass ``passes`` of a finite stream
    that ``epoch_batches`` restarts), the next one from logical worker ``next_worker``; ``workers``
    holds each worker's state after its last batch."""

    epoch: int
    batches: int = 0
    passes: int = 0
    next_worker: int = 0
    workers: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    finished: bool = False

    def copy(self) -> LoaderPosition:
        return dataclasses.replace(self, workers=dict(self.workers))


def state_of(position: LoaderPosition, config: LoaderConfig) -> dict[str, Any]:
    """A loader's state at ``position``, as plain JSON data (``EtlLoader.state_dict``)."""
    return {
        "format": STATE_FORMAT,
        "kind": "make_loader",
        "epoch": position.epoch,
        "batches": position.batches,
        "passes": position.passes,
        "next_worker": position.next_worker,
        "workers": [plain(position.workers[w]) for w in sorted(position.workers)],
        "config": config.fingerprint(position.epoch),
    }


def position_of(state: Any, config: LoaderConfig) -> LoaderPosition:
    """Where a saved state of ``make_loader``'s resumes (``EtlLoader.load_state_dict``); ``LoaderStateError``,
    naming each difference, for a state of another configuration or one this version does not read."""
    epoch = check_state(state, "make_loader")
    check_fingerprint(state, config.fingerprint(epoch))
    batches, passes, next_worker = (state_count(state, name) for name in ("batches", "passes", "next_worker"))
    if next_worker >= config.streams:
        raise LoaderStateError(f"loader state: next_worker {next_worker} is not one of {config.streams} workers")
    workers: dict[int, dict[str, Any]] = {}
    urls = state["config"]["shards"]
    for worker_state in _list(state, "workers"):
        worker = worker_state.get("worker") if isinstance(worker_state, dict) else None
        if not isinstance(worker, int) or not 0 <= worker < config.streams or worker in workers:
            raise LoaderStateError(f"loader state: worker entry {str(worker_state)[:80]} names no worker "
                                   f"of {config.streams}, or one twice")
        problem = (check_snapshot(worker_state, urls, config.open_batches * config.batch_size)
                   or _check_count(worker_state, "batches") or _check_open(worker_state, config))
        if problem:
            raise LoaderStateError(f"loader state: worker {worker}: {problem}")
        workers[worker] = plain(worker_state)
    return LoaderPosition(epoch, batches, passes, next_worker, workers)


def check_state(state: Any, kind: str) -> int:
    """The epoch of a saved state of this ``kind``; ``LoaderStateError`` unless this version reads it."""
    if not isinstance(state, dict) or not isinstance(state.get("format"), str):
        raise LoaderStateError("not a loader state: no 'format' (give what state_dict() returned)")
    name, _, version = state["format"].rpartition("/")
    ours, _, current = STATE_FORMAT.rpartition("/")
    if name != ours or not version.isdigit():
        raise LoaderStateError(f"not a loader state: format {state['format']!r} (this version reads {STATE_FORMAT!r})")
    if int(version) != int(current):
        age = "an older" if int(version) < int(current) else "a newer"
        raise LoaderStateError(f"a loader state in {age} format ({state['format']!r}); this version reads only "
                               f"{STATE_FORMAT!r}: start the epoch from its beginning (set_epoch) instead")
    if state.get("kind") != kind:
        raise LoaderStateError(f"a state of {state.get('kind')!r}, not of {kind!r}")
    return state_count(state, "epoch")


def check_fingerprint(state: dict[str, Any], mine: dict[str, Any]) -> None:
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise LoaderStateError("loader state: no 'config'")
    differences = []
    for name, value in mine.items():
        if name == "shards":
            continue
        if name == "urls":
            if saved.get("urls") != value:
                differences.append(f"urls (the epoch's {saved.get('shards')} shard URLs were saved, this loader "
                                   f"reads {mine['shards']} others: digest {saved.get('urls')} vs {value}; an "
                                   "EpochUrls made without seed= draws a new seed in every run)")
        elif saved.get(name, "missing") != value:
            differences.append(f"{name} (saved {saved.get(name, 'missing')!r}, this loader {value!r})")
    unknown = sorted(set(saved) - set(mine))
    if unknown:
        differences.append(f"unknown fields {', '.join(unknown)}")
    if differences:
        raise LoaderStateError(f"refusing a loader state made with another configuration: {'; '.join(differences)}")


def state_count(state: dict[str, Any], name: str) -> int:
    problem = _check_count(state, name)
    if problem:
        raise LoaderStateError(f"loader state: {problem}")
    return state[name]


def _check_count(state: dict[str, Any], name: str) -> str | None:
    value = state.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return f"'{name}' is not a non-negative integer"
    return None


def _check_open(state: dict[str, Any], config: LoaderConfig) -> str | None:
    """What is wrong with a worker state's open batches (None: nothing)."""
    rows = state.get("open")
    if (not isinstance(rows, list) or len(rows) != config.open_batches
            or not all(type(n) is int and 0 <= n < config.batch_size for n in rows)):
        return f"'open' is not a list of {config.open_batches} row counts below {config.batch_size}"
    if sum(rows) != len(state["buffer"]):
        return f"'open' counts {sum(rows)} rows, 'buffer' names {len(state['buffer'])} samples"
    return None


def _list(state: dict[str, Any], name: str) -> list[Any]:
    value = state.get(name)
    if not isinstance(value, list):
        raise LoaderStateError(f"loader state: '{name}' is not a list")
    return value
