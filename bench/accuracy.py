"""Each preset's output against torchvision's, by image size: ``python -m bench.accuracy`` (about 2 min on 2 cores).

JPEGs spread over sizes like ImageNet's validation set (short side 200 to 2400, aspect ratios 1:1 to
4:1, both orientations, odd sizes; quality 75 to 95): smooth colour fields with edges and grain
(every fifth one greyscale), and the demo's photographs (``transformer.demo``) at several long sides.
Each goes through the service's per-sample work (``transform_sample``, uint8 output) with the default
options and with ``dct_scaling``, and is compared with torchvision's output:

* imagenet-val: ``decode_image`` of the whole JPEG, ``v2.Resize(256, antialias=True)``, ``v2.CenterCrop(224)``;
* resize-224: the same decode, ``v2.Resize([224, 224], antialias=True)``;
* imagenet-train (seeds 0-2): the whole-image path with the same draws (``crop_decode: false``), which
  is v2's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` pixel for pixel (``tests/test_spec.py``).

The error is the mean absolute difference per image in [0, 1] units: uint8 outputs divided by 255, which
is the float image before ``Normalize`` (divide by the std, about 0.225, for normalized units). The report
gives, per preset, setting and short-side range, the largest and the mean of those per-image errors,
the decode paths taken, and the thread CPU ms per image (median).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.report import finish
from bench.stamp import stamp
from testbed.shardgen import textured_jpeg

# (width, height): short side 200 to 2400, landscape and portrait, odd sizes, ImageNet's common 500 x 375/333.
SIZES = [(267, 200), (200, 300), (500, 375), (375, 500), (500, 333), (333, 500), (448, 448), (640, 427),
         (511, 383), (683, 512), (512, 768), (800, 600), (833, 557), (1001, 751), (769, 1153), (1280, 853),
         (1500, 1000), (1200, 1600), (2048, 1365), (1367, 2049), (2250, 2250), (3008, 2000), (4000, 1000),
         (600, 2400), (3200, 2400)]
PHOTO_LONG_SIDES = [400, 500, 700, 900, 1200, 1600, 2400, 3000]
RANGES = [(0, 512, "short side < 512"), (512, 1024, "512-1023"), (1024, 2000, "1024-1999"),
          (2000, 10**6, ">= 2000")]
PRESETS = {"imagenet-val": [None], "resize-224": [None], "imagenet-train": [0, 1, 2]}
SETTINGS = {"default": {}, "dct_scaling": {"dct_scaling": True}}


def images() -> list[tuple[str, bytes]]:
    from transformer.demo import make_sample

    out = [(f"texture {w}x{h}", textured_jpeg(w, h, i, 75 + 5 * (i % 5), grey=i % 5 == 4))
           for i, (w, h) in enumerate(SIZES)]
    for i, long_side in enumerate(PHOTO_LONG_SIDES):
        for index in range(2):
            out.append((f"photo {long_side} #{index}", make_sample(index, i, long_side=long_side,
                                                                  quality=75 + 5 * ((i + index) % 5))["jpg"]))
    return out


def measure() -> dict:
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2

    from transformer import samples as samples_module
    from transformer.config import Settings
    from transformer.options import options_from_mapping
    from transformer.samples import transform_sample
    from transformer.shards import read_samples

    torch.set_num_threads(1)
    settings = Settings.from_env({})
    references = {"imagenet-val": v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)]),
                  "resize-224": v2.Resize([224, 224], antialias=True)}

    def run(data: bytes, **etl_args) -> tuple[np.ndarray, float, Counter]:
        sample = next(iter(read_samples(io.BytesIO(_tar("k.jpg", data)), "bench.tar", 2**31)))
        options = options_from_mapping({"dtype": "uint8", **etl_args}, settings)
        before = Counter(samples_module.decode_paths())
        start = time.thread_time()
        members = transform_sample(sample, options, "bench.tar", "bench/bench.tar")
        cpu = time.thread_time() - start
        paths = Counter(samples_module.decode_paths()) - before
        array = next(np.load(io.BytesIO(m.data)) for m in members if m.info.name.endswith(".npy"))
        return array.astype(np.float32), cpu * 1e3, paths

    rows = []
    for name, data in images():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 points to TorchCodec
            decoded = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        height, width = decoded.shape[-2:]
        for preset, seeds in PRESETS.items():
            for seed in seeds:
                args = {"preset": preset} if seed is None else {"preset": preset, "seed": seed}
                if preset in references:
                    reference = references[preset](decoded).numpy().astype(np.float32)
                else:
                    reference = run(data, crop_decode=False, **args)[0]
                for setting, extra in SETTINGS.items():
                    outputs = [run(data, **args, **extra) for _ in range(2)]  # CPU: the faster of two
                    array, _, paths = outputs[0]
                    rows.append({"image": name, "width": width, "height": height, "preset": preset, "seed": seed,
                                 "setting": setting, "mae": float(np.abs(array - reference).mean() / 255),
                                 "max_abs": float(np.abs(array - reference).max()),
                                 "cpu_ms": min(o[1] for o in outputs),
                                 "paths": sorted(f"{p}/{r}" if r else p for (p, r) in paths)})
    return {"rows": rows}


def _tar(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def report(results: dict) -> str:
    meta = results.get("meta", {})
    rows = results["rows"]
    lines = [f"`{meta.get('command', 'python -m bench.accuracy')}` at {meta.get('commit', '?')}"
             + (f", {meta['started']}" if "started" in meta else "") + ": "
             f"{len({r['image'] for r in rows})} JPEGs, {meta.get('cpus')} CPUs, torch {meta.get('torch')}. "
             "Error: mean absolute difference per image against torchvision's output, [0, 1] units "
             "(uint8 / 255); the largest and the mean over the images (and seeds) of each range.", ""]
    for preset in PRESETS:
        lines += [f"{preset}:", "", "| short side | images | setting | max error | mean error | largest pixel "
                  "difference (of 255) | decode paths | CPU ms/image (median) |", "|---|---|---|---|---|---|---|---|"]
        for low, high, label in RANGES:
            for setting in SETTINGS:
                chosen = [r for r in rows if r["preset"] == preset and r["setting"] == setting
                          and low <= min(r["width"], r["height"]) < high]
                if not chosen:
                    continue
                errors = [r["mae"] for r in chosen]
                paths = Counter(p for r in chosen for p in r["paths"])
                largest = max(r["max_abs"] for r in chosen)
                error = f"{max(errors):.4f} | {np.mean(errors):.4f}" if largest else "0 (identical) | 0"
                lines.append(f"| {label} | {len({r['image'] for r in chosen})} | {setting} | {error} | {largest:.0f} | "
                             f"{', '.join(f'{p} {n}' for p, n in sorted(paths.items()))} | "
                             f"{np.median([r['cpu_ms'] for r in chosen]):.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--render", type=Path, help="only print the report of a --json file written before")
    args = parser.parse_args(argv)
    if args.render:
        print(report(json.loads(args.render.read_text())))
        return 0
    started = stamp()
    results = measure()
    command = "python -m bench.accuracy " + " ".join(argv or sys.argv[1:])
    results["meta"] = {"commit": started["git"], "started": started["started"], "command": command,
                       "cpus": os.cpu_count(), "torch": torch.__version__}
    return finish(results, args.json, report(results))


if __name__ == "__main__":
    raise SystemExit(main())
