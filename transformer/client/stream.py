"""One resumable stream of samples: the shards it reads, its shuffle buffer, and the state that restores it.

``make_loader`` runs one stream per DataLoader worker, the DALI source one per ``shard_id``. A stream
reads its shards in order (or draws them with replacement), passes their samples through a shuffle
buffer, and decodes them with webdataset's decoder and ``to_tuple``. Between two samples its whole
state is small, and ``snapshot()`` returns it as JSON-able data:

* ``shard``: the shard samples were last taken from (its number in the stream's list, or the draw's
  number when shards are resampled), ``taken``: how many of its samples, ``last``: the key of the
  last one; ``ended``: no shard is left;
* ``buffer``: the shuffle buffer's samples, in order, as ``[URL index, position in the shard, key]``
  (the URL index is into the epoch's URL list); ``draws``: how many samples were picked from it.

Random choices are counter-based: draw ``n`` is a keyed hash of ``n``, so a generator's state is a
count. A stream made from a snapshot continues exactly where the first one was. It reads again only
what it needs: each shard the buffer holds samples of (from the first of them to the last) and the
open shard from its last sample taken on, one read for both when they are the same shard. A URL that
goes through the ETL is asked to pass over the samples before them (``etl_args`` ``skip``): they are
neither transformed nor sent. Other URLs, and an ETL that refuses ``skip`` (an older version), are read
from their start and those samples dropped here.
Every sample read again must have the key the snapshot names.

Positions count the samples a whole read of the shard yields. The ETL's ``skip`` counts its input
samples, which may be more (a sample it could not transform is left out under ``on_error=skip``), so
a skipped read may start earlier than asked: the first sample needed is found by its key (keys are
unique within a shard, as webdataset expects).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

from webdataset import autodecode
from webdataset.autodecode import Decoder

from .errors import ResumeError, SampleError, ShardFetchError
from .reading import MalformedMember, Place, open_shard, whole_shard_samples
from .urls import is_etl_url, with_skip

log = logging.getLogger("transformer.client")

Handler = Callable[[BaseException], bool]
Entry = tuple[int, int, dict[str, Any]]  # URL index, position in the shard, the sample



def generator_key(*parts: object) -> bytes:
    """The key of one generator of draws: the same in every process (unlike ``hash`` of a str)."""
    return hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()


def draw(key: bytes, number: int, n: int) -> int:
    """Draw ``number`` of the generator ``key``: an integer in [0, n) (128 bits reduced mod n)."""
    digest = hashlib.blake2b(number.to_bytes(8, "little"), digest_size=16, key=key).digest()
    return int.from_bytes(digest, "little") % n


class Placer(Protocol):
    """Where a stream's arrays are read to: the next batch row, or None for an array of their own."""

    def place(self, fields: dict, extension: str, shape: tuple, dtype: Any) -> Any:
        ...


class Reader(Protocol):
    def read(self, url: str, start: int = 0, anchor: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        ...


@dataclass(frozen=True)
class ShardReader:
    """Reads a shard whole (``reading.whole_shard_samples``), from its start or from a given sample on."""

    timeout: tuple[float, float] = (10.0, 300.0)
    retries: int = 2
    require_marker: bool = True
    arrays: bool = True  # .npy members as arrays, read in one copy (reading.shard_samples)
    place: Place | None = None  # where they go (a batch row), for a stream without a shuffle buffer

    def samples(self, url: str, shown: str | None = None) -> Iterator[dict[str, Any]]:
        opener = functools.partial(open_shard, timeout=self.timeout)
        samples = whole_shard_samples(url, opener=opener, retries=self.retries, require_marker=self.require_marker,
                                      arrays=self.arrays, place=self.place)
        return samples if shown is None else self._shown(samples, shown)

    @staticmethod
    def _shown(samples: Iterator[dict[str, Any]], shown: str) -> Iterator[dict[str, Any]]:
        for sample in samples:
            sample["__url__"] = shown
            yield sample

    def pod_skips(self, url: str) -> bool:
        """Whether the ETL can skip this URL's first samples: it reads through the ETL, and its shards
        are this ETL's (the end marker is required)."""
        return self.require_marker and is_etl_url(url)

    def read(self, url: str, start: int = 0, anchor: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(position, sample)`` from sample ``start`` on, whose key must be ``anchor``."""
        if start == 0:
            return enumerate(self.samples(url))
        return self._read_from(url, start, anchor)

    def _read_from(self, url: str, start: int, anchor: str | None) -> Iterator[tuple[int, dict[str, Any]]]:
        if self.pod_skips(url):
            samples = self.samples(with_skip(url, start), shown=url)
            try:
                first = next(samples, None)
            except ShardFetchError as exc:
                if exc.status != 400 or "'skip'" not in exc.reason:
                    raise
                log.warning("%s: the ETL refuses etl_args 'skip' (an older version?); reading the shard from its "
                            "start instead", url)
            else:
                yield from self._skipped(url, start, anchor, chain([] if first is None else [first], samples))
                return
        reached = False
        for position, sample in enumerate(self.samples(url)):
            if position == start:
                if sample["__key__"] != anchor:
                    raise ResumeError(url, f"sample {start} is '{sample['__key__']}', not '{anchor}'")
                reached = True
            if reached:
                yield position, sample
        if not reached:
            raise ResumeError(url, f"it has {start} samples or fewer; sample '{anchor}' (number {start}) is gone")

    @staticmethod
    def _skipped(url: str, start: int, anchor: str | None, samples: Iterator[dict[str, Any]]
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
        """A read the ETL began at input sample ``start``: it may hold samples before ``anchor`` (one it
        could not transform was left out earlier in the shard), which were delivered already."""
        position = None
        for sample in samples:
            if position is None:
                if sample["__key__"] != anchor:
                    continue
                position = start
            yield position, sample
            position += 1
        if position is None:
            raise ResumeError(url, f"sample '{anchor}' (number {start}) is not in it")


@dataclass(frozen=True)
class StreamSpec:
    """What one stream reads in one epoch, and how."""

    urls: tuple[str, ...]  # the epoch's shard URLs; samples name their shard by its index here
    order: tuple[int, ...] | None  # the URL indices this stream reads, in order; None: drawn with replacement
    shard_key: bytes  # the generator of shard draws (resampled)
    buffer_key: bytes  # the generator of buffer picks
    buffer: int  # the shuffle buffer's size; 0 or 1: no shuffle
    keys: tuple[str, ...]  # webdataset to_tuple keys


class SampleStream:
    """The stream's decoded sample tuples (``tuples()``), once; ``snapshot()`` between two of them."""

    def __init__(self, spec: StreamSpec, reader: Reader, handler: Handler, state: dict[str, Any] | None = None):
        self.spec = spec
        self.reader = reader
        self.handler = handler
        self.shard = 0
        self.index = 0  # the URL index of the shard samples were last taken from
        self.taken = 0
        self.last: str | None = None
        self.ended = False
        self.draws = 0
        self.buffer: list[Entry] = []
        self._ids: list[tuple[int, int, str]] = []  # the buffer's samples by identity, in the same order
        self._state = state
        self._open: Iterator[tuple[int, dict[str, Any]]] | None = None  # the restored open shard's rest
        self.placer: Placer | None = None  # where arrays are read to (the batcher), see place()
        self._restoring = False

    def url_index(self, shard: int) -> int | None:
        """The URL index of the stream's shard number ``shard`` (None: the stream has no more)."""
        if self.spec.order is None:
            return draw(self.spec.shard_key, shard, len(self.spec.urls))
        return self.spec.order[shard] if shard < len(self.spec.order) else None

    def snapshot(self) -> dict[str, Any]:
        """The state, cheap enough to take after every batch (JSON gives the buffer's tuples as lists)."""
        return {"shard": self.shard, "taken": self.taken, "last": self.last, "ended": self.ended,
                "draws": self.draws, "buffer": list(self._ids)}

    def identity(self) -> tuple[int, int, str]:
        """The last sample taken from the shards: (URL index, position in its shard, key)."""
        return self.index, self.taken - 1, self.last  # type: ignore[return-value]

    def restore(self) -> list[Entry]:
        """Restore a saved state now (else the first sample does): the samples its ``buffer`` names are
        read again. A stream without a shuffle buffer hands them over (to the batches that held them)."""
        if self._state is not None:
            state, self._state = self._state, None
            self._restore(state)
        if self.spec.buffer > 1:
            return []
        held, self.buffer, self._ids = self.buffer, [], []
        return held

    def tuples(self) -> Iterator[tuple]:
        """Picked by ``keys`` and decoded (``.npy``, ``.cls``, ...); samples that fail go to the handler."""
        return sample_tuples(self.samples(), self.spec.keys, self.handler)

    def samples(self) -> Iterator[dict[str, Any]]:
        """The raw samples, shuffled: each one is taken into the buffer, and once it is full one is picked."""
        self.restore()
        size = self.spec.buffer
        if size <= 1:
            for _, _, sample in self._source():
                yield sample
            return
        buffer, ids = self.buffer, self._ids
        for entry in self._source():
            buffer.append(entry)
            ids.append((entry[0], entry[1], entry[2]["__key__"]))
            if len(buffer) >= size:
                yield self._pick()
        while buffer:
            yield self._pick()

    def place(self, fields: dict, extension: str, shape: tuple, dtype: Any) -> Any:
        """The reader's ``place`` hook: the batch row for an array, from the ``placer`` (the batcher),
        when samples go from the reader to their batch at once (no shuffle buffer); else None: an
        array of its own, for a sample that waits in the buffer."""
        if self.placer is None or self._restoring or self.spec.buffer > 1:
            return None
        return self.placer.place(fields, extension, shape, dtype)

    def _pick(self) -> dict[str, Any]:
        """webdataset's pick: a drawn slot is taken out, the last sample moves into it."""
        buffer, ids = self.buffer, self._ids
        k = draw(self.spec.buffer_key, self.draws, len(buffer))
        self.draws += 1
        entry = buffer[k]
        buffer[k], ids[k] = buffer[-1], ids[-1]
        buffer.pop()
        ids.pop()
        return entry[2]

    def _source(self) -> Iterator[Entry]:
        shard = self.shard
        if self._open is not None:
            rest, self._open = self._open, None
            yield from self._shard(shard, self.url_index(shard), rest)  # type: ignore[arg-type]
            shard += 1
        elif self.taken:  # restored, and the open shard could not be read again: the next one
            shard += 1
        while not self.ended and (index := self.url_index(shard)) is not None:
            yield from self._shard(shard, index, self.reader.read(self.spec.urls[index]))
            shard += 1
        self.ended = True

    def _shard(self, shard: int, index: int, samples: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[Entry]:
        try:
            self.index = index
            for position, sample in samples:
                self.shard, self.taken, self.last = shard, position + 1, sample["__key__"]
                yield index, position, sample
        except Exception as exc:
            if not self.handler(exc):
                self.ended = True

    # ---- restore ------------------------------------------------------------------------------------

    def _restore(self, state: dict[str, Any]) -> None:
        self._restoring = True
        try:
            self._restore_from(state)
        finally:
            self._restoring = False

    def _restore_from(self, state: dict[str, Any]) -> None:
        self.shard, self.taken, self.last = state["shard"], state["taken"], state["last"]
        self.ended, self.draws = state["ended"], state["draws"]
        entries = [(index, position, key) for index, position, key in state["buffer"]]
        wanted: dict[int, dict[int, str]] = {}
        for index, position, key in entries:
            wanted.setdefault(index, {})[position] = key
        open_index = None if self.ended or not self.taken else self.url_index(self.shard)
        got: dict[tuple[int, int], dict[str, Any]] = {}
        for index, positions in wanted.items():
            if index != open_index:
                self._read_again(index, positions, got)
        if open_index is not None:
            positions = {**wanted.get(open_index, {})}
            positions.setdefault(self.taken - 1, self.last)  # type: ignore[arg-type]
            self._open = self._read_again(open_index, positions, got, rest_from=self.taken)
        # A resampled shard drawn twice may have put the same sample in twice: each gets its own dict.
        self.buffer = [(index, position, dict(got[index, position])) for index, position, _ in entries
                       if (index, position) in got]
        self._ids = [(index, position, sample["__key__"]) for index, position, sample in self.buffer]

    def _read_again(self, index: int, positions: dict[int, str], got: dict[tuple[int, int], dict[str, Any]],
                    rest_from: int | None = None) -> Iterator[tuple[int, dict[str, Any]]] | None:
        """Read the samples at ``positions`` (checking their keys) into ``got``, in one read of the shard
        from the first of them; with ``rest_from``, return that read's samples from there on."""
        url = self.spec.urls[index]
        first = min(positions)
        until = max(positions) if rest_from is None else max(max(positions), rest_from - 1)
        samples = self.reader.read(url, first, positions[first])
        ahead: list[tuple[int, dict[str, Any]]] = []
        try:
            for position, sample in samples:
                expected = positions.get(position)
                if expected is not None:
                    if sample["__key__"] != expected:
                        raise ResumeError(url, f"sample {position} is '{sample['__key__']}', not '{expected}'")
                    got[index, position] = sample
                if rest_from is not None and position >= rest_from:
                    ahead.append((position, sample))
                if position >= until:
                    break
            else:
                raise ResumeError(url, f"it ends before sample {until}, which the saved state holds")
        except Exception as exc:
            _close(samples)
            if not self.handler(exc):
                self.ended = True
            return None
        if rest_from is None:
            _close(samples)
            return None
        return chain(ahead, samples)


_DECODER = Decoder([])  # webdataset's default decoders: cls -> int, txt, json, npy (bytes), pth, ...
_DECODERS: dict[str, Callable[[bytes], Any]] = {}


def _decoder(name: str) -> Callable[[bytes], Any]:
    """What ``_DECODER.decode1(name, data)`` runs for ``name`` (a result of None: the data as it is),
    found once per name and kept in ``_DECODERS`` (callers look there first): webdataset's own decoder
    table by the part after the last dot (its ``basichandlers``), or the whole chain for ``.gz`` names
    (its ``gzfilter`` decompresses, then decodes by the inner extension)."""
    if ("." + name).endswith(".gz"):
        found = functools.partial(_DECODER.decode1, name)
    else:
        found = autodecode.decoders.get(name.rsplit(".", 1)[-1], _same)
    if len(_DECODERS) < 4096:
        _DECODERS[name] = found
    return found


def _same(data: bytes) -> bytes:
    return data


def sample_tuples(samples: Iterator[dict[str, Any]], keys: tuple[str, ...], handler: Handler) -> Iterator[tuple]:
    """webdataset's ``to_tuple(*keys)`` after ``decode()``, decoding only the values picked: ``a;b`` is
    a, else b. ``.npy`` values read as arrays are taken as they are; bytes go to webdataset's decoders.
    A sample without a key, or whose value cannot be decoded, is a ``SampleError`` for ``handler``."""
    picks = [tuple(key.split(";")) for key in keys]
    for sample in samples:
        try:
            values = []
            for names in picks:
                for name in names:
                    value = sample.get(name, _MISSING)
                    if value is not _MISSING:
                        break
                else:
                    raise SampleError(sample.get("__url__"), sample.get("__key__"),
                                      f"no {' or '.join(names)} (it has {', '.join(sorted(sample))})")
                if type(value) is bytes and name[:2] != "__":
                    try:
                        decoded = (_DECODERS.get(name) or _decoder(name))(value)
                    except Exception as exc:
                        raise SampleError(sample.get("__url__"), sample.get("__key__"),
                                          f"cannot decode '{name}': {exc.__class__.__name__}: {exc}") from exc
                    if decoded is not None:
                        value = decoded
                elif type(value) is MalformedMember:
                    raise SampleError(sample.get("__url__"), sample.get("__key__"), value.reason)
                values.append(value)
            yield tuple(values)
        except Exception as exc:
            if not handler(exc):
                break


_MISSING = object()


def plain(state: Any) -> Any:
    """A deep copy of a state as JSON has it (tuples become lists)."""
    return json.loads(json.dumps(state))


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def check_snapshot(state: Any, url_count: int, buffer: int) -> str | None:
    """What is wrong with a stream snapshot (None: nothing): types and ranges, before it is used."""
    if not isinstance(state, dict):
        return "not an object"
    for name in ("shard", "taken", "draws"):
        value = state.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"'{name}' is not a non-negative integer"
    if state.get("last") is not None and not isinstance(state.get("last"), str):
        return "'last' is not a key"
    if state["taken"] and state.get("last") is None:
        return "'last' is missing"
    if not isinstance(state.get("ended"), bool):
        return "'ended' is not true or false"
    entries = state.get("buffer")
    if not isinstance(entries, list) or len(entries) > max(buffer, 0):
        return f"'buffer' is not a list of at most {buffer} samples"
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != 3 or not all(isinstance(v, int) for v in entry[:2])
                or not isinstance(entry[2], str) or not 0 <= entry[0] < url_count or entry[1] < 0):
            return f"buffer entry {entry!r} is not [URL index, position, key]"
    return None
