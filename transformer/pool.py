"""The bounded transform pool shared by every shard in a process: ``TransformPool`` and its ``Task``."""

from __future__ import annotations

import _thread
import logging
import queue
import threading
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
    docs/performance.md gives the figure. Only what the engine uses of a future is kept: ``done``, ``result`` and
    ``cancel`` (a task not started yet is skipped).
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

    def submit(self, fn: Callable, *args, cancel: threading.Event | None = None,
               on_done: Callable[[], None] | None = None) -> Task:
        """Queue ``fn(*args)`` once a slot is free (waiting raises ``Cancelled`` when ``cancel`` is set).

        ``on_done`` runs in the pool's thread once the task ran or was skipped (``done()`` is true).
        """
        while True:
            if self._closed:
                raise RuntimeError("the transform pool is shut down")
            try:
                self._slots.get(timeout=0.1)
                break
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("cancelled while waiting for a transform slot") from None
        task = Task(fn, args, on_done)
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

    __slots__ = ("_call", "_value", "_error", "_cancelled", "_finished", "_on_done")

    def __init__(self, fn: Callable, args: tuple, on_done: Callable[[], None] | None = None):
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
