"""Where a shard's leader sends its next sample (``spread.SpreadPool._target``), on a real board with fake links."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from transformer.server.board import Board
from transformer.server.spread import SUSPECT_SECONDS, SpreadPool


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
