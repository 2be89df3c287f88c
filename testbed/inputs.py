"""Hostile and unusual inputs, built in memory: broken images, decompression bombs, odd tars."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
import zlib

import numpy as np
from PIL import Image

from .shardgen import jpeg_bytes, make_tar, png_bytes

SMALL = (160, 120)  # small real photos keep the suite fast; imagenet-val still resizes to 224


def photo_jpeg(index: int = 0, mode: str = "RGB") -> bytes:
    return jpeg_bytes(index, SMALL, mode=mode)


def truncated_jpeg() -> bytes:
    data = photo_jpeg(1)
    return data[: len(data) // 2]


def garbage_jpeg() -> bytes:
    """A JPEG signature followed by noise: the decoder cannot even identify it."""
    return b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8


def rgba_png() -> bytes:
    rgba = np.zeros((120, 160, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 96  # half-transparent red
    return png_bytes(rgba)


def png16() -> bytes:
    """A 16-bit grayscale PNG (mode I;16) with a real gradient."""
    values = (np.arange(120 * 160, dtype=np.uint32).reshape(120, 160) * 3).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "PNG")
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(width: int = 30000, height: int = 30000) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` RGB pixels, with a tiny payload."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 1024))
            + _png_chunk(b"IEND", b""))


def jpeg_bomb(width: int = 30000, height: int = 30000) -> bytes:
    """A real JPEG whose SOF0 frame header was rewritten to claim ``width`` x ``height``."""
    data = bytearray(photo_jpeg(2))
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def long_name_tar(fmt: int, name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        info = tarfile.TarInfo(name)
        info.size, info.mtime = len(data), 1_700_000_000
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def gzip_tar(members: list[tuple[str, bytes]]) -> bytes:
    return gzip.compress(make_tar(members), mtime=0)


def cut_inside_header(shard: bytes, member_index: int) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(shard), mode="r:") as archive:
        info = archive.getmembers()[member_index]
    return shard[: info.offset + 100]


def cut_inside_member(shard: bytes, member_index: int) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(shard), mode="r:") as archive:
        info = archive.getmembers()[member_index]
    return shard[: info.offset_data + max(1, info.size // 2)]


def good_members(samples: int, start: int = 0) -> list[tuple[str, bytes]]:
    members = []
    for i in range(start, start + samples):
        members.append((f"s{i:05d}.jpg", photo_jpeg(i)))
        members.append((f"s{i:05d}.cls", str(i % 4).encode()))
    return members
