"""server/arena.py: blocks lent to a reader come back only once it let go of every view of them, or its link
is gone; a block in use is never handed out twice; pieces too small or too large travel inline."""

from __future__ import annotations

import gc

import numpy as np

from transformer.server import arena as arenas
from transformer.server.arena import HEADER, Arena


def test_a_put_block_is_read_through_a_lease_and_comes_back_once_its_views_are_gone() -> None:
    owner = Arena(size=8 << 20)
    reader_map = arenas.attach(owner.fd)  # the other process's mapping of the same memory file
    payload = np.arange(200_000, dtype=np.uint8)
    offset = owner.put(link=1, pieces=[b"head", payload])
    assert offset is not None and owner.lent() == 1
    view = arenas.lease(reader_map, offset, 4 + payload.nbytes)
    assert bytes(view[:4]) == b"head" and bytes(view[4:]) == payload.tobytes()
    part = view[100:200]  # a slice keeps the block, as a frame still being sent does
    del view
    gc.collect()
    assert owner.lent() == 1
    assert owner.put(link=1, pieces=[payload]) != offset  # in use: never handed out again
    del part
    assert owner.lent() == 1  # the second block only: the first came back
    again = owner.put(link=2, pieces=[payload])
    assert again == offset  # reused: the same size class


def test_a_gone_reader_frees_its_blocks_and_nothing_more_is_lent_to_it() -> None:
    owner = Arena(size=8 << 20)
    offsets = [owner.put(link=7, pieces=[bytes(100_000)]) for _ in range(3)]
    assert None not in offsets and owner.lent() == 3
    owner.release(7)
    assert owner.lent() == 0
    assert owner.put(link=7, pieces=[bytes(100_000)]) is None
    assert owner.put(link=8, pieces=[bytes(100_000)]) in offsets


def test_an_allocated_block_is_the_owners_until_lent_and_freed_when_unused() -> None:
    owner = Arena(size=8 << 20)
    offset, view = owner.allocate(300_000)
    view[:3] = b"abc"
    assert owner.locate(view) == offset and owner.locate(memoryview(bytearray(300_000))) is None
    owner.release(3)  # a link going away does not touch a block not lent to it
    assert bytes(view[:3]) == b"abc"
    owner.free(offset)
    assert owner.allocate(300_000)[0] == offset


def test_pieces_outside_the_size_classes_travel_inline_and_a_full_arena_says_so() -> None:
    assert not Arena.fits(1_000) and Arena.fits(100_000) and not Arena.fits(1 << 28)
    owner = Arena(size=2 << 20)
    held = [owner.allocate(600_000) for _ in range(2)]  # two 1 MiB blocks fill it
    assert all(taken is not None for taken in held)
    assert owner.allocate(600_000) is None
    owner.free(held[0][0])
    assert owner.allocate(600_000) is not None
    assert HEADER == 64
