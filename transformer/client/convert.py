"""Convert a folder dataset into WebDataset shards and upload them to an AIS bucket.

Layouts (``records_*`` functions yield one ``Record`` per sample, complete or not):

* ``labels``: image files anywhere under ``root`` plus a labels file with one ``<relative path>
  <label>`` line each (whitespace, comma or tab separated; ``#`` comments). A line with a tab is split
  at its first tab only, so paths and labels with spaces or commas are written tab-separated. Labels
  that are not all integers are numbered in sorted order (``ConvertReport.classes``).
* ``folders``: ``root/<class>/<image>`` (torchvision ``ImageFolder``), classes numbered in sorted order.
* ``pets``: the Oxford-IIIT Pet layout, ``images/<name>.jpg``, ``annotations/list.txt``
  (``<name> <class id 1-37> <species> <breed id>``) and ``annotations/trimaps/<name>.png`` ->
  ``<name>.image.jpg``, ``<name>.cls`` (class id - 1, so 0-36) and ``<name>.trimap.png``.

Incomplete records (no label, a missing or unreadable image or trimap) are reported and skipped.
Shards are written with webdataset's ``ShardWriter`` (``max_samples``/``max_bytes`` per shard, at
most ``max_shards``), each uploaded as soon as it is closed and then deleted locally.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConvertError

if TYPE_CHECKING:
    from aistore.sdk.bucket import Bucket

log = logging.getLogger("transformer.client")

LAYOUTS = ("labels", "folders", "pets")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
_SEPARATORS = re.compile(r"[\s,]+")


@dataclass
class Record:
    """One sample to write, or (``problem`` set) the reason it cannot be."""

    key: str
    members: dict[str, Path | bytes] = field(default_factory=dict)  # extension -> file or bytes
    label: int | None = None
    problem: str | None = None


@dataclass
class ConvertReport:
    """What ``convert`` wrote, and what it skipped and why."""

    samples: int = 0
    bytes: int = 0
    shards: list[str] = field(default_factory=list)  # object names (uploaded) or local paths
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)
    not_written: int = 0  # complete records left out by max_shards
    classes: dict[str, int] = field(default_factory=dict)


def sample_key(relative: str) -> str:
    """A WebDataset key for a file path: no directories and no dots, as readers split at the first dot."""
    stem = relative.rsplit(".", 1)[0] if "." in Path(relative).name else relative
    return re.sub(r"[./\\]", "_", stem)


def records_labels(root: Path, labels_file: Path) -> tuple[Iterator[Record], dict[str, int]]:
    """Records of the ``labels`` layout (see the module docstring)."""
    lines = []
    for number, line in enumerate(labels_file.read_text().splitlines(), 1):
        tabbed = "\t" in line
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t", 1) if tabbed else _SEPARATORS.split(line, maxsplit=1)
        parts = [part.strip() for part in parts]
        if len(parts) != 2 or not all(parts):
            raise ConvertError(f"{labels_file}:{number}: expected '<image path> <label>', got {line!r}")
        lines.append((parts[0], parts[1]))
    classes = _numbering([label for _, label in lines])
    labelled = {path: label for path, label in lines}

    def generate() -> Iterator[Record]:
        for relative, label in lines:
            image = root / relative
            record = Record(sample_key(relative), label=_label(label, classes))
            if not image.is_file():
                record.problem = f"image {relative} listed in {labels_file.name} does not exist"
            else:
                record.members[_image_ext(image)] = image
            yield record
        for image in sorted(_images(root)):
            relative = image.relative_to(root).as_posix()
            if relative not in labelled:
                yield Record(sample_key(relative), problem=f"image {relative} has no label in {labels_file.name}")

    return generate(), classes


def records_folders(root: Path) -> tuple[Iterator[Record], dict[str, int]]:
    """Records of the ``folders`` layout: one sub-folder per class."""
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise ConvertError(f"{root}: no class sub-folders")
    classes = {folder.name: index for index, folder in enumerate(folders)}

    def generate() -> Iterator[Record]:
        for folder in folders:
            for image in sorted(_images(folder)):
                relative = image.relative_to(root).as_posix()
                yield Record(sample_key(relative), {_image_ext(image): image}, label=classes[folder.name])

    return generate(), classes


def records_pets(root: Path) -> tuple[Iterator[Record], dict[str, int]]:
    """Records of the Oxford-IIIT Pet layout: ``image.jpg``, ``cls`` (0-36) and ``trimap.png``."""
    listing = root / "annotations" / "list.txt"
    images, trimaps = root / "images", root / "annotations" / "trimaps"
    if not listing.is_file() or not images.is_dir():
        raise ConvertError(f"{root}: not the Oxford-IIIT Pet layout (needs images/ and annotations/list.txt)")
    entries: dict[str, int] = {}
    breeds: dict[str, int] = {}
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[1].isdigit() or int(fields[1]) < 1:
            raise ConvertError(f"{listing}:{number}: expected '<name> <class id 1-37> ...', got {line!r}")
        entries[fields[0]] = int(fields[1]) - 1
        breeds.setdefault(fields[0].rsplit("_", 1)[0], int(fields[1]) - 1)

    def generate() -> Iterator[Record]:
        for name, label in entries.items():
            record = Record(sample_key(name), label=label)
            image, trimap = images / f"{name}.jpg", trimaps / f"{name}.png"
            if not image.is_file():
                record.problem = f"images/{name}.jpg listed in list.txt does not exist"
            elif not trimap.is_file():
                record.problem = f"annotations/trimaps/{name}.png does not exist"
            else:
                record.members.update({"image.jpg": image, "trimap.png": trimap})
            yield record
        for image in sorted(images.glob("*.jpg")):
            if image.stem not in entries:
                yield Record(sample_key(image.stem), problem=f"images/{image.name} has no entry in list.txt")

    return generate(), dict(sorted(breeds.items(), key=lambda item: item[1]))


def _images(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _image_ext(path: Path) -> str:
    suffix = path.suffix.lower().lstrip(".")
    return "jpg" if suffix == "jpeg" else suffix


def _numbering(labels: list[str]) -> dict[str, int]:
    """Integer labels stay as they are (empty mapping); any other labels are numbered in sorted order."""
    if all(re.fullmatch(r"-?\d+", label) for label in labels):
        return {}
    return {label: index for index, label in enumerate(sorted(set(labels)))}


def _label(text: str, classes: dict[str, int]) -> int:
    return classes[text] if classes else int(text)


def _unreadable(path: Path) -> str | None:
    """Why an image file cannot be decoded, or ``None``; header check only (``Image.verify``)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        return f"{path.name} is not a readable image ({exc.__class__.__name__}: {str(exc)[:120]})"
    return None


def convert(
    root: str | Path,
    *,
    layout: str,
    bucket: Bucket | None = None,
    prefix: str = "",
    output_dir: str | Path | None = None,
    labels_file: str | Path | None = None,
    pattern: str = "shard-%06d.tar",
    max_samples: int = 1000,
    max_bytes: int = 1 << 30,
    max_shards: int | None = None,
    verify_images: bool = True,
    progress: bool = True,
    upload: Callable[[Bucket, str, Path], Any] | None = None,
) -> ConvertReport:
    """Write ``root`` (in ``layout``) as WebDataset shards and upload each to ``bucket`` under ``prefix``.

    Without ``bucket`` the shards stay in ``output_dir``. With a bucket they are written to
    ``output_dir`` (a temporary folder by default), uploaded with ``put_file`` when closed, and removed.
    Raises ``ConvertError`` if the layout is not recognized or no record is complete.
    """
    from tqdm import tqdm
    from webdataset import ShardWriter

    root = Path(root)
    if layout == "labels":
        if labels_file is None:
            raise ConvertError("layout 'labels' needs labels_file")
        records, classes = records_labels(root, Path(labels_file))
    elif layout == "folders":
        records, classes = records_folders(root)
    elif layout == "pets":
        records, classes = records_pets(root)
    else:
        raise ConvertError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if bucket is None and output_dir is None:
        raise ConvertError("give a bucket to upload to, or an output_dir to keep the shards in")
    if max_samples < 1 or max_bytes < 1 or (max_shards is not None and max_shards < 1):
        raise ConvertError("max_samples, max_bytes and max_shards must be positive")

    report = ConvertReport(classes=classes)
    temporary = tempfile.TemporaryDirectory(prefix="wds-convert-") if output_dir is None else None
    folder = Path(temporary.name if temporary else output_dir)  # type: ignore[arg-type]
    folder.mkdir(parents=True, exist_ok=True)
    put = upload or _put_file

    def finished(path: str) -> None:
        if bucket is None:
            report.shards.append(path)
            return
        name = prefix + os.path.basename(path)
        put(bucket, name, Path(path))
        os.unlink(path)
        report.shards.append(name)

    writer = None
    try:
        for record in tqdm(records, desc=f"convert {root.name}", unit=" samples", disable=not progress):
            problem = record.problem
            if problem is None and verify_images:
                problem = next((p for m in record.members.values() if isinstance(m, Path)
                                for p in [_unreadable(m)] if p), None)
            if problem is not None:
                report.skipped.append((record.key, problem))
                log.warning("skipped sample %s: %s", record.key, problem)
                continue
            if writer is not None and max_shards is not None and writer.shard >= max_shards and (
                writer.count >= max_samples or writer.size >= max_bytes
            ):
                report.not_written += 1  # the next shard would exceed max_shards
                continue
            sample: dict[str, Any] = {"__key__": record.key}
            for extension, source in record.members.items():
                sample[extension] = source.read_bytes() if isinstance(source, Path) else source
            sample["cls"] = record.label
            if writer is None:
                # Created lazily: ShardWriter opens its first file at once, even if nothing follows.
                # The folder's own '%' (an AIS mountpath has '%ob') must not reach ShardWriter's `pattern % n`.
                writer = ShardWriter(str(folder).replace("%", "%%") + "/" + pattern, maxcount=max_samples,
                                     maxsize=max_bytes, post=finished, verbose=0)
            writer.write(sample)
            report.samples += 1
            report.bytes += sum(len(v) for k, v in sample.items() if isinstance(v, bytes))
        if writer is not None:
            writer.close()  # closes, and uploads, the last shard
            writer = None
    finally:
        if writer is not None:  # failed half-way: close the open shard without uploading it
            writer.post = None
            writer.close()
        if temporary is not None:
            temporary.cleanup()
    if report.samples == 0:
        raise ConvertError(f"{root}: no complete record to write ({len(report.skipped)} skipped)")
    if report.skipped:
        log.warning("%d incomplete records skipped, e.g. %s: %s", len(report.skipped), *report.skipped[0])
    return report


def _put_file(bucket: Bucket, name: str, path: Path) -> None:
    bucket.object(name).get_writer().put_file(path)
