"""A picture of a shard: a grid of its transformed samples, de-normalized, with keys and labels.

Works on transformed shards (``.npy`` members, any dtype/layout) and on raw shards, which are first
transformed with the service's engine (and shown next to the original). Masks are drawn over their
image.
"""

from __future__ import annotations

import io
import math
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .spec import IMAGENET_MEAN, IMAGENET_STD

_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass
class _Entry:
    key: str
    label: str = ""
    image: np.ndarray | None = None  # HWC float in [0, 1]
    mask: np.ndarray | None = None
    original: np.ndarray | None = None
    members: dict[str, bytes] = field(default_factory=dict)


def render_preview(shard: Path, output: Path, count: int = 16, etl_args: str = "") -> None:
    """Write a PNG grid of the first ``count`` samples of ``shard`` to ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = Path(shard).read_bytes()
    entries = _read(data, count)
    raw = any(name.rsplit(".", 1)[-1].lower() in _IMAGE_EXTS for e in entries for name in e.members) and not any(
        name.endswith(".npy") for e in entries for name in e.members
    )
    title = f"{Path(shard).name}: transformed samples"
    if raw:
        originals = {e.key: _first_image(e) for e in entries}
        transformed, description = _transform(data, Path(shard).name, etl_args, count)
        entries = _read(transformed, count)
        for entry in entries:
            entry.original = originals.get(entry.key)
        title = f"{Path(shard).name} through {description} (left: original, right: output)"
    for entry in entries:
        _decode_npy(entry)
    entries = [e for e in entries if e.image is not None]
    if not entries:
        raise ValueError(f"{shard}: no image or .npy samples to draw")

    panels = 2 if raw else 1
    columns = max(1, min(len(entries), math.ceil(math.sqrt(len(entries) * (2.0 if raw else 1.0)) / panels)))
    rows = math.ceil(len(entries) / columns)
    figure, axes = plt.subplots(rows, columns * panels, figsize=(2.6 * columns * panels, 2.9 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for index, entry in enumerate(entries):
        row, column = divmod(index, columns)
        caption = f"{entry.key}" + (f"\nlabel {entry.label}" if entry.label else "")
        if raw:
            left = axes[row][column * 2]
            if entry.original is not None:
                left.imshow(entry.original)
            left.set_title(caption, fontsize=8)
            target = axes[row][column * 2 + 1]
            target.set_title(f"{entry.image.shape[1]}x{entry.image.shape[0]}", fontsize=8)
        else:
            target = axes[row][column]
            target.set_title(caption, fontsize=8)
        target.imshow(entry.image)
        if entry.mask is not None:
            background = np.bincount(entry.mask.ravel().astype(np.int64) - entry.mask.min()).argmax() + entry.mask.min()
            target.imshow(np.ma.masked_equal(entry.mask, background), alpha=0.4, cmap="autumn", interpolation="nearest")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(output, dpi=80)
    plt.close(figure)


def _read(data: bytes, count: int) -> list[_Entry]:
    from webdataset.tariterators import base_plus_ext

    entries: list[_Entry] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as archive:
        for info in archive:
            if not info.isfile() or info.name.startswith("__"):
                continue
            key, ext = base_plus_ext(info.name)
            if key is None:
                continue
            if not entries or entries[-1].key != key:
                if len(entries) == count:
                    break
                entries.append(_Entry(key))
            payload = archive.extractfile(info).read()
            entries[-1].members[ext] = payload
            if ext.endswith("cls"):
                entries[-1].label = payload.decode(errors="replace").strip()
    return entries


def _first_image(entry: _Entry) -> np.ndarray | None:
    from PIL import Image

    for ext, payload in entry.members.items():
        if ext.rsplit(".", 1)[-1].lower() in _IMAGE_EXTS and not _is_mask(ext):
            with Image.open(io.BytesIO(payload)) as image:
                return np.asarray(image.convert("RGB"))
    return None


def _is_mask(ext: str) -> bool:
    return ext.split(".")[0] in ("trimap", "mask", "seg")


def _transform(data: bytes, name: str, etl_args: str, count: int) -> tuple[bytes, str]:
    """The first ``count`` samples of a raw shard through the service's own engine."""
    from .config import Settings
    from .engine import TransformPool, transform_shard
    from .options import parse_etl_args

    settings = Settings.from_env()
    options = parse_etl_args(etl_args, settings)
    pool = TransformPool(settings.workers, settings.max_inflight)
    try:
        output = b"".join(bytes(chunk) for chunk in transform_shard(
            io.BytesIO(data), options, pool, shard=name, object_name=name, window=settings.window))
    finally:
        pool.shutdown()
    return output, f"{options.pipeline.name} ({options.dtype}, {options.layout})"


def _decode_npy(entry: _Entry) -> None:
    for ext, payload in entry.members.items():
        if not ext.endswith("npy"):
            continue
        array = np.load(io.BytesIO(payload), allow_pickle=False)
        if array.ndim == 2 or _is_mask(ext):
            entry.mask = array if array.ndim == 2 else array.squeeze()
        elif entry.image is None:
            entry.image = to_displayable(array)


def to_displayable(array: np.ndarray) -> np.ndarray:
    """An image array as written by the service -> HWC float in [0, 1] (de-normalized when needed)."""
    if array.ndim != 3:
        raise ValueError(f"expected a 3-d image array, got shape {array.shape}")
    chw = array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3)
    image = np.moveaxis(array, 0, -1) if chw else array
    if image.dtype == np.uint8:
        image = image.astype(np.float32) / 255.0
    else:
        image = image.astype(np.float32)
        if image.min() < -0.01 or image.max() > 1.01:  # ImageNet-normalized: undo (x - mean) / std
            channels = image.shape[-1]
            mean = np.array(IMAGENET_MEAN[:channels] if channels == 3 else IMAGENET_MEAN[:1], np.float32)
            std = np.array(IMAGENET_STD[:channels] if channels == 3 else IMAGENET_STD[:1], np.float32)
            image = image * std + mean
    image = np.clip(image, 0.0, 1.0)
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image
