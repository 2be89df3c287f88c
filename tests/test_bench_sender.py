"""``bench.experiments.sender``'s ordered writer: whoever completes the oldest result writes it, and nothing is lost.

The benchmark compares who writes a shard's output; these check its machinery, not its speed.
"""

from __future__ import annotations

import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.experiments.sender import HeadSender, worker_sends


class ListSink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.threads: set[str] = set()

    def send(self, pieces: list) -> None:
        self.frames.append(b"".join(bytes(p) for p in pieces))
        self.threads.add(threading.current_thread().name)


def test_results_put_out_of_order_from_many_threads_are_written_once_in_order() -> None:
    sink = ListSink()
    sender = HeadSender(sink)
    order = list(range(400))
    random.Random(7).shuffle(order)
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: sender.put(i, [[b"%d" % i]]), order))
    assert sink.frames == [b"%d" % i for i in range(400)]
    assert sender.count == 400


def test_a_result_waits_for_the_head() -> None:
    sink = ListSink()
    sender = HeadSender(sink)
    sender.put(1, [[b"one"]])
    sender.put(2, [[b"two"]])
    assert sink.frames == []  # 0 is not there yet
    head = threading.Thread(target=sender.put, args=(0, [[b"zero"]]), name="completes-the-head")
    head.start()
    head.join()
    assert sink.frames == [b"zero", b"one", b"two"]
    assert sink.threads == {"completes-the-head"}  # the thread that completed the head wrote all three


@pytest.mark.skipif(shutil.which("curl") is None, reason="the benchmark's client is curl")
@pytest.mark.parametrize("batch", [1, 4])
def test_worker_sends_delivers_every_sample_to_curl(batch: int) -> None:
    samples = [bytes([i]) * 1000 for i in range(50)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        # CurlSink.close() raises unless curl received every byte that was sent.
        assert worker_sends(samples, lambda s: [[s]], pool, window=8, batch=batch) > 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="the benchmark's client is curl")
def test_worker_sends_raises_a_failed_sample() -> None:
    def one(sample: int) -> list:
        if sample == 7:
            raise ValueError("sample 7 is broken")
        return [[b"x" * 100]]

    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(ValueError, match="sample 7"):
        worker_sends(list(range(20)), one, pool, window=4, batch=2)
