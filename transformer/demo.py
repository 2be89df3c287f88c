"""The embedded demo dataset: ImageNet-like JPEG shards made from real photographs.

The photographs ship inside installed wheels (scikit-image's ``skimage/data`` and matplotlib's
``mpl-data/sample_data``), so nothing is downloaded at run time. Each class is one photograph; each
sample is a distinct view of it, the way an ImageNet image is one shot of its class:

* a rotated (up to 8 degrees), possibly mirrored crop covering 40-100 % of the largest box of the
  sample's aspect ratio that fits the photograph, resampled in one affine step;
* ImageNet's usual shapes: 500 on the long side, 320-400 on the short one, a quarter of them portrait;
* white balance, brightness, contrast, saturation and gamma jitter, then sensor-like noise (shot noise
  growing with brightness plus read noise) and in-camera sharpening, which bring a 500x375 JPEG at quality 93 to
  ~100 KB like a real photograph rather than ~50 KB like a smooth rescale.

Members per sample (keys ``sample-000123``, numbered across shards): ``.jpg``, ``.cls`` (class index as
text) and ``.json`` (source photograph and the crop). With ``masks=True`` the samples look like
Oxford-IIIT Pet instead: ``.image.jpg``, ``.trimap.png`` (1 subject, 2 background, 3 border), ``.cls``,
``.json``. The trimap is a coarse hand-drawn outline of each photograph's subject, carried through
the same crop, rotation and flip as the image (nearest-neighbour), so the transformer's joint
image/mask path can be checked by eye in the preview.

Everything is a pure function of ``(seed, sample index)``, and the tar headers carry a fixed mtime,
so the same arguments give byte-identical shards in the same environment.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageStat

from .errors import TransformerError

Point = tuple[float, float]


@dataclass(frozen=True)
class Photograph:
    """One class of the demo dataset: a bundled photograph and a rough outline of its subject."""

    name: str  # class name, written to the sample's .json
    package: str  # the installed package that ships the file
    file: str  # path inside the package's data folder
    subject: tuple[Point, ...]  # polygon around the main subject, in the photograph's pixels
    grayscale: bool = False  # kept as a 1-channel JPEG, as ~2 % of ImageNet is


def _ellipse(cx: float, cy: float, rx: float, ry: float, points: int = 48) -> tuple[Point, ...]:
    return tuple(
        (cx + rx * math.cos(2 * math.pi * i / points), cy + ry * math.sin(2 * math.pi * i / points))
        for i in range(points)
    )


# Real photographs only, each with one clear subject. Left out on purpose: hubble_deep_field and ihc
# (no single subject for a trimap), horse (a silhouette), motorcycle_right (near-duplicate of left),
# brick/grass/gravel/moon/coins/cell (textures, scans, micrographs), logo/text/page (not photographs).
PHOTOGRAPHS: tuple[Photograph, ...] = (
    Photograph("astronaut", "skimage", "data/astronaut.png", (
        (225, 14), (270, 22), (297, 55), (300, 110), (290, 150), (305, 175), (310, 230), (345, 260),
        (362, 300), (365, 345), (330, 380), (300, 420), (285, 470), (290, 512), (20, 512), (18, 430),
        (25, 330), (45, 265), (80, 240), (118, 225), (115, 180), (135, 155), (165, 140), (155, 100),
        (165, 55), (195, 25),
    )),
    Photograph("coffee", "skimage", "data/coffee.png", _ellipse(278, 228, 203, 160)),
    Photograph("cat", "skimage", "data/chelsea.png", (
        (0, 0), (395, 0), (390, 60), (368, 120), (372, 180), (385, 240), (400, 300), (0, 300),
    )),
    Photograph("rocket", "skimage", "data/rocket.jpg", (
        (322, 124), (333, 138), (337, 160), (337, 395), (345, 405), (380, 405), (380, 427), (265, 427),
        (265, 405), (300, 405), (307, 395), (307, 160), (311, 138),
    )),
    Photograph("motorcycle", "skimage", "data/motorcycle_left.png", (
        (95, 195), (150, 160), (260, 165), (340, 185), (400, 155), (460, 140), (480, 105), (530, 95),
        (585, 125), (580, 165), (560, 190), (560, 260), (620, 275), (660, 320), (690, 380), (680, 430),
        (640, 450), (585, 440), (540, 400), (520, 350), (470, 345), (420, 370), (345, 380), (340, 430),
        (325, 435), (310, 380), (270, 390), (210, 400), (150, 385), (122, 340), (120, 290), (100, 240),
    )),
    Photograph("grace-hopper", "matplotlib", "mpl-data/sample_data/grace_hopper.jpg", (
        (180, 40), (250, 22), (330, 40), (360, 90), (372, 140), (360, 190), (352, 250), (345, 300),
        (380, 330), (450, 360), (500, 400), (512, 450), (512, 600), (15, 600), (20, 440), (50, 380),
        (110, 345), (165, 325), (160, 270), (155, 200), (150, 140), (160, 90),
    )),
    Photograph("retina", "skimage", "data/retina.jpg", _ellipse(707, 704, 697, 698, 96)),
    Photograph("cameraman", "skimage", "data/camera.png", (
        (0, 195), (50, 150), (125, 110), (165, 75), (200, 65), (245, 75), (268, 100), (265, 140),
        (320, 140), (330, 180), (320, 220), (300, 245), (270, 250), (240, 250), (200, 260), (160, 300),
        (150, 380), (150, 512), (0, 512),
    ), grayscale=True),
)
CLASSES: tuple[str, ...] = tuple(p.name for p in PHOTOGRAPHS)

LONG_SIDE = 500
SHORT_SIDE = (320, 400)  # inclusive range; ImageNet's most common shape is 500x375
PORTRAIT = 0.25  # share of portrait samples
AREA = (0.40, 1.0)  # fraction of the largest fitting box's area that the crop covers
MAX_ANGLE = 8.0  # degrees
# Noise variance in 8-bit units: shot * (signal / 255) + read (sigma 2-6, times an "ISO" of 0.7-1.4),
# then in-camera sharpening. With quality 93 this makes the JPEGs average ~97 KB (tests check 70-130):
# without grain and sharpening the smooth, often upscaled crops of these small photographs give ~50 KB,
# and quality 90 would need grain strong enough to look like ISO 3200 film to reach 100 KB.
NOISE_SHOT = 36.0
NOISE_READ = 4.0
SHARPEN = ImageFilter.UnsharpMask(radius=1.5, percent=150, threshold=0)
JPEG_QUALITY = 93
TRIMAP_BORDER = 5  # border band of the trimap, in output pixels (Oxford-IIIT Pet draws a few pixels)
MTIME = 1_700_000_000  # fixed member mtime: the same seed gives byte-identical shards


def make_shards(
    output: Path, shards: int, samples: int, seed: int, *, masks: bool = False, progress: bool = True,
    long_side: int = LONG_SIDE, quality: int = JPEG_QUALITY,
) -> list[Path]:
    """Write ``demo-000000.tar``, ``demo-000001.tar``... into ``output``; return their paths in order.

    ``samples`` per shard; keys run on across shards (``sample-000000``...). ``masks`` writes
    Oxford-Pet-like samples (``image.jpg`` + ``trimap.png``). ``long_side`` and ``quality`` make other
    photographs than ImageNet's (``long_side=3000, quality=90``: about 6 MP, as a camera's). A shard
    appears under its final name only once it is complete (written as ``.partial`` first).
    """
    from tqdm import tqdm
    from webdataset import ShardWriter

    if shards < 1 or samples < 1:
        raise TransformerError(f"make-shards: need at least 1 shard and 1 sample per shard (got {shards}, {samples})")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    streams: dict[str, BinaryIO] = {}

    def open_partial(name: str) -> BinaryIO:
        streams[name] = open(name + ".partial", "wb")
        return streams[name]

    def finish(name: str) -> None:  # ShardWriter calls this after the tar's end blocks are written
        streams.pop(name).close()
        Path(name + ".partial").replace(name)
        written.append(Path(name))

    writer = ShardWriter(
        # The folder goes through %-formatting too: AIS disk paths contain "%ob".
        str(output).replace("%", "%%") + "/demo-%06d.tar", maxcount=samples, verbose=0,
        opener=open_partial, post=finish,
        encoder=False, mtime=MTIME, mode=0o644, user="demo", group="demo",
    )
    try:
        with tqdm(total=shards * samples, unit="img", desc="demo shards", disable=not progress) as bar:
            for index in range(shards * samples):
                writer.write(make_sample(index, seed, masks=masks, long_side=long_side, quality=quality))
                bar.update()
        writer.close()
    finally:
        for name, stream in streams.items():  # only left over after a failure: drop the partial shard
            stream.close()
            Path(name + ".partial").unlink(missing_ok=True)
    return written


def make_sample(index: int, seed: int, *, masks: bool = False, long_side: int = LONG_SIDE,
                quality: int = JPEG_QUALITY) -> dict[str, Any]:
    """Sample number ``index`` of the dataset with this seed, as encoded webdataset members."""
    rng = np.random.default_rng([seed % 2**64, index])  # independent of shard size and order
    label = int(rng.integers(len(PHOTOGRAPHS)))
    photo = PHOTOGRAPHS[label]
    short = int(rng.integers(SHORT_SIDE[0], SHORT_SIDE[1] + 1)) * long_side // LONG_SIDE
    width, height = (short, long_side) if rng.random() < PORTRAIT else (long_side, short)
    view = _draw_view(photo, width, height, rng)
    image = _develop(_render(photo, view, width, height), rng)

    meta = {
        "source": photo.name,
        "file": f"{photo.package}/{photo.file}",
        "class": label,
        "size": [width, height],
        "box": view.box(),
        "angle": round(view.angle, 2),
        "flip": view.flip,
        "seed": seed,
    }
    sample: dict[str, Any] = {
        "__key__": f"sample-{index:06d}",
        "cls": str(label).encode(),
        "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(),
    }
    jpeg = _encode(image, "JPEG", quality=quality)
    if masks:
        sample["image.jpg"] = jpeg
        sample["trimap.png"] = _encode(_trimap(photo, view, width, height), "PNG")
    else:
        sample["jpg"] = jpeg
    return sample


@dataclass(frozen=True)
class _View:
    """Where a sample's pixels come from: a rotated box in the photograph, optionally mirrored."""

    center: Point
    width: float  # of the box, in photograph pixels
    height: float
    angle: float  # degrees, counter-clockwise
    flip: bool

    def box(self) -> list[int]:
        """Axis-aligned bounding box [left, top, right, bottom] of the rotated crop, photograph pixels."""
        cos, sin = abs(math.cos(math.radians(self.angle))), abs(math.sin(math.radians(self.angle)))
        half_w = (self.width * cos + self.height * sin) / 2
        half_h = (self.width * sin + self.height * cos) / 2
        cx, cy = self.center
        return [round(cx - half_w), round(cy - half_h), round(cx + half_w), round(cy + half_h)]


def _draw_view(photo: Photograph, width: int, height: int, rng: np.random.Generator) -> _View:
    full_w, full_h = _photo_size(photo)
    angle = float(rng.uniform(-MAX_ANGLE, MAX_ANGLE))
    cos, sin = abs(math.cos(math.radians(angle))), abs(math.sin(math.radians(angle)))
    aspect = width / height
    # The largest box of this aspect whose rotated outline still lies inside the photograph
    # (no black corners), then a random share of its area.
    largest = min(full_w / (cos + sin / aspect), full_h / (sin + cos / aspect))
    box_w = largest * math.sqrt(float(rng.uniform(*AREA)))
    box_h = box_w / aspect
    half_w, half_h = (box_w * cos + box_h * sin) / 2, (box_w * sin + box_h * cos) / 2
    cx = float(rng.uniform(half_w, full_w - half_w))
    cy = float(rng.uniform(half_h, full_h - half_h))
    return _View((cx, cy), box_w, box_h, angle, bool(rng.random() < 0.5))


def _render(photo: Photograph, view: _View, width: int, height: int) -> Image.Image:
    """The view resampled to width x height in one affine step."""
    # Interpolation aliases when shrinking by more than ~1.5x: average whole pixel blocks first, so
    # the affine step only ever scales by 0.67-1.5 and bilinear is enough (and cheaper than bicubic).
    factor = max(1, round(view.width / width))
    matrix = _affine(view, width, height, factor)
    return _photo(photo, factor).transform((width, height), Image.Transform.AFFINE, matrix,
                                           resample=Image.Resampling.BILINEAR)


def _affine(view: _View, width: int, height: int, factor: int) -> tuple[float, ...]:
    """PIL's output->input matrix: centre the output, scale, mirror, rotate, move to the view's centre."""
    scale = view.width / width / factor
    radians = math.radians(view.angle)
    mirror = -1.0 if view.flip else 1.0
    a, b = scale * math.cos(radians) * mirror, -scale * math.sin(radians)
    d, e = scale * math.sin(radians) * mirror, scale * math.cos(radians)
    cx, cy = view.center[0] / factor, view.center[1] / factor
    return (a, b, cx - a * width / 2 - b * height / 2, d, e, cy - d * width / 2 - e * height / 2)


def _develop(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Colour jitter, sensor noise, sharpening: what a camera does between the lens and the JPEG.

    Per-pixel work is done with PIL's C loops and lookup tables (a float pipeline in numpy costs
    more), so 2 x 100 samples take seconds.
    """
    channels = len(image.getbands())
    if channels == 3:
        image = ImageEnhance.Color(image).enhance(float(rng.uniform(0.75, 1.25)))
    # One tone curve per channel: white balance, contrast about the image mean, brightness, gamma.
    values = np.arange(256, dtype=np.float64) / 255.0
    mean = float(np.mean(ImageStat.Stat(image).mean)) / 255.0
    contrast, brightness, gamma = rng.uniform(0.85, 1.15), rng.uniform(0.85, 1.15), rng.uniform(0.9, 1.1)
    curves = []
    for gain in rng.uniform(0.93, 1.07, channels) if channels == 3 else [1.0]:
        curve = np.clip(((values * gain - mean) * contrast + mean) * brightness, 0.0, 1.0) ** gamma
        curves.append(np.round(curve * 255.0).astype(np.uint8))
    pixels = np.asarray(image.point(np.concatenate(curves).tolist()))
    # Shot noise (variance proportional to the signal) plus read noise, at a random "ISO".
    sigma = np.float32(rng.uniform(0.7, 1.4)) * np.sqrt(values * NOISE_SHOT + NOISE_READ).astype(np.float32)
    # Mostly luminance grain (one draw shared by the channels), as demosaiced camera noise looks;
    # independent per-channel noise would largely vanish in JPEG's 4:2:0 chroma subsampling.
    noisy = rng.standard_normal(pixels.shape[:2] + (1,) * (pixels.ndim - 2), dtype=np.float32)
    noisy = noisy * sigma[pixels]
    noisy += pixels
    noisy += 0.5
    return Image.fromarray(np.clip(noisy, 0, 255, out=noisy).astype(np.uint8)).filter(SHARPEN)


def _trimap(photo: Photograph, view: _View, width: int, height: int) -> Image.Image:
    """The subject outline drawn in photograph pixels, then carried through the view like the image."""
    factor = max(1, round(view.width / width))
    size = _photo(photo, factor).size
    mask = Image.new("L", size, 2)
    border = max(1, round(TRIMAP_BORDER * view.width / width / factor))
    ImageDraw.Draw(mask).polygon([(x / factor, y / factor) for x, y in photo.subject], fill=1, outline=3,
                                 width=border)
    matrix = _affine(view, width, height, factor)
    return mask.transform((width, height), Image.Transform.AFFINE, matrix, resample=Image.Resampling.NEAREST,
                          fillcolor=2)


def _encode(image: Image.Image, format: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **params)
    return buffer.getvalue()


@lru_cache(maxsize=len(PHOTOGRAPHS))
def _photo_size(photo: Photograph) -> tuple[int, int]:
    return _photo(photo, 1).size


@lru_cache(maxsize=4 * len(PHOTOGRAPHS))
def _photo(photo: Photograph, factor: int) -> Image.Image:
    """The photograph (RGB, or L for grayscale ones), shrunk by an integer box filter when factor > 1."""
    if factor > 1:
        return _photo(photo, 1).reduce(factor)
    try:
        with resources.files(photo.package).joinpath(photo.file).open("rb") as stream, Image.open(stream) as image:
            return image.convert("L" if photo.grayscale else "RGB")
    except (OSError, ModuleNotFoundError) as exc:
        raise TransformerError(
            f"demo photograph '{photo.name}' ({photo.package}/{photo.file}) is not installed: {exc}; "
            "install scikit-image and matplotlib (the 'server' extra)"
        ) from None
