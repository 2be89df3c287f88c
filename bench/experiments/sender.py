"""Which thread should write a shard's output: ``python -m bench.experiments.sender`` (about 2 minutes).

The service's shard driver thread reads the input, submits each sample to the transform threads, waits
for the oldest one and writes it to the socket: it wakes once per sample, on two cores shared with the
transform threads and the client. This compares, over the same in-memory samples and the same curl
client (``services.CurlSink``), with no tar and no server, in rounds taking turns:

* ``compute limit``: ``compute.compute_limit`` (nothing sent);
* ``main thread sends``: ``compute.http_limit``, every sample submitted up front, the main thread
  waiting for each result in order and writing it (one writer thread waking once per sample);
* ``worker sends, refill per sample``: the transform thread that completes the oldest unsent sample
  writes it and every later one already done; a reader thread submits the next sample each time one
  is written (a window of ``--window``, one reader wake-up per sample);
* ``worker sends, refill in batches``: the same, the reader woken once ``--batch`` slots are free.

With direct send, the service writes as the last row does (the engine's relay writing through
``transformer/server/direct.py``); docs/design.md ("Who writes the output") measures it side by
side in the service itself with ``python -m bench.experiments.ab``.
Prints images/s per round and medians with the fraction of the compute limit.

Decided: with direct send, the transform thread that finishes the oldest sample writes it
(``engine._Relay``); no run kept here, the decision rests on ``bench.experiments.ab``'s runs in the service
(``bench/results/ab-output-owner/``, docs/design.md "Who writes the output").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import compute, data
from bench.services import CurlSink
from transformer.config import Settings
from transformer.options import options_from_mapping
from transformer.samples import transform_sample
from transformer.shards import Sample


class HeadSender:
    """Results arrive in any order from any thread; whoever completes the oldest unsent one writes it
    and every later one already there, in order, outside the lock. One writer at a time."""

    def __init__(self, sink: CurlSink, written=None):
        self._sink, self._written = sink, written
        self._lock = threading.Lock()
        self._ready: dict[int, list] = {}
        self._next, self._writing = 0, False

    @property
    def count(self) -> int:
        return self._next

    def put(self, index: int, arrays: list) -> None:
        with self._lock:
            self._ready[index] = arrays
            if self._writing or index != self._next:
                return  # the current writer, or the thread completing the head, writes it
            self._writing = True
        while True:
            with self._lock:
                if self._next not in self._ready:
                    self._writing = False
                    return
                arrays = self._ready.pop(self._next)
                self._next += 1
            for pieces in arrays:
                self._sink.send(pieces)
            if self._written is not None:
                self._written()


def worker_sends(samples: list[Sample], one, pool: ThreadPoolExecutor, window: int, batch: int) -> float:
    """Images/s with ``HeadSender``; the calling thread is the reader, woken once ``batch`` slots are free."""
    sink = CurlSink()
    total = len(samples)
    free, wake, finished = [window], threading.Condition(), threading.Event()
    errors: list[BaseException] = []

    def written() -> None:
        if sender.count == total:
            finished.set()
        with wake:
            free[0] += 1
            if free[0] >= batch:
                wake.notify()

    sender = HeadSender(sink, written)

    def task(index: int, sample: Sample) -> None:
        try:
            sender.put(index, one(sample))
        except BaseException as exc:  # raised by the reader below: a broken run must not print a figure
            errors.append(exc)
            finished.set()
            with wake:
                wake.notify()

    start = time.perf_counter()
    try:
        position = 0
        while position < total and not errors:
            with wake:
                while free[0] < min(batch, total - position) and not errors:
                    wake.wait()
                take = min(free[0], total - position)
                free[0] -= take
            for index in range(position, position + take):
                pool.submit(task, index, samples[index])
            position += take
        finished.wait()
        if errors:
            raise errors[0]
        seconds = time.perf_counter() - start
    except BaseException:
        sink.abort()
        raise
    sink.close()
    return total / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.sender", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--samples", type=int, default=1000, help="samples of the demo shard (default 1000)")
    parser.add_argument("--window", type=int, default=16, help="samples in flight (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="free slots that wake the reader (default 8)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, help="folder for the demo shard (default: a temporary folder)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        shard = data.demo_shards(args.work or Path(scratch), 1, args.samples)[0]
        settings = Settings.from_env({})
        samples = compute.load_samples(shard.path, settings)
        options = options_from_mapping({"preset": "imagenet-train", "seed": 0}, settings)
        torch.set_num_threads(1)

        def one(sample: Sample) -> list:
            members = transform_sample(sample, options, "sender", "sender")
            return [m.pieces for m in members if m.info.name.endswith(".npy")]

        cases = {
            "compute limit": lambda pool: compute.compute_limit(samples, "imagenet-train", "float32",
                                                                args.workers, settings)["images_per_s"],
            "main thread sends": lambda pool: compute.http_limit(samples, "imagenet-train", "float32",
                                                                 args.workers, settings)["images_per_s"],
            "worker sends, refill per sample": lambda pool: worker_sends(samples, one, pool, args.window, 1),
            f"worker sends, refill in batches of {args.batch}":
                lambda pool: worker_sends(samples, one, pool, args.window, args.batch),
        }
        results: dict[str, list[float]] = {name: [] for name in cases}
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            list(pool.map(one, samples[: 2 * args.workers]))  # warm-up
            worker_sends(samples[:50], one, pool, args.window, args.batch)
            for round_index in range(args.rounds):
                names = list(cases) if round_index % 2 == 0 else list(reversed(cases))
                for name in names:
                    results[name].append(cases[name](pool))
                print(f"round {round_index + 1}: " + " | ".join(f"{n} {results[n][-1]:,.0f}" for n in cases),
                      flush=True)
    limits = results["compute limit"]
    print(f"\nmedians over {args.rounds} rounds, images/s and fraction of the same round's compute limit:")
    for name, values in results.items():
        fraction = statistics.median(v / limit for v, limit in zip(values, limits))
        print(f"  {name:40s} {statistics.median(values):7,.0f}  {fraction:6.1%}")


if __name__ == "__main__":
    main()
