"""Hostile member names: what the engine does with each.

The service never uses a member name as a filesystem path (it reads one tar stream and writes
another), so names with ``..``, absolute paths or non-UTF-8 bytes are carried over exactly, with
only the image's extension changed to ``.npy``. A reader that extracts to disk must sanitize them
itself (``tarfile``'s ``filter="data"`` does); that is stated in docs/reliability.md.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable

import numpy as np
import pytest

from testbed.shardgen import jpeg_bytes, make_tar, read_output
from transformer.engine import ERROR_MANIFEST_NAME, ShardReport
from transformer.options import TransformOptions
from transformer.wire import END_MARKER_NAME

JPEG = jpeg_bytes(0, (96, 72))


def raw_members(data: bytes) -> list[tuple[bytes, bytes]]:
    """(name as raw bytes, payload) of every file member, read the way GNU tar would; an output's end
    marker is checked and left out."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8", errors="surrogateescape") as archive:
        members = [(m.name.encode("utf-8", "surrogateescape"), archive.extractfile(m).read())
                   for m in archive.getmembers() if m.isfile()]
    if members and members[-1][0] == END_MARKER_NAME.encode():
        read_output(data)
        members.pop()
    return members


def latin1_tar(names: list[str], fmt: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt, encoding="latin-1") as archive:
        for name in names:
            data = JPEG if name.endswith(".jpg") else b"7"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT], ids=["gnu", "ustar"])
def test_non_utf8_names_are_transformed_and_kept_byte_exact(
    fmt: int, run_shard: Callable[..., tuple[bytes, ShardReport]], make_options: Callable[..., TransformOptions]
) -> None:
    data = latin1_tar(["caf\xe9-01.jpg", "caf\xe9-01.cls"], fmt)
    assert b"caf\xe9-01.jpg" in data  # really a non-UTF-8 name on the wire
    output, report = run_shard(data, make_options(preset="imagenet-val", seed=3))
    assert report.errors == [], report.errors
    members = raw_members(output)
    assert [name for name, _ in members] == [b"caf\xe9-01.npy", b"caf\xe9-01.cls"]
    assert np.load(io.BytesIO(members[0][1]), allow_pickle=False).shape == (3, 224, 224)


def test_non_utf8_key_gets_a_reproducible_seed(
    run_shard: Callable[..., tuple[bytes, ShardReport]], make_options: Callable[..., TransformOptions]
) -> None:
    data = latin1_tar(["\xff\xfe.jpg"], tarfile.GNU_FORMAT)
    first, _ = run_shard(data, make_options(preset="imagenet-train", seed=11))
    second, _ = run_shard(data, make_options(preset="imagenet-train", seed=11))
    assert first == second


def test_traversal_absolute_and_dotted_names_are_carried_over_unchanged(
    run_shard: Callable[..., tuple[bytes, ShardReport]], make_options: Callable[..., TransformOptions]
) -> None:
    long_dir = "d" * 120
    names = ["../../etc/evil.jpg", "/abs/olute.jpg", "a.b.c.jpg", "a.b.c.json", f"{long_dir}/{'k' * 150}.jpg"]
    data = make_tar([(n, JPEG if n.endswith(".jpg") else b"{}") for n in names])
    output, report = run_shard(data, make_options(preset="imagenet-val"))
    assert report.errors == []
    out_names = [name.decode() for name, _ in raw_members(output)]
    # The key of "a.b.c.jpg" is "a" (webdataset: first dot of the basename), its image extension "b.c.jpg".
    assert out_names == ["../../etc/evil.npy", "/abs/olute.npy", "a.b.c.npy", "a.b.c.json",
                         f"{long_dir}/{'k' * 150}.npy"]


def test_adjacent_duplicate_image_members_skip_the_sample_with_a_reason(
    run_shard: Callable[..., tuple[bytes, ShardReport]], make_options: Callable[..., TransformOptions]
) -> None:
    data = make_tar([("d.jpg", JPEG), ("d.jpg", JPEG), ("d.cls", b"1"), ("e.jpg", JPEG), ("e.cls", b"2")])
    output, report = run_shard(data, make_options(preset="imagenet-val"))
    members = dict((n.decode(), d) for n, d in raw_members(output))
    assert list(members) == ["e.npy", "e.cls", ERROR_MANIFEST_NAME]
    manifest = json.loads(members[ERROR_MANIFEST_NAME])
    assert manifest["shard"] == "test.tar"
    assert manifest["errors"] == [{"key": "d", "member": "d.jpg", "action": "skipped",
                                   "reason": "output name 'd.npy' collides with another member"}]


def test_non_adjacent_duplicate_keys_are_separate_samples(
    run_shard: Callable[..., tuple[bytes, ShardReport]], make_options: Callable[..., TransformOptions]
) -> None:
    # Same rule as webdataset's group_by_keys: a key that comes back later starts a new sample.
    data = make_tar([("d.jpg", JPEG), ("e.cls", b"2"), ("d.cls", b"1")])
    output, report = run_shard(data, make_options(preset="imagenet-val"))
    assert [n.decode() for n, _ in raw_members(output)] == ["d.npy", "e.cls", "d.cls"]
    assert report.samples_in == report.samples_out == 3
