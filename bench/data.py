"""Benchmark shards: the project's demo shards, and a large shard made by repeating their samples.

Shards live in an AIS-like mountpath layout (``<root>/mp/@ais/bench/%ob/<name>``) so that the same files
can be sent as a request body and named by ``etl_fqn`` (the service accepts only FQNs with that layout).
"""

from __future__ import annotations

import io
import itertools
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from webdataset.tariterators import base_plus_ext

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
BUCKET = "bench"


@dataclass(frozen=True)
class Shard:
    """A shard file and what is in it (counted once, so throughput needs no second pass)."""

    path: Path
    samples: int
    images: int

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    @property
    def object_path(self) -> str:
        """``<bucket>/<object>``: the hpush URL path an AIS target uses."""
        return f"{BUCKET}/{self.path.name}"


def object_dir(root: Path) -> Path:
    folder = root / "mp" / "@ais" / BUCKET / "%ob"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def count(path: Path) -> Shard:
    samples, images, last_key = 0, 0, None
    with tarfile.open(path, "r|") as archive:
        for info in archive:
            key, ext = base_plus_ext(info.name)
            if key is None:
                continue
            if key != last_key:
                samples, last_key = samples + 1, key
            if ext.rsplit(".", 1)[-1].lower() in IMAGE_EXTS:
                images += 1
    return Shard(path, samples, images)


def demo_shards(root: Path, shards: int, samples: int, seed: int = 0) -> list[Shard]:
    """The demo generator's shards (ImageNet-like JPEGs), written once per (shards, samples, seed)."""
    return _generated(root, shards, samples, seed, "demo", {})


def photo_shards(root: Path, shards: int, samples: int, seed: int = 0) -> list[Shard]:
    """Multi-megapixel photographs: the demo's views at 3000 on the long side (about 6 MP), grain, quality 90."""
    return _generated(root, shards, samples, seed, "photo6mp", {"long_side": 3000, "quality": 90})


def _generated(root: Path, shards: int, samples: int, seed: int, name: str, kwargs: dict) -> list[Shard]:
    from transformer.demo import make_shards

    folder = object_dir(root)
    tag = f"{name}-{shards}x{samples}-s{seed}"
    staging = root / tag
    if not (staging / "done").exists():
        staging.mkdir(parents=True, exist_ok=True)
        paths = [Path(p) for p in make_shards(staging, shards=shards, samples=samples, seed=seed, progress=False,
                                              **kwargs)]
        for index, path in enumerate(sorted(paths)):
            path.replace(folder / f"{tag}-{index:03d}.tar")
        (staging / "done").write_text("ok")
    return [count(p) for p in sorted(folder.glob(f"{tag}-*.tar"))]


def sized_shard(root: Path, sources: list[Shard], target_bytes: int, name: str) -> Shard:
    """A shard of about ``target_bytes`` (the first sample boundary past it), streamed to disk.

    Samples are taken from ``sources`` in order, cycling through them again as often as needed; from
    the second pass on, keys get a ``_r<pass>`` suffix so every sample stays unique (webdataset groups
    by key and would merge repeats). Only one source shard's members are in memory at a time.
    """
    path = object_dir(root) / name
    if path.exists() and path.stat().st_size >= target_bytes:
        return count(path)
    partial = path.with_name(path.name + ".partial")
    written, last_key = 0, None
    with open(partial, "wb") as raw, tarfile.open(fileobj=raw, mode="w|", format=tarfile.USTAR_FORMAT) as out:
        for repeat, member_name, data in _cycle(sources):
            key, ext = base_plus_ext(member_name)
            if written >= target_bytes and key != last_key:
                break
            last_key = key
            info = tarfile.TarInfo(member_name if key is None or repeat == 0 else f"{key}_r{repeat:05d}.{ext}")
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            out.addfile(info, io.BytesIO(data))
            written += tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    partial.replace(path)
    return count(path)


def _cycle(sources: list[Shard]) -> Iterator[tuple[int, str, bytes]]:
    """(pass, member name, bytes) over the sources' file members, endlessly; ends if they hold none."""
    for repeat in itertools.count():
        empty = True
        for source in sources:
            for member_name, data in _members(source.path):
                empty = False
                yield repeat, member_name, data
        if empty:
            return


def _members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path, "r|") as archive:
        return [(info.name, archive.extractfile(info).read()) for info in archive if info.isfile()]
