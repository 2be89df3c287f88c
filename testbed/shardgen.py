"""Test shards and images built in memory: real photographs (scikit-image's bundled samples), textured JPEGs.

``shard_bytes`` is the small labelled shard the real-ETL tests and benchmarks put into AIS.
"""

from __future__ import annotations

import io
import json
import tarfile
from functools import cache
from typing import Any

import numpy as np
from PIL import Image

from transformer.integrity import end_marker_payload
from transformer.wire import END_MARKER_FORMAT, END_MARKER_NAME

_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@cache
def photo(index: int) -> np.ndarray:
    import skimage.data

    return getattr(skimage.data, _PHOTOS[index % len(_PHOTOS)])()


def jpeg_bytes(index: int = 0, size: tuple[int, int] = (500, 375), quality: int = 90, mode: str = "RGB") -> bytes:
    """A real photo resized to ``size`` (width, height) as JPEG."""
    image = Image.fromarray(photo(index)).convert("RGB").resize(size).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def trimap_bytes(size: tuple[int, int] = (500, 375)) -> bytes:
    """An Oxford-Pet-like trimap: 1 foreground, 2 background, 3 border."""
    width, height = size
    mask = np.full((height, width), 2, np.uint8)
    mask[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 1
    mask[height // 4 : 3 * height // 4, width // 4] = 3
    return png_bytes(mask)


def make_tar(members: list[tuple[str, bytes]], mtime: int = 1_700_000_000) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, 0o640
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sealed(data: bytes, **fields: Any) -> bytes:
    """The tar with the ETL's end marker after its last member, as the service ends every shard it writes.

    ``fields`` (``source``, ``settings``, ``version``) give the marker what it was made from, as the pod
    records it now; without them it is a marker from before those fields."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        members = archive.getmembers()
        end = archive.offset  # where the end-of-archive blocks start
    keys = {m.name.rsplit("/", 1)[-1].split(".", 1)[0] for m in members}
    payload = end_marker_payload(samples_in=len(keys),
                                 samples_out=len(keys), skipped=0, passed_through=0, members=len(members),
                                 bytes_before=end, **fields)
    info = tarfile.TarInfo(END_MARKER_NAME)
    info.size, info.mtime, info.mode = len(payload), 1_700_000_000, 0o644
    padding = b"\0" * (-len(payload) % tarfile.BLOCKSIZE)
    return data[:end] + info.tobuf(tarfile.USTAR_FORMAT) + payload + padding + b"\0" * (2 * tarfile.BLOCKSIZE)


def imagenet_like_members(samples: int, extra: bool = True) -> list[tuple[str, bytes]]:
    """``sample-%06d.jpg`` + ``.cls`` (+ ``.json`` when ``extra``) per sample, photos cycling."""
    members = []
    for i in range(samples):
        key = f"sample-{i:06d}"
        members.append((f"{key}.jpg", jpeg_bytes(i)))
        members.append((f"{key}.cls", str(i % len(_PHOTOS)).encode()))
        if extra:
            members.append((f"{key}.json", b'{"index": %d}' % i))
    return members


def imagenet_like_shard(samples: int = 8, extra: bool = True) -> bytes:
    return make_tar(imagenet_like_members(samples, extra))


def read_tar(data: bytes) -> list[tuple[str, bytes]]:
    """(name, bytes) of every file member, in order; an end marker, if there is one, is checked and left out."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        infos = archive.getmembers()
        members = [(m.name, archive.extractfile(m).read()) for m in infos if m.isfile()]
    if not infos or infos[-1].name != END_MARKER_NAME:
        assert END_MARKER_NAME not in [m.name for m in infos], "the end marker is not the last member"
        return members
    marker = json.loads(members[-1][1])
    assert marker["format"] == END_MARKER_FORMAT, marker
    assert (marker["members"], marker["bytes"]) == (len(infos) - 1, infos[-1].offset), (marker, len(infos))
    return members[:-1]


def read_output(data: bytes) -> list[tuple[str, bytes]]:
    """``read_tar`` of a shard the service wrote, which must end with a valid end marker."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        names = archive.getnames()
    assert names and names[-1] == END_MARKER_NAME, f"no end marker: the output ends with {names[-1:]}"
    return read_tar(data)


def torchvision_decode(data: bytes, rgb: bool = False):  # -> torch.Tensor (torch imported on use)
    """``torchvision.io.decode_image`` of ``data`` (``rgb``: mode RGB): the tests' reference decoder.

    The wrapper warns on every call that torchvision 0.29 hands decoding to TorchCodec; that warning
    is silenced here only. The pod calls the op beneath the wrapper and never warns
    (transformer/samples.py).
    """
    import warnings

    import torch
    from torchvision.io import ImageReadMode, decode_image

    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.io")
        return decode_image(encoded, mode=ImageReadMode.RGB if rgb else ImageReadMode.UNCHANGED)


def npy_bytes(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    """The ``.npy`` member numpy writes for ``array`` (``np.save``'s bytes; ``version`` to force one)."""
    from numpy.lib import format as npy

    buffer = io.BytesIO()
    npy.write_array(buffer, array, version=version, allow_pickle=True)
    return buffer.getvalue()


def textured_jpeg(width: int, height: int, seed: int, quality: int, grey: bool = False) -> bytes:
    """A smooth colour field with a few sharp shapes and grain, as JPEG: content at every frequency."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    for _ in range(6):  # rectangles with hard edges
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(width // 10, width // 2), y0 + rng.integers(height // 10, height // 2)
        field[y0:y1, x0:x1] = 0.5 * field[y0:y1, x0:x1] + rng.uniform(0, 128, 3)
    field += rng.normal(0, rng.uniform(2, 12), (height, width, 1))
    image = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))
    buffer = io.BytesIO()
    (image.convert("L") if grey else image).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def shard_bytes(index: int, samples: int = 6) -> bytes:
    """A WebDataset shard of ``samples`` small JPEG samples with labels and pass-through members."""
    members = []
    for name, data in imagenet_like_members(samples):
        if name.endswith(".json"):  # which shard and sample: unique over a bucket
            data = json.dumps({"shard": index, "sample": int(name[7:13])}).encode()
        members.append((f"s{index:03d}-{name}", data))
    return make_tar(members)
