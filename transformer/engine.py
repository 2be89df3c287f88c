"""Ordered parallel map over a shard's samples: bounded windows, one shared pool, the error policy.

``transform_shard`` reads samples from a byte stream, submits the ones with images to the shared
``TransformPool`` (pool.py), and yields the output tar in input order while at most ``window`` samples of this
shard (and ``max_inflight`` across all shards) are in memory. Threads: decode, resize and the float
math release the GIL, workers share the process's memory, and results need no serialization;
per-sample RNG draws are made thread-safe in ``spec.Pipeline.apply``. On more cores than one GIL
serves, the server runs this in worker processes, a shard in each (server/processes.py).
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from . import __version__
from .errors import Cancelled, InternalError, SampleTransformError, TransformerError
from .integrity import InputDigest, ShardCheck, end_marker_payload
from .options import TransformOptions, settings_digest
from .pool import Task, TransformPool
from .samples import needs_transform, transform_sample
from .shards import Member, Sample, json_member, member_bytes, read_samples
from .wire import END_MARKER_KEY, END_MARKER_NAME, END_OF_ARCHIVE

log = logging.getLogger("transformer.engine")

ERROR_MANIFEST_NAME = "__etl__/errors.json"  # webdataset skips "__*__/" members by default
_COALESCE = 64 * 1024  # small pieces (headers, padding, pass-through members) are sent together


@dataclass
class ShardReport:
    """What happened to one shard; filled in while it streams."""

    shard: str
    object_name: str
    policy: str
    samples_in: int = 0
    samples_out: int = 0
    images: int = 0
    bytes_out: int = 0
    errors: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    mtime: float = 0.0
    source: dict | None = None  # the input's size and digest, once read to its end (the end marker's ``input``)

    def manifest(self) -> bytes:
        return json.dumps(
            {
                "shard": self.shard,
                "object": self.object_name,
                "policy": self.policy,
                "samples_in": self.samples_in,
                "samples_out": self.samples_out,
                "errors": self.errors,
            },
            indent=1,
        ).encode()


class Write(enum.IntEnum):
    """What a ``writer`` given to ``transform_shard`` did with a chunk. A writer never waits."""

    OK = 0  # taken (written, or held to go out with the next one): go on
    FULL = 1  # taken, but it cannot take more without waiting: the driver writes from the next chunk on
    REFUSED = 2  # not taken (the writer is not ready, or not any more): the driver writes this chunk


def transform_shard(
    stream: BinaryIO,
    options: TransformOptions,
    pool: TransformPool,
    *,
    shard: str,
    object_name: str,
    window: int,
    report: ShardReport | None = None,
    cancel: threading.Event | None = None,
    deadline: float | None = None,
    writer: Callable[[bytes | memoryview], Write] | None = None,
) -> Iterator[bytes | memoryview]:
    """Yield the transformed shard as tar bytes, in input order. Raises on ``fail`` or bad input.

    With ``writer`` (non-blocking), the transform thread that completes the oldest unwritten sample
    writes it, and every later one already done, through ``writer``; only what ``writer`` does not
    take, and everything after it until the driver caught up, is yielded (``_Relay``).

    Every byte of ``stream`` is read, and hashed on the way (``InputDigest``): the end marker records
    the input's size and digest, for an incremental transform to compare with the source object.
    """
    stream = InputDigest(stream)
    read = _ShardRead(options, pool, shard, object_name,
                      report if report is not None else ShardReport(shard, object_name, options.on_error),
                      cancel, deadline)
    emitter = _Emitter(options, shard, read.report)
    if writer is not None:
        yield from _relayed(read, stream, window, emitter, writer)
        return
    pending: deque[tuple[Sample, Task | None]] = deque()
    try:
        for sample, task in read.submitted(stream):
            pending.append((sample, task))
            while pending and (len(pending) >= window or pending[0][1] is None or pending[0][1].done()):
                yield from emitter.pieces(*pending.popleft())
        while pending:
            read.check()
            yield from emitter.pieces(*pending.popleft())
        yield from emitter.finish()
    finally:
        for _, task in pending:
            if task is not None:
                task.cancel()


@dataclass
class _ShardRead:
    """The input side of one shard: its samples read in order and submitted to the pool."""

    options: TransformOptions
    pool: TransformPool
    shard: str
    object_name: str
    report: ShardReport
    cancel: threading.Event | None
    deadline: float | None

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(f"shard '{self.shard}': caller went away")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TransformerError(f"shard '{self.shard}': object timeout exceeded after "
                                   f"{self.report.samples_in} samples")

    def submitted(self, stream: InputDigest, on_done: Callable[[], None] | None = None
                  ) -> Iterator[tuple[Sample, Task | None]]:
        """The shard's samples in order, each with its transform task (None: nothing in it to transform).

        An input that is itself the output of this ETL (a pipeline stage before us, an ETL'd copy) ends
        with an end marker: it is checked against what came before it and dropped, as this shard gets
        its own. The first ``options.skip`` samples are read past (their bytes only; nothing decoded,
        nothing written). Once the samples end, the rest of the stream is read into its digest.
        """
        options, report = self.options, self.report
        whole = ShardCheck(self.shard)  # whole.samples: the samples read, the skipped ones too
        for sample in read_samples(stream, self.shard, options.max_member_bytes):
            self.check()
            if whole.sample(sample):
                continue
            whole.samples += 1
            if whole.samples == 1:
                report.mtime = sample.members[0].info.mtime  # reproducible manifest header, skip or not
            if whole.samples <= options.skip:
                continue
            report.samples_in += 1
            task = None
            if needs_transform(sample, options):
                task = self.pool.submit(transform_sample, sample, options, self.shard, self.object_name,
                                        cancel=self.cancel, on_done=on_done)
            yield sample, task
        self.check()
        stream.drain()
        report.source = stream.identity()


class _Emitter:
    """A shard's output as tar bytes, sample by sample; small pieces gathered into one chunk.

    Used by one thread at a time (the driver, or the transform thread holding ``_Relay``'s writer role).
    """

    def __init__(self, options: TransformOptions, shard: str, report: ShardReport):
        self.options, self.shard, self.report = options, shard, report
        self.buffer = bytearray()
        self.members = self.written = 0  # tar members and bytes so far, for the end marker

    def pieces(self, sample: Sample, future: Task | None) -> Iterator[bytes | memoryview]:
        report = self.report
        members = sample.members if future is None else _outcome(sample, future, self.options, self.shard, report)
        if members:
            report.samples_out += 1
        self.members += len(members)
        for member in members:
            for piece in member_bytes(member):
                self.written += len(piece)
                if len(piece) < _COALESCE:
                    self.buffer += piece
                    if len(self.buffer) >= _COALESCE:
                        yield bytes(self.buffer)
                        self.buffer = bytearray()
                else:
                    if self.buffer:
                        yield bytes(self.buffer)
                        self.buffer = bytearray()
                    yield piece

    def finish(self) -> Iterator[bytes]:
        """The error manifest (if any sample failed), the end marker, and the end-of-archive blocks."""
        report = self.report
        if report.errors and self.options.error_manifest:
            manifest = json_member(ERROR_MANIFEST_NAME, report.manifest(), report.mtime)
            yield from self.pieces(Sample("__etl__/errors", [manifest], ["json"]), None)
            report.samples_out -= 1  # the manifest is not a sample
        actions = [error["action"] for error in report.errors]
        payload = end_marker_payload(
            samples_in=report.samples_in, samples_out=report.samples_out, skipped=actions.count("skipped"),
            passed_through=actions.count("passed-through"), members=self.members, bytes_before=self.written,
            source=report.source, settings=settings_digest(self.options), version=__version__)
        marker = json_member(END_MARKER_NAME, payload, report.mtime)
        yield from self.pieces(Sample(END_MARKER_KEY, [marker], ["json"]), None)
        report.samples_out -= 1  # nor is the marker
        self.buffer += END_OF_ARCHIVE
        yield bytes(self.buffer)
        self.buffer = bytearray()


def _relayed(read: _ShardRead, stream: InputDigest, window: int, emitter: _Emitter,
             writer: Callable[[bytes | memoryview], Write]) -> Iterator[bytes | memoryview]:
    """``transform_shard`` with the output written by the transform threads where they can (``_Relay``)."""
    relay = _Relay(emitter, writer)
    # The reader refills the window in batches: woken once half of it is free, not after every sample.
    low = max(0, window - max(1, window // 2))
    try:
        for sample, task in read.submitted(stream, on_done=relay.pump):
            relay.add(sample, task)
            relay.pump()  # a pass-through head, or a task that finished before it was added
            if relay.unwritten() >= window:
                yield from relay.wait(low, read.check)
            elif relay.needs_driver():  # output (the first chunk, before the writer is ready) or an error
                yield from relay.wait(window - 1, read.check)  # now, not once the window is full
        yield from relay.wait(0, read.check)
        yield from emitter.finish()
    finally:
        relay.close()


class _Relay:
    """Writes a shard's samples in order from whichever thread makes the oldest one ready.

    Why: the driver thread waking once per sample, on cores it shares with the transform threads, to
    take the GIL and write what another thread just made, costs throughput that a side-by-side run
    shows (docs/design.md, "Who writes the output"). Here the transform thread that completes the
    oldest unwritten sample writes it and every later one already done, holding the writer role (one
    thread at a time, ``_writing``); the driver only reads and refills the window.

    A transform thread never waits for the caller: ``writer`` is non-blocking, and when it refuses a
    chunk or can take no more, the role passes to the driver (``_driver``), which yields the rest
    of that sample and every ready one after it (its consumer may block, fall back to the event loop,
    or raise), then hands the role back. Errors raised while a transform thread writes (the ``fail``
    policy, the caller gone) are raised by the driver at its next wait.
    """

    def __init__(self, emitter: _Emitter, writer: Callable[[bytes | memoryview], Write]):
        self._emitter, self._writer = emitter, writer
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[tuple[Sample, Task | None]] = deque()
        self._writing = False  # a transform thread (or the driver through pump) is writing
        self._driver = False  # the driver writes: a chunk was refused or the writer was full
        self._leftover: Iterator[bytes | memoryview] | None = None  # the rest of that sample's chunks
        self._error: BaseException | None = None
        self._closed = False
        self._low = 0  # the driver wants to be woken once this few samples are unwritten

    def add(self, sample: Sample, task: Task | None) -> None:
        with self._cond:
            self._pending.append((sample, task))

    def unwritten(self) -> int:
        return len(self._pending)

    def needs_driver(self) -> bool:
        """Whether the driver must write (a chunk was refused or the writer is full) or raise."""
        return self._driver or self._error is not None

    def _head_ready(self) -> bool:
        if not self._pending:
            return False
        task = self._pending[0][1]
        return task is None or task.done()

    def pump(self) -> None:
        """Write what is ready, if no one else is writing (any thread; a task's ``on_done``)."""
        with self._cond:
            if self._writing or self._driver or self._closed or self._error is not None or not self._head_ready():
                return
            self._writing = True
        try:
            while True:
                with self._cond:
                    if self._closed or not self._head_ready():
                        self._writing = False
                        if self._closed or len(self._pending) <= self._low:  # else no one waits for this
                            self._cond.notify_all()
                        return
                    sample, task = self._pending.popleft()
                    if len(self._pending) == self._low:  # the driver may refill the window now
                        self._cond.notify_all()
                chunks = self._emitter.pieces(sample, task)
                for chunk in chunks:
                    done = self._writer(chunk)
                    if done is not Write.OK:
                        rest = chunks if done is Write.FULL else itertools.chain((chunk,), chunks)
                        with self._cond:
                            self._leftover, self._driver, self._writing = rest, True, False
                            self._cond.notify_all()
                        return
        except BaseException as exc:
            with self._cond:
                self._error, self._writing = exc, False
                self._cond.notify_all()

    def wait(self, low: int, check: Callable[[], None]) -> Iterator[bytes | memoryview]:
        """Until at most ``low`` samples are unwritten (0: all written); yields what the driver must write."""
        while True:
            check()
            with self._cond:
                if self._error is not None:
                    raise self._error
                if not self._driver:
                    if len(self._pending) <= low and (low > 0 or not self._writing):
                        return
                    self._low = low
                    self._cond.wait(0.1)
                    continue
                leftover, self._leftover = self._leftover, None
            yield from self._drive(leftover, low)

    def _drive(self, leftover: Iterator[bytes | memoryview] | None, low: int) -> Iterator[bytes | memoryview]:
        """The driver holds the writer role: the refused sample's rest, then every ready sample (waiting
        for the oldest only while the window is over ``low``), then the role goes back."""
        if leftover is not None:
            yield from leftover
        while True:
            with self._cond:
                if not self._pending or (not self._head_ready() and len(self._pending) <= low):
                    self._driver = False
                    break
                sample, task = self._pending.popleft()
            yield from self._emitter.pieces(sample, task)
        self.pump()  # samples that became ready while the driver wrote

    def close(self) -> None:
        """No more writing from the transform threads; skip tasks not started; wait for a write in progress."""
        with self._cond:
            self._closed = True
            for _, task in self._pending:
                if task is not None:
                    task.cancel()
            while self._writing:
                self._cond.wait(0.1)
            # The window's samples and arrays go now, not when the collector breaks the cycle that a
            # stored error's traceback makes through this object.
            self._pending.clear()
            self._leftover = self._error = None


def _outcome(
    sample: Sample, future: Task, options: TransformOptions, shard: str, report: ShardReport
) -> list[Member]:
    try:
        members = future.result()
    except SampleTransformError as exc:  # the sample's own content: the policy decides
        error = exc
    except Cancelled:
        raise
    except Exception as exc:  # the pod's own failure (a bug, a worker gone, a cancelled task): never the sample's
        if not isinstance(exc, TransformerError):
            log.exception("shard %s: unexpected error transforming sample %s", shard, sample.key)
        reason = exc.message if isinstance(exc, TransformerError) else f"internal error: {exc!r}"
        raise InternalError(f"shard '{shard}': sample '{sample.key}' was not transformed ({reason}); "
                            "the shard was not completed") from exc
    else:
        report.images += sum(1 for m in members if m.info.name.endswith(".npy"))
        return members
    if options.on_error == "fail":
        raise error
    action = "skipped" if options.on_error == "skip" else "passed-through"
    report.errors.append({"key": error.key, "member": error.member, "reason": error.reason, "action": action})
    log.warning("%s; sample %s", error.message, action)
    return [] if options.on_error == "skip" else sample.members
