"""Where a shard's leader sends its next sample (``spread.SpreadPool._target``), on a real board with fake links; and
what becomes of a sample whose worker is lost (``RemoteTask.run_here``)."""

from __future__ import annotations

import tarfile
import threading
import time
from types import SimpleNamespace

import pytest

from testbed.shardgen import jpeg_bytes
from transformer.config import Settings
from transformer.errors import InternalError
from transformer.options import options_from_mapping
from transformer.pool import Task, TransformPool
from transformer.server.board import SUSPECT_SECONDS, Board
from transformer.server.links import RemoteTask
from transformer.server.spread import SpreadPool
from transformer.shards import Member, Sample


def leader(busy: int, threads: int, peers: list[dict]) -> tuple[SpreadPool, list]:
    """The pool of worker 0 (``busy`` samples on ``threads`` threads) and its links to workers 1.. (each peer:
    busy, threads, leading, outstanding, age)."""
    board = Board(len(peers) + 1)
    now = time.monotonic()
    links = []
    for index, peer in enumerate(peers, start=1):
        slot = board.slots[index]
        slot.busy, slot.threads, slot.leading = peer.get("busy", 0), peer.get("threads", 1), peer.get("leading", 0)
        slot.beat = now - peer.get("age", 0.0)
        links.append(SimpleNamespace(index=index, outstanding=peer.get("outstanding", 0)))
    pool = SimpleNamespace(busy=busy, workers=threads)
    return SpreadPool(SimpleNamespace(pool=pool, board=board, links=lambda: links), SimpleNamespace()), links


def test_a_free_thread_here_keeps_the_sample() -> None:
    pool, _ = leader(busy=0, threads=1, peers=[{"busy": 0}])
    assert pool._target() is None


def test_a_busy_leader_sends_to_a_free_thread_of_the_least_busy_worker() -> None:
    pool, links = leader(busy=3, threads=1, peers=[{"busy": 2, "leading": 1}, {"busy": 0, "threads": 2}])
    assert pool._target() is links[1]


def test_an_idle_worker_takes_queued_samples_when_its_queue_is_a_sample_per_thread_shorter() -> None:
    pool, links = leader(busy=3, threads=1, peers=[{"busy": 1}])
    assert pool._target() is links[0]
    pool, _ = leader(busy=3, threads=1, peers=[{"busy": 3}])
    assert pool._target() is None  # as busy as here: no ping-pong


@pytest.mark.parametrize("peer_busy", [1, 2, 3])
def test_two_workers_that_each_lead_a_shard_never_trade_queued_samples(peer_busy: int) -> None:
    """Both cores are busy with their own shards: a sample sent away would only cost the messages."""
    pool, _ = leader(busy=6, threads=1, peers=[{"busy": peer_busy, "leading": 1}])
    assert pool._target() is None


def test_what_the_leader_sent_counts_until_the_board_shows_it() -> None:
    pool, _ = leader(busy=2, threads=1, peers=[{"busy": 0, "outstanding": 2}])
    assert pool._target() is None  # two samples already on their way: as busy as here


def test_a_worker_whose_heartbeat_is_late_gets_nothing() -> None:
    pool, links = leader(busy=3, threads=1, peers=[{"busy": 0, "age": SUSPECT_SECONDS + 1}, {"busy": 1}])
    assert pool._target() is links[1]


def _lost_task(on_done=None) -> RemoteTask:
    """A sample sent to a worker that is gone: its leader now runs it itself (``RemoteTask.run_here``)."""
    sample = Sample("s-0001", [Member(info=tarfile.TarInfo("s-0001.jpg"), pieces=[jpeg_bytes(1)])], ["jpg"])
    options = options_from_mapping({"preset": "imagenet-val"}, Settings.from_env({}))
    return RemoteTask(SimpleNamespace(), sample, options, "train/a.tar", "a.tar", on_done, lambda: None)


def test_a_sample_adopted_from_a_lost_worker_completes_here() -> None:
    pool = TransformPool(1, 4)
    try:
        task = _lost_task()
        task.run_here(pool)
        assert [m.info.name for m in task.result()] == ["s-0001.npy"]
    finally:
        pool.shutdown()


def test_an_adopted_sample_whose_run_here_is_cancelled_fails_its_shard_never_skipped() -> None:
    """This process stopping cancels the run it queued: the sample's task fails with the pod's own error (the
    engine fails the shard for it), never a sample error a policy could skip."""
    pool = TransformPool(1, 4)
    blocker = threading.Event()
    pool.run(Task(blocker.wait, (10,)))  # the only thread is busy: the adopted run stays queued
    task = _lost_task()
    task.run_here(pool)
    blocker.set()
    pool.shutdown()  # skips what has not started
    with pytest.raises(InternalError, match="'s-0001' was lost with its transform worker, and its run here was cancel"):
        task.result()


def test_an_adopted_sample_in_a_stopped_pool_fails_its_shard() -> None:
    pool = TransformPool(1, 4)
    pool.shutdown()
    task = _lost_task()
    task.run_here(pool)
    with pytest.raises(InternalError, match="could not run again here"):
        task.result()
