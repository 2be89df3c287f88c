"""Ordered parallel map over a shard's samples: bounded windows, one shared pool, the error policy.

``transform_shard`` reads samples from a byte stream, submits the ones with images to the shared
``TransformPool``, and yields the output tar in input order while at most ``window`` samples of this
shard (and ``max_inflight`` across all shards) are in memory. Threads, not processes: decode, resize
and the float math release the GIL, workers share the process's memory (one copy of torch), and
results need no serialization; per-sample RNG draws are made thread-safe in ``spec.Pipeline.apply``.
"""

from __future__ import annotations

import _thread
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import BinaryIO

import torch

from .errors import Cancelled, SampleError, TransformerError
from .options import TransformOptions
from .samples import Member, Sample, needs_transform, transform_sample
from .shards import END_OF_ARCHIVE, json_member, member_bytes, read_samples

log = logging.getLogger("transformer.engine")

ERROR_MANIFEST_NAME = "__etl__/errors.json"  # webdataset skips "__*__/" members by default
_COALESCE = 64 * 1024  # small pieces (headers, padding, pass-through members) are sent together


class TransformPool:
    """One bounded pool shared by every shard being transformed in this process.

    Hand-written instead of ``concurrent.futures.ThreadPoolExecutor`` because its bookkeeping runs in
    Python for every sample, holding the GIL that the transform threads and the shard's driver thread
    wait for: a ``Future`` with its ``Condition``, a work item, a ``BoundedSemaphore`` and a done
    callback. Here a task is a ``_thread`` lock (released when it ran) and the queue and the in-flight
    slots are ``queue.SimpleQueue`` (C): ``python -m bench.pool`` measures 16 -> 9 us of CPU per task on
    this machine, about 1% of an image's CPU. Only what the engine uses of a future is kept:
    ``done``, ``result`` and ``cancel`` (a task not started yet is skipped).
    """

    def __init__(self, workers: int, max_inflight: int):
        # One intra-op thread per worker: the parallelism is across samples, not inside one op.
        torch.set_num_threads(1)
        self.workers = workers
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(max_inflight):
            self._slots.put(None)
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"transform_{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args, cancel: threading.Event | None = None) -> Task:
        """Queue ``fn(*args)`` once a slot is free (waiting raises ``Cancelled`` when ``cancel`` is set)."""
        while True:
            if self._closed:
                raise RuntimeError("the transform pool is shut down")
            try:
                self._slots.get(timeout=0.1)
                break
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled while waiting for a transform slot") from None
        task = Task(fn, args)
        self._tasks.put(task)
        return task

    def _work(self) -> None:
        take, free = self._tasks.get, self._slots.put
        while (task := take()) is not None:
            task.run()
            free(None)

    def shutdown(self) -> None:
        """Skip the tasks not started, let the running ones finish, stop the threads."""
        self._closed = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task.cancel()
                task.run()
                self._slots.put(None)
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()


class Task:
    """One sample's work in the pool; what the engine uses of a future."""

    __slots__ = ("_call", "_value", "_error", "_cancelled", "_finished")

    def __init__(self, fn: Callable, args: tuple):
        self._call: tuple[Callable, tuple] | None = (fn, args)
        self._value = self._error = None
        self._cancelled = False
        self._finished = _thread.allocate_lock()  # held until the task ran or was skipped
        self._finished.acquire()

    def run(self) -> None:
        fn, args = self._call
        self._call = None  # the sample's bytes are not kept past its transform
        if self._cancelled:
            self._error = CancelledError()
        else:
            try:
                self._value = fn(*args)
            except BaseException as exc:  # as a Future: every failure reaches result()
                self._error = exc
        self._finished.release()

    def done(self) -> bool:
        return not self._finished.locked()

    def cancel(self) -> None:
        """Skip the task if it has not started (a running one finishes)."""
        self._cancelled = True

    def result(self):
        """Wait for the task; its return value, or its exception raised."""
        with self._finished:
            pass
        if self._error is not None:
            raise self._error
        return self._value


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
) -> Iterator[bytes | memoryview]:
    """Yield the transformed shard as tar bytes, in input order. Raises on ``fail`` or bad input."""
    report = report if report is not None else ShardReport(shard, object_name, options.on_error)
    pending: deque[tuple[Sample, Task | None]] = deque()
    buffer = bytearray()

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"shard '{shard}': caller went away")
        if deadline is not None and time.monotonic() > deadline:
            raise TransformerError(f"shard '{shard}': object timeout exceeded after {report.samples_in} samples")

    def emit(sample: Sample, future: Task | None) -> Iterator[bytes | memoryview]:
        nonlocal buffer
        members = sample.members if future is None else _outcome(sample, future, options, shard, report)
        if members:
            report.samples_out += 1
        for member in members:
            for piece in member_bytes(member):
                if len(piece) < _COALESCE:
                    buffer += piece
                    if len(buffer) >= _COALESCE:
                        yield bytes(buffer)
                        buffer = bytearray()
                else:
                    if buffer:
                        yield bytes(buffer)
                        buffer = bytearray()
                    yield piece

    try:
        for sample in read_samples(stream, shard, options.max_member_bytes):
            check()
            report.samples_in += 1
            if report.samples_in == 1:
                report.mtime = sample.members[0].info.mtime  # reproducible manifest header
            future = None
            if needs_transform(sample, options):
                future = pool.submit(transform_sample, sample, options, shard, object_name, cancel=cancel)
            pending.append((sample, future))
            while pending and (len(pending) >= window or pending[0][1] is None or pending[0][1].done()):
                yield from emit(*pending.popleft())
        while pending:
            check()
            yield from emit(*pending.popleft())
        if report.errors and options.error_manifest:
            manifest = json_member(ERROR_MANIFEST_NAME, report.manifest(), report.mtime)
            yield from emit(Sample("__etl__", [manifest], ["json"]), None)
            report.samples_out -= 1  # the manifest is not a sample
        buffer += END_OF_ARCHIVE
        yield bytes(buffer)
    finally:
        for _, future in pending:
            if future is not None:
                future.cancel()


def _outcome(
    sample: Sample, future: Task, options: TransformOptions, shard: str, report: ShardReport
) -> list[Member]:
    try:
        members = future.result()
    except SampleError as exc:
        error = exc
    except Exception as exc:  # not anticipated: still a per-sample failure, never a silent loss
        log.exception("unexpected error in shard %s sample %s", shard, sample.key)
        error = SampleError(shard, sample.key, sample.members[0].info.name, f"internal error: {exc!r}")
    else:
        report.images += sum(1 for m in members if m.info.name.endswith(".npy"))
        return members
    if options.on_error == "fail":
        raise error
    action = "skipped" if options.on_error == "skip" else "passed-through"
    report.errors.append({"key": error.key, "member": error.member, "reason": error.reason, "action": action})
    log.warning("%s; sample %s", error.message, action)
    return [] if options.on_error == "skip" else sample.members
