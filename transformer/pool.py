"""The bounded transform pool shared by every shard in a process: ``TransformPool`` and its ``Task``."""

from __future__ import annotations

import _thread
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import torch

from .errors import Cancelled

log = logging.getLogger("transformer.engine")


class TransformPool:
    """One bounded pool shared by every shard being transformed in this process.

    Hand-written instead of ``concurrent.futures.ThreadPoolExecutor`` because its bookkeeping runs in
    Python for every sample, holding the GIL that the transform threads and the shard's driver thread
    wait for: a ``Future`` with its ``Condition``, a work item, a ``BoundedSemaphore`` and a done
    callback. Here a task is a ``_thread`` lock (released when it ran) and the queue and the in-flight
    slots are ``queue.SimpleQueue`` (C). ``python -m bench.experiments.pool`` measures the two;
    docs/design.md gives the figure. Only what the engine uses of a future is kept: ``done``, ``result`` and
    ``cancel`` (a task not started yet is skipped).
    """

    def __init__(self, workers: int, max_inflight: int, on_load: Callable[[int], None] | None = None):
        # One intra-op thread per worker: the parallelism is across samples, not inside one op.
        torch.set_num_threads(1)
        self.workers = workers
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(max_inflight):
            self._slots.put(None)
        self._closed = False
        # Tasks queued or running, published through ``on_load`` (a worker process's slot on the board).
        self._load_lock = threading.Lock()
        self.busy = 0
        self._on_load = on_load
        self.started = [0.0] * workers  # per thread: when its running task started (time.monotonic()), or 0
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"transform_{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args, cancel: threading.Event | None = None,
               on_done: Callable[[], None] | None = None) -> Task:
        """Queue ``fn(*args)`` once a slot is free (waiting raises ``Cancelled`` when ``cancel`` is set).

        ``on_done`` runs in the pool's thread once the task ran or was skipped (``done()`` is true).
        """
        self.acquire(cancel)
        task = Task(fn, args, on_done)
        self._put(task)
        return task

    def acquire(self, cancel: threading.Event | None = None) -> None:
        """Take an in-flight slot (``submit`` does; so does work sent to another process, ``release`` after)."""
        while True:
            if self._closed:
                raise RuntimeError("the transform pool is shut down")
            try:
                self._slots.get(timeout=0.1)
                return
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled while waiting for a transform slot") from None

    def release(self) -> None:
        """Give back a slot taken with ``acquire`` for work that did not run here."""
        self._slots.put(None)

    def enqueue(self, task: Task) -> None:
        """Queue ``task`` on the slot the caller took with ``acquire`` (freed when it ran)."""
        self._put(task)

    def run(self, task: Task) -> None:
        """Queue ``task`` without taking a slot: work whose memory another bound already counts (a sample
        another worker process's shard sent here, a sample run again here after its worker died)."""
        if self._closed:
            raise RuntimeError("the transform pool is shut down")
        task.unslotted = True
        self._put(task)

    def _put(self, task: Task) -> None:
        if self._on_load is not None:
            self._count(1)
        self._tasks.put(task)

    def _count(self, change: int) -> None:
        with self._load_lock:
            self.busy += change
            on_load = self._on_load
            if on_load is not None:
                on_load(self.busy)

    def oldest(self) -> float:
        """When the longest-running task started (``time.monotonic()``), or 0 when none runs."""
        return min((started for started in self.started if started), default=0.0)

    def _work(self, index: int) -> None:
        take, free, started, clock = self._tasks.get, self._slots.put, self.started, time.monotonic
        counted = self._on_load is not None
        while (task := take()) is not None:
            started[index] = clock()
            task.run()
            started[index] = 0.0
            if counted:
                self._count(-1)
            if not task.unslotted:
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
                if not task.unslotted:
                    self._slots.put(None)
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()


class Task:
    """One sample's work in the pool; what the engine uses of a future."""

    __slots__ = ("_call", "_value", "_error", "_cancelled", "_finished", "_on_done", "unslotted")

    def __init__(self, fn: Callable, args: tuple, on_done: Callable[[], None] | None = None):
        self.unslotted = False
        self._call: tuple[Callable, tuple] | None = (fn, args)
        self._value = self._error = None
        self._cancelled = False
        self._finished = _thread.allocate_lock()  # held until the task ran or was skipped
        self._finished.acquire()
        self._on_done = on_done

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
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            try:
                on_done()
            except Exception:  # the callback reports its own failures; the pool thread must survive
                log.exception("a transform task's completion callback failed")

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
