"""A worker's liveness, as the board answers it (``server/board.py``): every threshold in one place."""

from __future__ import annotations

from transformer.server.board import LATE_SECONDS, SUSPECT_SECONDS, Board


def test_a_heartbeat_ages_from_late_to_suspect_to_stalled() -> None:
    board = Board(1, stall=5.0)
    assert board.suspect(0, 100.0) and board.stalled(0, 100.0)  # no heartbeat yet
    assert board.beat(0, 100.0, oldest=0.0)
    for age, late, suspect, stalled in [(0.5, False, False, False), (LATE_SECONDS + 0.1, True, False, False),
                                        (SUSPECT_SECONDS + 0.1, True, True, False), (5.1, True, True, True)]:
        now = 100.0 + age
        assert (board.late(0, now), board.suspect(0, now), board.stalled(0, now)) == (late, suspect, stalled), age


def test_a_sample_running_past_the_stall_bound_withholds_the_heartbeat() -> None:
    board = Board(2, stall=5.0)
    assert board.beat(1, 100.0, oldest=96.0)  # a sample 4 s old: still beating
    assert not board.beat(1, 102.0, oldest=96.0)  # 6 s old: withheld, for the server to replace the worker
    assert board.slots[1].beat == 100.0 and board.age(1, 102.0) == 2.0
