"""Part 3: ETL'd shards written in the pod's output format, the same images as uint8 and float32."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .constants import DISTINCT, MEAN, STD

# ---- 3. shards ----------------------------------------------------------------------------------------------


def distinct_images(size: int) -> Any:
    """The DISTINCT uint8 images the shards hold (seeded noise: nothing compresses, every byte counts)."""
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (DISTINCT, 3, size, size), dtype=np.uint8)


def as_float32(images: Any) -> Any:
    """The pod's float32 output of uint8 images: ``x * (1 / (255 std)) + (-mean / std)`` in float32,
    the multiply-add of transformer/samples.py."""
    import numpy as np

    mean = np.array(MEAN, np.float32).reshape(3, 1, 1)
    std = np.array(STD, np.float32).reshape(3, 1, 1)
    scale, shift = np.float32(1.0) / (np.float32(255.0) * std), -mean / std
    return images.astype(np.float32) * scale + shift


def write_shards(folder: Path, dtype: str, shards: int, per_shard: int, size: int) -> list[Path]:
    """Shards as the pod writes them (its tar writer, ``.npy`` then ``.cls`` per sample, the end
    marker): sample i is ``sample-<i>`` with label i and image i % DISTINCT."""
    import tarfile

    import numpy as np
    from numpy.lib import format as npy

    from transformer.integrity import end_marker_payload
    from transformer.shards import Member, json_member, member_bytes
    from transformer.wire import END_MARKER_NAME, END_OF_ARCHIVE

    images = distinct_images(size)
    images = images if dtype == "uint8" else as_float32(images)
    rows = [memoryview(np.ascontiguousarray(image)).cast("B") for image in images]
    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": npy.dtype_to_descr(images.dtype), "fortran_order": False,
                                        "shape": images.shape[1:]})

    def member(name: str, pieces: list) -> Member:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = sum(len(piece) for piece in pieces), 1_700_000_000, 0o644
        return Member(info=info, pieces=pieces)

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = folder / f"train-{s:04d}.tar"
        written = members = 0
        with open(path, "wb") as out:
            for i in range(s * per_shard, (s + 1) * per_shard):
                key = f"sample-{i:07d}"
                for sample_member in (member(f"{key}.npy", [header.getvalue(), rows[i % DISTINCT]]),
                                      member(f"{key}.cls", [b"%d" % i])):
                    members += 1
                    for piece in member_bytes(sample_member):
                        written += len(piece)
                        out.write(piece)
            payload = end_marker_payload(samples_in=per_shard, samples_out=per_shard, skipped=0, passed_through=0,
                                         members=members, bytes_before=written)
            for piece in member_bytes(json_member(END_MARKER_NAME, payload, 1_700_000_000)):
                out.write(piece)
            out.write(END_OF_ARCHIVE)
        paths.append(path)
    return paths


def shard_folder(work: Path, gigabytes: float) -> Path:
    """Where the shards go: memory (/dev/shm) when it has room for four times them, so that writing
    them costs no disk writeback (the loaders read them from memory either way: the page cache holds
    what was just written); else ``work``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * 1.25 * gigabytes * 1e9:
        return Path(tempfile.mkdtemp(prefix="bench-gpu-shards-", dir=shm))
    return work / "shards"


def make_shards(work: Path, gigabytes: float, per_shard: int, size: int) -> tuple[dict, dict]:
    sample_bytes = 3 * size * size * 4
    samples = max(per_shard, int(gigabytes * 1e9 / sample_bytes + per_shard - 1) // per_shard * per_shard)
    shards = {}
    for dtype in ("uint8", "float32"):
        shards[dtype] = write_shards(work / dtype, dtype, samples // per_shard, per_shard, size)
    sizes = {dtype: sum(p.stat().st_size for p in paths) for dtype, paths in shards.items()}
    return shards, {"folder": str(work), "samples": samples, "shards_per_dtype": samples // per_shard,
                    "samples_per_shard": per_shard, "image": [3, size, size], "bytes": sizes,
                    "gigabytes": round(sum(sizes.values()) / 1e9, 2)}
