"""A stored shard proven whole from its last bytes: the end marker read through range reads of the tail only."""

from __future__ import annotations

import io
import tarfile

import pytest

from testbed.shardgen import jpeg_bytes, make_tar, sealed
from transformer.errors import ShardError
from transformer.integrity import TAIL_BYTES, marker_from_tail


class Ranges:
    """``read(offset, length)`` over bytes, recording every range asked for."""

    def __init__(self, data: bytes):
        self.data, self.reads = data, []

    def __call__(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return self.data[offset:offset + length]


@pytest.fixture(scope="module")
def shard() -> bytes:
    """A shard as the pod writes it (the engine's own output), a few samples of real photos."""
    from transformer.config import Settings
    from transformer.engine import ShardReport, transform_shard
    from transformer.options import options_from_mapping
    from transformer.pool import TransformPool

    members = []
    for i in range(3):
        members += [(f"s-{i}.jpg", jpeg_bytes(i, (64, 48))), (f"s-{i}.cls", b"%d" % i)]
    options = options_from_mapping({"transforms": [{"Resize": {"size": [8, 8]}}], "dtype": "uint8"},
                                   Settings.from_env({}))
    pool = TransformPool(workers=1, max_inflight=4)
    try:
        report = ShardReport("a.tar", "a.tar", options.on_error)
        chunks = transform_shard(io.BytesIO(make_tar(members)), options, pool, shard="a.tar", object_name="a.tar",
                                 window=2, report=report)
        return b"".join(bytes(c) for c in chunks)
    finally:
        pool.shutdown()


def test_a_whole_shard_is_proven_from_its_last_2_kib_in_one_read(shard: bytes) -> None:
    read = Ranges(shard)
    marker = marker_from_tail(read, len(shard), "a.tar")
    assert marker["samples_out"] == 3 and marker["bytes"] == len(shard) - TAIL_BYTES
    assert read.reads == [(len(shard) - TAIL_BYTES, TAIL_BYTES)] and TAIL_BYTES == 2048


def test_a_marker_before_tar_padding_is_found_further_back(shard: bytes) -> None:
    padded = shard + b"\0" * (10240 - len(shard) % 10240)  # a writer that pads to whole 10 KiB records
    read = Ranges(padded)
    assert marker_from_tail(read, len(padded), "a.tar")["samples_out"] == 3
    assert 1 < len(read.reads) <= 3 and sum(length for _, length in read.reads) < 40_000
    plain = sealed(make_tar([("x.cls", b"1")]))  # smaller than one tail read: read whole
    assert marker_from_tail(Ranges(plain), len(plain), "b.tar")["members"] == 1


@pytest.mark.parametrize(("cut", "reason"), [
    (lambda s: s[:-512], "no end-of-archive blocks"),
    (lambda s: s[:-1024], "no end-of-archive blocks"),
    (lambda s: s[:-2048] + b"\0" * 1024, "not the end marker|no end marker"),
    (lambda s: s[:5000], "not whole 512-byte tar blocks"),
    (lambda s: s[:4096] + b"\0" * 1024, "no end marker|not the end marker"),
    (lambda s: s[:3072] + b'{"message": "sample failed", "status": 422}', "not whole 512-byte"),
    (lambda s: b"\0" * 4096, "all zeros"),
    (lambda s: b"", "empty object"),
])
def test_a_cut_or_foreign_object_names_why(shard: bytes, cut, reason: str) -> None:
    data = cut(shard)
    with pytest.raises(ShardError, match=rf"'a.tar': .*({reason})"):
        marker_from_tail(Ranges(data), len(data), "a.tar")


def test_a_shard_without_any_marker_names_its_last_member() -> None:
    data = make_tar([("x.cls", b"1"), ("x.txt", b"hello")])
    with pytest.raises(ShardError, match="its last member is 'x.txt', not the end marker"):
        marker_from_tail(Ranges(data), len(data), "plain.tar")


def test_a_marker_that_counts_other_bytes_is_refused(shard: bytes) -> None:
    with tarfile.open(fileobj=io.BytesIO(shard)) as archive:
        second = archive.getmembers()[2].offset
    shifted = shard[second:]  # the first sample gone: the marker still ends it, but counts more bytes
    with pytest.raises(ShardError, match=rf"the end marker counts {len(shard) - TAIL_BYTES} bytes before it, "
                                         rf"the object holds {len(shifted) - TAIL_BYTES}"):
        marker_from_tail(Ranges(shifted), len(shifted), "a.tar")
    broken = shard[:-1536] + b"not json".ljust(512, b"\0") + b"\0" * 1024
    with pytest.raises(ShardError, match="is not a valid end marker"):
        marker_from_tail(Ranges(broken), len(broken), "a.tar")


@pytest.mark.parametrize("fields", [{}, {"source": {"size": 10240, "cksum_type": "xxhash2", "cksum": "0" * 16},
                                     "settings": "f" * 32, "version": "0.1.0"}], ids=["older", "current"])
def test_markers_from_before_and_with_the_input_fields_are_both_proven(fields: dict) -> None:
    from transformer.integrity import ShardCheck
    from transformer.shards import read_samples

    data = sealed(make_tar([("s-0.jpg", jpeg_bytes(0, (16, 16))), ("s-0.cls", b"0")]), **fields)
    marker = marker_from_tail(Ranges(data), len(data), "a.tar")
    check = ShardCheck("a.tar")
    for sample in read_samples(io.BytesIO(data), "a.tar", 1 << 20):
        check.sample(sample)
    assert check.finish() == marker and ("input" in marker) == bool(fields)
