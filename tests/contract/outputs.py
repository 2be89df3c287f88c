"""Input shards for the contract tests and the rules a correct output shard follows.

Output rule (the service's product contract): each image member ``k.jpg`` / ``k.image.jpg`` becomes
``k.npy`` / ``k.image.npy`` (float32 CHW (3, 224, 224) ImageNet-normalized by default), each mask
``k.trimap.png`` becomes ``k.trimap.npy`` (H, W) uint8, every other member passes through byte-exact,
in input order. Failed samples are listed in ``__etl__/errors.json`` at the end.
"""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np

from testbed.shardgen import imagenet_like_members, jpeg_bytes, make_tar, read_output, read_tar, trimap_bytes

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MASK_EXTS = ("trimap.png", "mask.png", "seg.png")
ERROR_MANIFEST = "__etl__/errors.json"


def image_shard(samples: int = 4, extra: bool = True) -> bytes:
    return make_tar(imagenet_like_members(samples, extra))


def plain_members(samples: int = 4, tag: str = "") -> list[tuple[str, bytes]]:
    """Members no transform touches (labels, metadata, text): the output must carry them as-is."""
    members = []
    for i in range(samples):
        key = f"doc-{i:04d}"
        members.append((f"{key}.cls", str(i).encode()))
        members.append((f"{key}.json", json.dumps({"i": i, "tag": tag}).encode()))
        members.append((f"{key}.txt", f"sample {i} {tag}\n".encode() * (i + 1)))
    return members


def plain_shard(samples: int = 4, tag: str = "") -> bytes:
    return make_tar(plain_members(samples, tag))


def segmentation_members() -> list[tuple[str, bytes]]:
    """Oxford-Pet-like samples: ``k.image.jpg`` + ``k.trimap.png`` + ``k.cls``."""
    return [
        ("pet-0001.image.jpg", jpeg_bytes(1)),
        ("pet-0001.trimap.png", trimap_bytes()),
        ("pet-0001.cls", b"1"),
        ("pet-0002.image.jpg", jpeg_bytes(2, size=(320, 480))),
        ("pet-0002.trimap.png", trimap_bytes((320, 480))),
        ("pet-0002.cls", b"2"),
    ]


def output_name(name: str) -> str:
    """The member name the service emits for an input member name."""
    base = name.rsplit("/", 1)[-1]
    if "." not in base:
        return name
    extension = base.split(".", 1)[1].lower()
    if extension in MASK_EXTS or extension.rsplit(".", 1)[-1] in IMAGE_EXTS:
        return name.rsplit(".", 1)[0] + ".npy"
    return name


def is_converted(name: str) -> bool:
    return output_name(name) != name


def npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def assert_transformed(
    inputs: list[tuple[str, bytes]],
    output: bytes,
    dtype: str = "float32",
    shape: tuple[int, ...] = (3, 224, 224),
) -> list[tuple[str, bytes]]:
    """Check ``output`` against the output rule for ``inputs`` (no failed samples, the end marker last);
    return its members before the marker."""
    members = read_output(output)
    assert [n for n, _ in members] == [output_name(n) for n, _ in inputs], "members renamed, lost or reordered"
    for (in_name, in_data), (out_name, out_data) in zip(inputs, members):
        if not is_converted(in_name):
            assert out_data == in_data, f"{in_name} must pass through byte-exact"
            continue
        array = npy(out_data)
        extension = in_name.rsplit("/", 1)[-1].split(".", 1)[1].lower()
        if extension in MASK_EXTS:
            mask_shape = shape[1:] if shape[0] == 3 else shape[:2]  # (H, W) of a CHW or HWC image
            assert array.dtype == np.uint8, f"{out_name}: mask dtype {array.dtype}, expected uint8"
            assert array.shape == mask_shape, f"{out_name}: mask shape {array.shape}, expected {mask_shape}"
        else:
            assert array.dtype == np.dtype(dtype), f"{out_name}: dtype {array.dtype}, expected {dtype}"
            assert array.shape == shape, f"{out_name}: shape {array.shape}, expected {shape}"
    return members


def error_manifest(output: bytes) -> dict | None:
    members = dict(read_tar(output))
    return json.loads(members[ERROR_MANIFEST]) if ERROR_MANIFEST in members else None


def truncated(shard: bytes, member_index: int) -> bytes:
    """``shard`` cut in the middle of the payload of its ``member_index``-th member (0-based)."""
    with tarfile.open(fileobj=io.BytesIO(shard), mode="r:") as archive:
        info = archive.getmembers()[member_index]
    return shard[: info.offset_data + max(1, info.size // 2)]
