"""Decoding only what the output needs, side by side: ``python -m bench.experiments.decode`` (5-10 min, 2 cores).

On two sets, the ImageNet-like demo JPEGs (~500 x 375, ~100 KB) and multi-megapixel photographs made from
the same bundled photographs (3000 on the long side, grain, quality 90, ~2 MB), for ``imagenet-train``:

1. **decode**, one thread, thread CPU ms per image, the options taking turns: the whole image
   (torchvision's decoder, as the service without ``crop_decode``), the crop window alone at full scale
   (nvImageCodec), the whole image at the crop's DCT scale (simplejpeg; where the scale is 1 that is a
   full decode), and what the service does (``cropdecode.decode_window``, including the resize), with
   and without ``dct_scaling``;
2. **compute loop** on ``--workers`` threads over samples in memory: torchvision's own tight loop
   (``decode_image``, ``v2.Compose`` of the preset, ``.npy`` written to memory) and the service's
   ``transform_sample`` with and without ``crop_decode``;
3. **service** over HTTP (hpush with ``etl_fqn``, one shard at a time) with and without ``crop_decode``
   (``etl_args``), and the conventional SDK ETL (``bench/peers/conventional_etl.py``).

"crop_decode on" means ``crop_decode`` with ``dct_scaling``, as in the kept run (the photographs' crops
decode at a reduced DCT scale, not torchvision's pixels); section 1 also measures the default, without
``dct_scaling``, and ``python -m bench.accuracy`` the error. Sections 2 and 3 run once per round, in
alternating order, so every ratio compares figures of one round; the report gives medians with min-max
over rounds.

Decided: ``crop_decode`` on by default, ``dct_scaling`` by choice only (``bench/results/decode/``,
docs/design-decoding.md "Partial JPEG decoding (``crop_decode``)").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench import compute, data, services
from bench.report import finish
from bench.stamp import stamp
from bench.stats import median

log = logging.getLogger("bench")
PRESET = "imagenet-train"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--imagenet", type=int, default=300, help="ImageNet-like samples")
    parser.add_argument("--photos", type=int, default=30, help="multi-megapixel samples")
    parser.add_argument("--workers", type=int, default=None, help="threads (default: usable CPUs)")
    parser.add_argument("--work", type=Path, help="folder for shards and logs (default: temporary)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    return parser.parse_args(argv)


def _jpegs(path: Path) -> list[bytes]:
    import tarfile

    with tarfile.open(path) as archive:
        return [archive.extractfile(m).read() for m in archive if m.name.endswith(".jpg")]


def decode_costs(jpegs: list[bytes], repeats: int = 3) -> dict[str, float]:
    """Thread CPU ms per image of each decode option, for imagenet-train's crops (seed 0), taking turns."""
    import simplejpeg

    from transformer import cropdecode
    from transformer.spec import build_pipeline

    torch.set_num_threads(1)
    pipeline = build_pipeline(PRESET)
    jobs = []
    torch.manual_seed(0)
    for jpeg in jpegs:
        height, width, _, _ = simplejpeg.decode_jpeg_header(jpeg)
        stand_in = torch.zeros((), dtype=torch.uint8).expand(3, height, width)
        params = pipeline.transforms[0].make_params([stand_in])
        jobs.append((bytearray(jpeg), height, width, cropdecode.window_of(pipeline.transforms[:1], [params], height,
                                                                           width)))
    op = torch.ops.image.decode_image.default

    def whole(job) -> object:
        return op(torch.frombuffer(job[0], dtype=torch.uint8), 3, False)

    def window(job) -> object:
        return cropdecode._decode_region(job[0], job[3])

    def scaled(job) -> object:
        jpeg, height, width, win = job
        scale = win.dct_scale()
        return simplejpeg.decode_jpeg(jpeg, "RGBX", min_height=-(-height // scale), min_width=-(-width // scale))

    def floor(job) -> object:  # 1/8 scale: entropy decoding of every row, DC-only IDCT, 1/64 of the colour work
        return simplejpeg.decode_jpeg(job[0], "RGBX", min_height=-(-job[1] // 8), min_width=-(-job[2] // 8))

    def service(job) -> object:
        return cropdecode.decode_window(*job, dct_scaling=True)

    def default(job) -> object:  # without dct_scaling: the window, torchvision's pixels
        return cropdecode.decode_window(*job)

    def whole_and_resize(job) -> object:  # the service without crop_decode: decode, crop, resize
        win = job[3]
        image = whole(job)[:, win.top:win.bottom, win.left:win.right]
        return torch.nn.functional.interpolate(image[None], size=[224, 224], mode="bilinear", antialias=True)

    options: dict[str, Callable] = {"whole image (torchvision)": whole, "window, full scale (nvImageCodec)": window,
                                    "whole image at the crop's DCT scale (simplejpeg)": scaled,
                                    "whole image at 1/8 (about the entropy decoding alone)": floor,
                                    "whole + crop + resize (crop_decode off)": whole_and_resize,
                                    "crop_decode: decode + resize (on)": service,
                                    "crop_decode without dct_scaling: decode + resize": default}
    costs = compute.interleaved_ms(options, jobs, repeats)
    costs["DCT scale > 1 (share of crops)"] = sum(job[3].dct_scale() > 1 for job in jobs) / len(jobs)
    return costs


def torchvision_loop(jpegs: list[bytes], workers: int) -> dict:
    """What a user writes with torchvision alone: decode_image, the preset as v2.Compose, .npy into memory."""
    from torchvision.io import decode_image
    from torchvision.transforms import v2

    from transformer.spec import IMAGENET_MEAN, IMAGENET_STD

    torch.set_num_threads(1)
    pipeline = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                           v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def one(jpeg: bytes) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 points to TorchCodec
            image = decode_image(torch.frombuffer(bytearray(jpeg), dtype=torch.uint8))
        buffer = io.BytesIO()
        np.save(buffer, pipeline(image).numpy())
        return 1

    return _timed(one, jpegs, workers)


def service_loop(samples: list, workers: int, crop_decode: bool) -> dict:
    """The service's per-sample work (``transform_sample``) on the same threads, no tar, no HTTP."""
    from transformer.config import Settings
    from transformer.options import options_from_mapping
    from transformer.samples import transform_sample

    torch.set_num_threads(1)
    options = options_from_mapping({"preset": PRESET, "crop_decode": crop_decode, "dct_scaling": crop_decode},
                                   Settings.from_env({}))

    def one(sample) -> int:
        members = transform_sample(sample, options, "bench", "bench")
        return sum(1 for m in members if m.info.name.endswith(".npy"))

    return _timed(one, samples, workers)


def _timed(fn: Callable, items: list, workers: int) -> dict:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fn, items[: 2 * workers]))  # warm-up
        cpu, start = time.process_time(), time.perf_counter()
        images = sum(pool.map(fn, items))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"images_per_s": images / seconds, "cpu_ms_per_image": cpu / images * 1e3}


def over_http(server: services.Server, shard: data.Shard, etl_args: dict) -> dict:
    cpu, start = server.cpu_seconds(), time.monotonic()
    result = services.hpush(server.url, shard.object_path, shard.path, "fqn", json.dumps(etl_args), timeout=900)
    if not result.ok:
        raise RuntimeError(f"{server.name}: {result.error}\n{server.log_tail()}")
    seconds = time.monotonic() - start
    cpu = server.cpu_seconds() - cpu
    return {"images_per_s": shard.images / seconds, "cpu_ms_per_image": cpu * 1e3 / shard.images}


def run(args: argparse.Namespace, work: Path) -> dict:
    from transformer.config import Settings, available_cpus

    workers = args.workers or available_cpus()
    log.info("shards: %d ImageNet-like samples, %d multi-megapixel photographs", args.imagenet, args.photos)
    sets = {"imagenet": data.demo_shards(work, 1, args.imagenet)[0],
            "photos": data.photo_shards(work, 1, args.photos)[0]}
    settings = Settings.from_env({})
    loaded = {name: compute.load_samples(shard.path, settings) for name, shard in sets.items()}
    jpegs = {name: _jpegs(shard.path) for name, shard in sets.items()}
    results: dict = {"workers": workers, "sets": {n: {"images": s.images, "mb": s.size / 1e6} for n, s in sets.items()},
                     "decode": {}, "rounds": []}
    for name in sets:
        log.info("decode options, %s (1 thread)", name)
        results["decode"][name] = decode_costs(jpegs[name][:100])
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    servers = {"service": services.start_service(logs, work / "mp", workers),
               "peer": services.start_peer(logs, workers)}
    try:
        for server in servers.values():
            server.ready()
        cases: dict[str, Callable[[str], dict]] = {
            "torchvision loop": lambda n: torchvision_loop(jpegs[n], workers),
            "compute loop, crop_decode on": lambda n: service_loop(loaded[n], workers, True),
            "compute loop, crop_decode off": lambda n: service_loop(loaded[n], workers, False),
            "service, crop_decode on": lambda n: over_http(servers["service"], sets[n],
                                                           {"preset": PRESET, "crop_decode": True,
                                                            "dct_scaling": True}),
            "service, crop_decode off": lambda n: over_http(servers["service"], sets[n],
                                                            {"preset": PRESET, "crop_decode": False}),
            "conventional SDK ETL": lambda n: over_http(servers["peer"], sets[n], {"preset": PRESET}),
        }
        for name in sets:  # warm-up: first calls, page cache
            for case in ("service, crop_decode on", "conventional SDK ETL"):
                cases[case](name)
        for number in range(args.rounds):
            order = list(cases) if number % 2 == 0 else list(reversed(cases))
            figures = {name: {case: cases[case](name) for case in order} for name in sets}
            results["rounds"].append(figures)
            log.info("round %d: %s", number + 1, {n: {c: round(f["images_per_s"]) for c, f in v.items()}
                                                 for n, v in figures.items()})
    finally:
        for server in servers.values():
            server.stop()
    return results


def report(results: dict) -> str:
    meta = results.get("meta", {})
    lines = [f"`{meta.get('command', 'python -m bench.experiments.decode')}` at {meta.get('commit', '?')}"
             + (f", {meta['started']}" if "started" in meta else "") + ": "
             f"{len(results['rounds'])} rounds, {results['workers']} workers, imagenet-train, float32; "
             f"load average {meta.get('load_average_start_end')} (start, end) on {meta.get('cpus')} CPUs"]
    for name, costs in results["decode"].items():
        lines += ["", f"Decode, {name}, 1 thread, thread CPU ms per image (median of 3 passes over <= 100 images):", "",
                  "| option | ms |", "|---|---|"]
        lines += [f"| {option} | {value:.3f} |" for option, value in costs.items()]
    for name in results["sets"]:
        info = results["sets"][name]
        rounds = [r[name] for r in results["rounds"]]
        lines += ["", f"{name}: {info['images']} images, {info['mb']:.0f} MB. Median (min-max) over rounds; ratios "
                  "are per round:", "",
                  "| case | images/s | CPU ms/image | x torchvision loop | x conventional ETL |",
                  "|---|---|---|---|---|"]
        for case in rounds[0]:
            speed = [r[case]["images_per_s"] for r in rounds]
            cpu = [r[case]["cpu_ms_per_image"] for r in rounds]
            vs_tv = [r[case]["images_per_s"] / r["torchvision loop"]["images_per_s"] for r in rounds]
            vs_peer = [r[case]["images_per_s"] / r["conventional SDK ETL"]["images_per_s"] for r in rounds]
            lines.append(f"| {case} | {_spread(speed, '.0f')} | {_spread(cpu, '.2f')} | {_spread(vs_tv, '.2f')} | "
                         f"{_spread(vs_peer, '.2f')} |")
    return "\n".join(lines)


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s", datefmt="%H:%M:%S")
    load, started = os.getloadavg(), stamp()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-decode-")))
        results = run(args, work)
    command = "python -m bench.experiments.decode " + " ".join(argv or sys.argv[1:])
    results["meta"] = {"commit": started["git"], "started": started["started"], "command": command,
                       "load_average_start_end": [round(load[0], 2), round(os.getloadavg()[0], 2)],
                       "cpus": os.cpu_count(), "torch": torch.__version__}
    return finish(results, args.json, report(results))


if __name__ == "__main__":
    raise SystemExit(main())
