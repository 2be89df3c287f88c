"""A picture of a shard: its first samples as a grid, de-normalized, with keys and labels.

* Transformed shards (``.npy`` members): any dtype and layout the service writes. Float arrays are
  de-normalized with the ``Normalize`` of the service defaults, or of ``etl_args`` when given (say
  how the shard was made); uint8 arrays are shown as they are; the layout is read from the shape.
* Raw shards (JPEG/PNG members): the first ``count`` samples are run through the service's own
  engine (``transform_shard`` with ``etl_args``) and shown next to the originals. Sample seeds depend
  on the shard's file name and the sample key, so a seeded preview shows exactly what
  ``wds-transform apply`` or the service makes of that shard.
* Masks (``*.trimap.npy`` etc., or ``*.trimap.png`` in raw shards) are drawn over their image, the
  background (the value most common on the mask's edge) left clear.
* Samples the engine skipped or passed through show the reason from ``__etl__/errors.json``.

Drawing uses matplotlib's object API on the Agg canvas (no pyplot state, no display needed).
"""

from __future__ import annotations

import io
import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import TransformerError

if TYPE_CHECKING:  # runtime imports stay inside the functions: torch loads only when a preview is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .config import Settings
    from .options import TransformOptions
    from .shards import Sample

Normalize = tuple[tuple[float, ...], tuple[float, ...]] | None

MANIFEST_PREFIX = "__"  # webdataset's convention: "__*__/" members are metadata, not samples
_MASK_COLOURS = np.array(  # tab10, for mask values 1, 2, ... (the background is left clear)
    [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
     (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)], dtype=np.float32) / 255.0
_MASK_ALPHA = 0.2  # light enough to see the picture through; the outline is drawn solid
_PANEL_INCHES = 2.3  # per picture; captions get 0.55 in on top


@dataclass
class Cell:
    """One sample's pictures and captions, ready to draw."""

    key: str
    label: str  # the .cls text, with the class name from .json when it names a "source"
    image: np.ndarray | None = None  # HWC or HW float in [0, 1]; None when the sample was dropped
    mask: np.ndarray | None = None  # HW integer class map aligned with ``image``
    original: np.ndarray | None = None  # the raw image (raw shards only)
    original_mask: np.ndarray | None = None
    background: int = 0  # the mask value left clear (2 in Oxford-IIIT Pet trimaps, 0 elsewhere)
    caption: str = ""  # shape and dtype of the array, or why there is no picture


def render_preview(shard: Path, output: Path, count: int = 16, etl_args: str = "", *, originals: bool = True,
                   dpi: int = 100) -> None:
    """Write a PNG grid of the first ``count`` samples of ``shard`` (raw ones transformed first)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    cells, title = collect_cells(Path(shard), count, etl_args, originals=originals)
    figure = preview_figure(cells, title)
    FigureCanvasAgg(figure)
    output = Path(output)
    partial = output.with_name(output.name + ".partial")
    figure.savefig(partial, format="png", dpi=dpi, facecolor="white")
    partial.replace(output)  # never leave half a PNG under the final name


def collect_cells(shard: Path, count: int, etl_args: str = "", *, originals: bool = True) -> tuple[list[Cell], str]:
    """The first ``count`` samples with pictures, as cells, and a title describing what was done."""
    from .config import Settings
    from .options import parse_etl_args

    if count < 1:
        raise TransformerError(f"preview: count must be at least 1, got {count}")
    settings = Settings.from_env()
    options = parse_etl_args(etl_args, settings)
    head = _head(shard, count, settings.max_member_bytes, options.image_exts)
    if not head:
        raise TransformerError(f"shard '{shard}': no image or .npy samples to preview")

    mask_npy = {ext.rsplit(".", 1)[0] + ".npy" for ext in options.mask_exts}
    normalize = options.pipeline.normalize
    if any(ext.endswith("npy") for sample in head for ext in sample.extensions if ext):
        cells = [_cell(sample, mask_npy, normalize, options.image_exts, options.mask_exts) for sample in head]
        made = "etl_args" if etl_args.strip() else "the service defaults"
        return cells, f"{shard.name}: first {len(cells)} samples; floats de-normalized with the Normalize of {made}"

    transformed, manifest = _transform(head, shard, options, settings)
    errors = {error["key"]: error for error in manifest.get("errors", [])}
    cells = []
    for sample in head:
        if sample.key in transformed:
            cell = _cell(transformed[sample.key], mask_npy, normalize, options.image_exts, options.mask_exts)
        else:
            cell = Cell(sample.key, _label(sample))
        if sample.key in errors:
            error = errors[sample.key]
            cell.caption = f"{error['action']}: {error['reason']}"
        if originals:
            raw = _raw_pictures(sample, options.image_exts, options.mask_exts)
            cell.original, cell.original_mask, cell.background = raw
        cells.append(cell)
    seed = options.seed if options.seeded else "random"
    title = (f"{shard.name}: first {len(cells)} samples through {options.pipeline.name} "
             f"({options.dtype}, {options.layout}, seed {seed})")
    return cells, title + (", originals on the left" if originals else "")


def preview_figure(cells: list[Cell], title: str) -> Figure:
    """The grid as a matplotlib ``Figure``: one framed cell per sample, [original,] output inside."""
    from matplotlib.figure import Figure

    panels = 2 if any(cell.original is not None for cell in cells) else 1
    columns, rows = grid_shape(len(cells))
    figure = Figure(figsize=(columns * panels * _PANEL_INCHES, rows * (_PANEL_INCHES + 0.55) + 0.4),
                    layout="constrained")
    figure.suptitle(textwrap.fill(title, int(columns * panels * _PANEL_INCHES * 11)), fontsize=11)
    grid = figure.subfigures(rows, columns, squeeze=False, wspace=0.02, hspace=0.02)
    for index, cell in enumerate(cells):
        frame = grid.flat[index]
        frame.set_facecolor("#f0f0f0")
        frame.suptitle(f"{cell.key}\n{cell.label}", fontsize=8.5, fontweight="bold")
        axes = frame.subplots(1, panels, squeeze=False)[0]
        if panels == 2:
            size = "" if cell.original is None else f" {cell.original.shape[1]}x{cell.original.shape[0]}"
            _draw(axes[0], cell.original, cell.original_mask, cell.background, f"original{size}")
        _draw(axes[-1], cell.image, cell.mask, cell.background, cell.caption)
    for frame in grid.flat[len(cells):]:
        frame.set_facecolor("white")
    return figure


def grid_shape(samples: int) -> tuple[int, int]:
    """(columns, rows) of sample cells: as square as possible, so 16 samples are 4 x 4."""
    columns = math.ceil(math.sqrt(samples))
    return columns, math.ceil(samples / columns)


def to_display(array: np.ndarray, normalize: Normalize) -> np.ndarray:
    """An image array as the service writes it -> HWC (or HW) float in [0, 1] for ``imshow``.

    uint8 is taken as 0..255 pixels; float16/float32 as ``(x / 255 - mean) / std`` with ``normalize``
    (or as x / 255 when it is None, which is what a pipeline without Normalize writes).
    """
    layout = detect_layout(array.shape)
    image = np.moveaxis(array, 0, -1) if layout == "CHW" else array
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    if image.dtype == np.uint8:
        return image.astype(np.float32) / 255.0
    if not np.issubdtype(image.dtype, np.floating):
        raise TransformerError(f"preview: cannot show an image array of dtype {image.dtype}")
    image = image.astype(np.float32)
    if normalize is not None:
        mean, std = (np.asarray(v, np.float32) for v in normalize)
        channels = image.shape[-1] if image.ndim == 3 else 1
        if len(mean) not in (1, channels):
            raise TransformerError(f"preview: Normalize has {len(mean)} values but the image has {channels} channels")
        image = image * std + mean
    return np.clip(image, 0.0, 1.0)


def detect_layout(shape: tuple[int, ...]) -> str:
    """'CHW', 'HWC' or 'HW' for an image array's shape (channels are 1, 3 or 4)."""
    if len(shape) == 2:
        return "HW"
    if len(shape) == 3:
        first, last = shape[0] in (1, 3, 4), shape[-1] in (1, 3, 4)
        if first and not last:
            return "CHW"
        if last:
            return "HWC"
    raise TransformerError(f"preview: an image array of shape {tuple(shape)} is neither CHW, HWC nor HW")


def mask_overlay(mask: np.ndarray, background: int = 0) -> np.ndarray:
    """RGBA float overlay of a class map: ``background`` clear, each other value in its own colour."""
    rgba = np.empty(mask.shape + (4,), np.float32)
    rgba[..., :3] = _MASK_COLOURS[(mask.astype(np.int64) - 1) % len(_MASK_COLOURS)]
    rgba[..., 3] = np.where(mask != background, _MASK_ALPHA, 0.0)
    return rgba


def _background(extension: str) -> int:
    """The clear value of a mask: Oxford-IIIT Pet trimaps use 1 pet, 2 background, 3 border."""
    return 2 if extension.lower().split(".", 1)[0] == "trimap" else 0


def _draw(axis: Axes, image: np.ndarray | None, mask: np.ndarray | None, background: int, caption: str) -> None:
    axis.set_axis_off()
    axis.set_title(textwrap.fill(caption, 42), fontsize=7)
    if image is None:
        return
    axis.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="antialiased")
    if mask is not None and mask.shape == image.shape[:2]:
        axis.imshow(mask_overlay(mask, background), interpolation="nearest")
        if (mask != background).any() and (mask == background).any():
            axis.contour(mask != background, levels=[0.5], colors="yellow", linewidths=0.8)


def _head(shard: Path, count: int, max_member_bytes: int, image_exts: frozenset[str]) -> list[Sample]:
    """The first ``count`` samples that hold an image or an array (metadata members skipped)."""
    from .shards import read_samples

    try:
        stream = open(shard, "rb")
    except OSError as exc:
        raise TransformerError(f"shard '{shard}': cannot open ({exc.strerror})") from None
    head: list[Sample] = []
    with stream:
        samples = read_samples(stream, str(shard), max_member_bytes)
        try:
            for sample in samples:
                if sample.key.split("/", 1)[0].startswith(MANIFEST_PREFIX):
                    continue
                if any(ext and (ext.endswith("npy") or ext.rsplit(".", 1)[-1].lower() in image_exts)
                       for ext in sample.extensions):
                    head.append(sample)
                    if len(head) == count:
                        break
        finally:
            samples.close()  # stop reading: a preview never needs the rest of a large shard
    return head


def _transform(head: list[Sample], shard: Path, options: TransformOptions,
               settings: Settings) -> tuple[dict[str, Sample], dict]:
    """Run the head samples through the engine; (output samples by key, error manifest)."""
    from .engine import ERROR_MANIFEST_NAME, transform_shard
    from .pool import TransformPool
    from .shards import member_bytes, read_samples
    from .wire import END_OF_ARCHIVE

    # Only the samples shown are transformed; per-sample seeds depend on (object name, key), not on
    # position, so the result equals that of transforming the whole shard.
    tar = b"".join(bytes(piece) for sample in head for member in sample.members for piece in member_bytes(member))
    pool = TransformPool(settings.workers, settings.max_inflight)
    try:
        output = b"".join(bytes(chunk) for chunk in transform_shard(
            io.BytesIO(tar + END_OF_ARCHIVE), options, pool, shard=str(shard), object_name=shard.name,
            window=settings.window))
    finally:
        pool.shutdown()
    transformed: dict[str, Sample] = {}
    manifest: dict = {}
    for sample in read_samples(io.BytesIO(output), str(shard), settings.max_member_bytes):
        for member in sample.members:
            if member.info.name == ERROR_MANIFEST_NAME:
                manifest = json.loads(member.data)
        transformed[sample.key] = sample
    return transformed, manifest


def _cell(sample: Sample, mask_npy: set[str], normalize: Normalize, image_exts: frozenset[str],
          mask_exts: frozenset[str]) -> Cell:
    """A transformed sample's picture: its first image array with its mask, or a passed-through image."""
    cell = Cell(sample.key, _label(sample))
    for member, ext in zip(sample.members, sample.extensions):
        if not ext or not ext.endswith("npy"):
            continue
        array = _load_npy(member.data, sample.key, member.info.name)
        if ext.lower() in mask_npy:
            cell.mask = array if array.ndim == 2 else None
            cell.background = _background(ext)
        elif cell.image is None:
            cell.image = to_display(array, normalize)
            cell.caption = f"{array.dtype} {detect_layout(array.shape)} {tuple(array.shape)}"
    if cell.image is None:  # kept as it came in (on_error=passthrough): show the source image
        cell.image, cell.mask, cell.background = _raw_pictures(sample, image_exts, mask_exts)
        cell.caption = "not transformed" if cell.image is not None else "no image"
    return cell


def _load_npy(data: bytes, key: str, name: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise TransformerError(f"sample '{key}' (member '{name}'): not a readable .npy ({exc})") from None


def _raw_pictures(sample: Sample, image_exts: frozenset[str],
                  mask_exts: frozenset[str]) -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """A raw sample's first image (HWC/HW float), its mask and the mask's clear value, decoded with PIL."""
    from PIL import Image

    image = mask = None
    background = 0
    for member, ext in zip(sample.members, sample.extensions):
        if not ext:
            continue
        is_mask = ext.lower() in mask_exts
        if not is_mask and (image is not None or ext.rsplit(".", 1)[-1].lower() not in image_exts):
            continue
        try:
            with Image.open(io.BytesIO(member.data)) as picture:
                if is_mask:
                    array = np.array(picture)
                    mask = array[..., 0] if array.ndim == 3 else array
                    background = _background(ext)
                else:
                    image = np.asarray(picture.convert("L" if picture.mode == "L" else "RGB"), np.float32) / 255.0
        except Exception:  # an undecodable original still leaves the rest of the preview useful
            continue
    return image, mask, background


def _label(sample: Sample) -> str:
    """``cls 3 (cat)``: the .cls text, plus the class name a demo shard's .json gives as "source"."""
    text, name = "", ""
    for member, ext in zip(sample.members, sample.extensions):
        if ext == "cls":
            text = member.data.decode("utf-8", errors="replace").strip()
        elif ext == "json":
            try:
                meta = json.loads(member.data)
            except ValueError:
                continue
            if isinstance(meta, dict) and isinstance(meta.get("source"), str):
                name = meta["source"]
    if not text:
        return name
    return f"cls {text}" + (f" ({name})" if name else "")
