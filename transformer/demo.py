"""The embedded demo dataset: ImageNet-like JPEG shards made from real photographs.

The photographs ship inside installed wheels (scikit-image's ``skimage/data`` and matplotlib's
``sample_data``), so nothing is downloaded. Each sample is a distinct variation of one photograph
(random crop, aspect, flip, colour, sensor-like noise), about 500x375 and ~100 KB as JPEG q94, like
an ImageNet training image; its class is the photograph it came from. Output is deterministic for a seed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance

# (class name, package, file). Only true-colour photographs: the demo is meant to look like ImageNet.
PHOTOGRAPHS = (
    ("astronaut", "skimage", "astronaut.png"),
    ("coffee", "skimage", "coffee.png"),
    ("cat", "skimage", "chelsea.png"),
    ("rocket", "skimage", "rocket.jpg"),
    ("motorcycle", "skimage", "motorcycle_left.png"),
    ("hubble", "skimage", "hubble_deep_field.jpg"),
    ("tissue", "skimage", "ihc.png"),
    ("grace-hopper", "matplotlib", "grace_hopper.jpg"),
)
# ImageNet's common shapes: mostly 500 on the long side, 4:3 and 3:2 landscape, some portrait.
SIZES = ((500, 375), (500, 375), (500, 333), (500, 400), (375, 500), (333, 500), (500, 500))
MTIME = 1_700_000_000  # fixed member mtime: the same seed gives byte-identical shards


@dataclass(frozen=True)
class Photograph:
    label: int
    name: str
    image: Image.Image


@lru_cache(maxsize=1)
def photographs() -> tuple[Photograph, ...]:
    """The bundled photographs that are present in this environment, in a fixed order."""
    folders = {}
    try:
        import skimage

        folders["skimage"] = Path(skimage.__file__).parent / "data"
    except ImportError:
        pass
    try:
        import matplotlib

        folders["matplotlib"] = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data"
    except ImportError:
        pass
    found = []
    for name, package, filename in PHOTOGRAPHS:
        path = folders.get(package, Path("/nonexistent")) / filename
        if path.is_file():
            with Image.open(path) as image:
                found.append(Photograph(len(found), name, image.convert("RGB")))
    if len(found) < 2:
        raise RuntimeError("the demo needs scikit-image and matplotlib installed (their bundled photographs)")
    return tuple(found)


def make_sample(index: int, seed: int, *, masks: bool = False) -> dict:
    """One sample as a webdataset dict: ``jpg`` (or ``image.jpg`` + ``trimap.png``), ``cls``, ``json``."""
    rng = np.random.default_rng([seed, index])
    sources = photographs()
    source = sources[index % len(sources)]
    width, height = SIZES[int(rng.integers(len(SIZES)))]
    image, box = _random_view(source.image, width / height, rng)
    flip = bool(rng.random() < 0.5)
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhancer(image).enhance(float(rng.uniform(0.8, 1.2)))
    # Sensor-like grain: what makes real photos ~100 KB rather than ~60 KB.
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, 9.0, (height, width, 3)).astype(np.float32)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    jpeg = io.BytesIO()
    image.save(jpeg, "JPEG", quality=94)
    meta = {"source": source.name, "crop": box, "flip": flip, "size": [width, height]}
    sample = {"__key__": f"sample-{index:06d}", "cls": source.label, "json": meta}
    if masks:
        sample["image.jpg"] = jpeg.getvalue()
        sample["trimap.png"] = _trimap(width, height, rng)
    else:
        sample["jpg"] = jpeg.getvalue()
    return sample


def _random_view(image: Image.Image, aspect: float, rng: np.random.Generator) -> tuple[Image.Image, list[int]]:
    """A crop covering 35-100% of the photograph's area at the requested aspect ratio."""
    full_w, full_h = image.size
    area = full_w * full_h * float(rng.uniform(0.35, 1.0))
    crop_w = min(full_w, int(round((area * aspect) ** 0.5)))
    crop_h = min(full_h, int(round(crop_w / aspect)))
    crop_w = min(crop_w, int(round(crop_h * aspect)))
    x0 = int(rng.integers(0, full_w - crop_w + 1))
    y0 = int(rng.integers(0, full_h - crop_h + 1))
    box = [x0, y0, x0 + crop_w, y0 + crop_h]
    return image.crop(tuple(box)), box


def _trimap(width: int, height: int, rng: np.random.Generator) -> bytes:
    """An Oxford-Pet-style trimap (1 foreground, 2 background, 3 border) around an ellipse."""
    mask = Image.new("L", (width, height), 2)
    draw = ImageDraw.Draw(mask)
    cx, cy = width * float(rng.uniform(0.35, 0.65)), height * float(rng.uniform(0.35, 0.65))
    rx, ry = width * float(rng.uniform(0.2, 0.35)), height * float(rng.uniform(0.2, 0.35))
    draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=3)
    draw.ellipse((cx - rx + 4, cy - ry + 4, cx + rx - 4, cy + ry - 4), fill=1)
    out = io.BytesIO()
    mask.save(out, "PNG")
    return out.getvalue()


def make_shards(output: Path, shards: int = 2, samples: int = 100, seed: int = 0, *, masks: bool = False,
                progress: bool = True) -> list[Path]:
    """Write ``demo-000000.tar``... into ``output`` with webdataset's ``TarWriter``; return the paths."""
    from tqdm import tqdm
    from webdataset import TarWriter

    if shards < 1 or samples < 1:
        raise ValueError("shards and samples must be at least 1")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = []
    with tqdm(total=shards * samples, unit="img", desc="demo shards", disable=not progress) as bar:
        for shard in range(shards):
            path = output / f"demo-{shard:06d}.tar"
            partial = path.with_name(path.name + ".partial")
            with open(partial, "wb") as stream:
                writer = TarWriter(stream, mtime=MTIME, mode=0o644, user="demo", group="demo")
                for index in range(shard * samples, (shard + 1) * samples):
                    sample = make_sample(index, seed, masks=masks)
                    sample["json"] = json.dumps(sample["json"], sort_keys=True).encode()
                    writer.write(sample)
                    bar.update()
                writer.close()
            partial.replace(path)
            paths.append(path)
    return paths
