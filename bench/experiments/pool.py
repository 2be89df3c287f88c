"""The transform pool's own cost per task: ``python -m bench.experiments.pool``.

Why ``pool.TransformPool`` is hand-written: the same ordered window over a trivial task, once through
``concurrent.futures.ThreadPoolExecutor`` with a ``BoundedSemaphore`` for the in-flight bound and a done
callback (the usual way to bound it), once through ``TransformPool``. Prints process CPU per task: what
the pool itself costs, nearly all of it Python holding the GIL that the transform threads and the
shard's driver thread share.

Decided: the hand-written ``pool.TransformPool`` over ``ThreadPoolExecutor`` (9 against 16 us per task; one
run, not kept: docs/design.md "Smaller decisions in the code" gives it as an estimate).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from transformer.pool import TransformPool

TASKS, WINDOW, WORKERS, INFLIGHT = 20_000, 6, 2, 8


class ExecutorPool:
    """``ThreadPoolExecutor`` bounded the usual way: a semaphore for the in-flight bound, a callback releasing it."""

    def __init__(self, workers: int, max_inflight: int):
        self._executor = ThreadPoolExecutor(max_workers=workers)
        self._slots = threading.BoundedSemaphore(max_inflight)

    def submit(self, fn, *args):
        while not self._slots.acquire(timeout=0.1):
            pass
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def cpu_us_per_task(pool) -> float:
    """The engine's pattern: submit in order, take results from the head once the window is full."""
    pending: deque = deque()
    start = time.process_time()
    for index in range(TASKS):
        pending.append(pool.submit(abs, index))
        while len(pending) >= WINDOW or (pending and pending[0].done()):
            pending.popleft().result()
    while pending:
        pending.popleft().result()
    return (time.process_time() - start) / TASKS * 1e6


def main() -> None:
    pools = {"ThreadPoolExecutor + semaphore": ExecutorPool(WORKERS, INFLIGHT),
             "TransformPool": TransformPool(WORKERS, INFLIGHT)}
    try:
        for round_index in range(3):  # taking turns: the machine is shared
            for name, pool in pools.items():
                print(f"round {round_index + 1}: {name:32s} {cpu_us_per_task(pool):5.1f} us CPU per task")
    finally:
        for pool in pools.values():
            pool.shutdown()


if __name__ == "__main__":
    main()
