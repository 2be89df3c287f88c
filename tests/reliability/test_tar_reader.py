"""The tar reader never turns a damaged shard into a shorter, valid-looking one.

``tarfile`` in stream mode takes a cut-off header, a missing end-of-archive marker or a garbage
header block after the first member for a normal end of the archive; ``shards.read_samples`` must
refuse each of them with a ``ShardError`` that names the shard and where it broke.
"""

from __future__ import annotations

import io
import tarfile
import tracemalloc

import pytest

from testbed.shardgen import make_tar
from transformer.errors import ShardError
from transformer.shards import read_samples

MEMBERS = [("a.cls", b"x" * 1000), ("b.cls", b"y" * 1000), ("c.cls", b"z" * 1000)]
SHARD = make_tar(MEMBERS)
with tarfile.open(fileobj=io.BytesIO(SHARD)) as _archive:
    INFOS = _archive.getmembers()
AFTER_LAST = INFOS[-1].offset_data + 1024  # end of the last member's padded payload


def keys(data: bytes) -> list[str]:
    return [sample.key for sample in read_samples(io.BytesIO(data), "shard-7.tar", 2**20)]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (SHARD[: INFOS[1].offset + 100], "truncated header at offset 1536"),
        (SHARD[: INFOS[1].offset], "no end-of-archive marker at offset 1536"),
        (SHARD[:AFTER_LAST], "no end-of-archive marker at offset 4608"),
        (SHARD[:AFTER_LAST] + b"\0" * 100, "truncated header at offset 4608"),
        (SHARD[: INFOS[2].offset] + b"Z" * 512 + SHARD[INFOS[2].offset + 512 :], "invalid header at offset 3072"),
    ],
    ids=["cut-inside-a-header", "cut-at-a-member-boundary", "cut-before-the-end-marker", "cut-inside-the-end-marker",
         "garbage-header"],
)
def test_damaged_tar_after_the_first_member_is_a_shard_error(data: bytes, reason: str) -> None:
    with pytest.raises(ShardError) as info:
        keys(data)
    assert info.value.shard == "shard-7.tar"
    assert reason in info.value.reason


def test_cut_inside_a_member_names_the_member() -> None:
    with pytest.raises(ShardError) as info:
        keys(SHARD[: INFOS[2].offset_data + 10])
    assert "truncated inside member 'c.cls'" in info.value.reason


def test_complete_tar_with_one_zero_block_is_accepted() -> None:
    assert keys(SHARD[: AFTER_LAST + 512]) == ["a", "b", "c"]
    assert keys(SHARD) == ["a", "b", "c"]


def test_memory_does_not_grow_with_the_member_count() -> None:
    # tarfile keeps every TarInfo it read, even in stream mode (~1.3 KB per member); the reader must not.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for i in range(20_000):
            info = tarfile.TarInfo(f"s{i:06d}.cls")
            info.size = 1
            archive.addfile(info, io.BytesIO(b"1"))
    data = buffer.getvalue()
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_samples(io.BytesIO(data), "many.tar", 2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 20_000
    assert peak < 5 * 2**20, f"peak {peak / 2**20:.1f} MiB for 20k members: headers are being kept"


def test_gzip_shard_with_a_flipped_payload_bit_is_a_shard_error() -> None:
    # JPEGs do not compress: gzip stores them, so a flipped bit changes the data without a decode error.
    # Only the CRC at the end of the gzip stream can tell; tarfile's stream mode never checks it.
    import gzip
    import random

    noise = random.Random(7)  # incompressible like JPEG, and the same bytes every run
    data = make_tar([(f"m{i}.bin", noise.randbytes(3000)) for i in range(8)])
    packed = bytearray(gzip.compress(data, mtime=0))
    assert keys(bytes(packed)) == [f"m{i}" for i in range(8)]
    packed[len(packed) // 2] ^= 0x01
    with pytest.raises(ShardError) as info:
        keys(bytes(packed))
    assert "CRC check failed" in info.value.reason  # at the trailer, or in a member read that reached it


@pytest.mark.parametrize("data", [b"\x1f\x8b\x08", b"\x1f\x8b", b"\x1f"], ids=["gzip-header-3", "magic", "one-byte"])
def test_cut_gzip_header_is_a_shard_error(data: bytes) -> None:
    # tarfile's own gzip reader raised TypeError on the 3-byte case (found by bench/fuzz_tar.py).
    with pytest.raises(ShardError) as info:
        keys(data)
    assert "not a tar archive" in info.value.reason
