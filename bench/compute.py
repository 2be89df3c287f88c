"""The compute limit, and the decode/resize options it was chosen from.

The compute limit is the service's own per-sample work (``samples.transform_sample``: decode, v2
transforms, ``.npy`` encoding) over samples already in memory, on a thread pool as wide as the
service's (``ETL_WORKERS``): no HTTP, no tar, no event loop. Everything else is reported as a fraction
of it, measured in the same run.
"""

from __future__ import annotations

import io
import os
import queue
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer.config import Settings
from transformer.options import options_from_mapping
from transformer.samples import transform_sample
from transformer.shards import Sample, read_samples


def load_samples(path: Path, settings: Settings) -> list[Sample]:
    with open(path, "rb") as stream:
        return list(read_samples(stream, path.name, settings.max_member_bytes))


def compute_limit(samples: list[Sample], preset: str, dtype: str, workers: int, settings: Settings) -> dict:
    """Images/s of ``transform_sample`` over ``samples`` on ``workers`` threads (one pass, ordered)."""
    options = options_from_mapping({"preset": preset, "dtype": dtype, "seed": 0}, settings)
    torch.set_num_threads(1)  # as the service's TransformPool: parallel across samples, not inside ops

    def one(sample: Sample) -> int:
        members = transform_sample(sample, options, "compute-limit", "compute-limit")
        return sum(1 for m in members if m.info.name.endswith(".npy"))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, samples[: 2 * workers]))  # warm-up: first-call costs (dispatch, caches)
        cpu, start = time.process_time(), time.perf_counter()
        images = sum(pool.map(one, samples))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_ms_per_image": cpu / images * 1e3}


def http_limit(samples: list[Sample], preset: str, dtype: str, workers: int, settings: Settings) -> dict:
    """``compute_limit``'s loop with each result's ``.npy`` sent to curl over loopback HTTP, in order.

    The least a service adds to the compute limit to deliver its output: the main thread writes each
    image's array (header and data, one chunked frame, ``sendmsg`` from the array's own buffer) to a
    curl on the same cores, while the pool transforms. No tar in or out, no request, no event loop, no
    window: what is left between this and the service is the shard engine and the server.
    """
    from bench.services import CurlSink

    options = options_from_mapping({"preset": preset, "dtype": dtype, "seed": 0}, settings)
    torch.set_num_threads(1)

    def one(sample: Sample) -> list:
        members = transform_sample(sample, options, "compute-limit", "compute-limit")
        return [m.pieces for m in members if m.info.name.endswith(".npy")]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, samples[: 2 * workers]))  # warm-up, as compute_limit
        sink = CurlSink()
        images = 0
        cpu, start = time.process_time(), time.perf_counter()
        try:
            for arrays in pool.map(one, samples):
                for pieces in arrays:
                    sink.send(pieces)
                    images += 1
        except BaseException:
            sink.abort()
            raise
        client = sink.close()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_ms_per_image": cpu / images * 1e3, "client_cpu_ms_per_image": client / images * 1e3}


def process_limit(samples: list[Sample], preset: str, dtype: str, workers: int, settings: Settings) -> dict:
    """Images/s of ``transform_sample`` in ``workers`` forked processes, each on its share of ``samples``.

    The same work as ``compute_limit`` without the GIL: what these cores give the transforms when no two
    of them share an interpreter. Not how the service runs (threads: one copy of torch, no
    serialization of samples and arrays between processes); reported so the cost of the GIL is a figure.
    """
    import multiprocessing

    context = multiprocessing.get_context("fork")  # children share the loaded samples and imports
    ready, go, results = context.Barrier(workers + 1), context.Event(), context.Queue()
    share = len(samples) // workers

    def child(index: int) -> None:
        torch.set_num_threads(1)
        options = options_from_mapping({"preset": preset, "dtype": dtype, "seed": 0}, settings)
        mine = samples[index * share:(index + 1) * share]
        for sample in mine[:2]:
            transform_sample(sample, options, "compute-limit", "compute-limit")  # warm-up, as compute_limit
        ready.wait()
        go.wait()
        cpu = time.process_time()
        images = sum(sum(1 for m in transform_sample(s, options, "compute-limit", "compute-limit")
                         if m.info.name.endswith(".npy")) for s in mine)
        results.put((images, time.process_time() - cpu))

    children = [context.Process(target=child, args=(i,), daemon=True) for i in range(workers)]
    for process in children:
        process.start()
    try:
        ready.wait(timeout=120)
        start = time.perf_counter()
        go.set()
        outcomes: list[tuple[int, float]] = []
        while len(outcomes) < workers:
            try:
                outcomes.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in children if p.exitcode not in (None, 0)]
                if failed or time.perf_counter() - start > 600:
                    raise RuntimeError(f"process limit: a worker process failed (exit codes {failed})") from None
        seconds = time.perf_counter() - start
    finally:
        for process in children:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    images, cpu = sum(o[0] for o in outcomes), sum(o[1] for o in outcomes)
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_ms_per_image": cpu / images * 1e3}


def engine_limit(path: Path, preset: str, dtype: str, workers: int, settings: Settings) -> dict:
    """The service's engine without HTTP: ``transform_shard`` from the file to /dev/null, in this process.

    The same work as ``wds-transform apply`` and as the service minus the event loop and the socket:
    tar parsing and writing and the ordered window on top of the compute limit. Pool and window sizes
    are the service's defaults for ``workers``.
    """
    from transformer.engine import ShardReport, transform_shard
    from transformer.pool import TransformPool

    options = options_from_mapping({"preset": preset, "dtype": dtype, "seed": 0}, settings)
    pool = TransformPool(workers, 4 * workers + 4)
    report = ShardReport(path.name, path.name, options.on_error)
    try:
        cpu, start = time.process_time(), time.perf_counter()
        with open(path, "rb") as stream, open(os.devnull, "wb") as sink:
            for chunk in transform_shard(stream, options, pool, shard=path.name, object_name=path.name,
                                         window=2 * workers + 2, report=report):
                sink.write(chunk)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        pool.shutdown()
    return {"images": report.images, "seconds": seconds, "images_per_s": report.images / seconds,
            "cpu_ms_per_image": cpu / report.images * 1e3}


# ------------------------------------------------------------------------------------ decode options


def _jpegs(samples: list[Sample], limit: int) -> list[bytes]:
    out = []
    for sample in samples:
        for member, ext in zip(sample.members, sample.extensions):
            if ext is not None and ext.lower().rsplit(".", 1)[-1] in ("jpg", "jpeg"):
                out.append(member.data)
        if len(out) >= limit:
            break
    return out


def interleaved_ms(functions: dict[str, Callable[[Any], object]], images: list, repeats: int) -> dict[str, float]:
    """Median CPU ms per call of each function on each of ``images`` (this thread's CPU time), taking turns.

    CPU time, not wall time: other jobs on this machine take the cores away at random, which changes
    wall time by multiples but a single thread's CPU time hardly. Taking turns spreads what is left
    (cache and memory-bandwidth contention) over all options alike.
    """
    for fn in functions.values():
        for data in images[:3]:
            fn(data)
    runs: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.thread_time()
            for data in images:
                fn(data)
            runs[name].append((time.thread_time() - start) / len(images))
    return {name: statistics.median(values) * 1e3 for name, values in runs.items()}


PIL_V1 = "PIL decode + PIL bilinear resize + crop (v1 path)"


def decode_options(samples: list[Sample], images: int = 100, repeats: int = 3) -> list[dict]:
    """Single-thread ms/image of each decoder and of the val pipeline built on it, and its error.

    The error is the mean absolute difference, in normalized units, of the imagenet-val output against
    torchvision's reference (decode_image + v2 Resize(256, antialias) + CenterCrop(224)), which is the
    service's accuracy criterion (< 0.005); "exact" means bit-identical uint8 pixels.
    """
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    torch.set_num_threads(1)
    jpegs = _jpegs(samples, images)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def tv(data: bytes) -> torch.Tensor:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)

    def pil(data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)

    def pil_draft(data: bytes) -> torch.Tensor:
        # DCT-domain downscale (1/2, 1/4, 1/8) while keeping the short side >= 256: the val resize target.
        with Image.open(io.BytesIO(data)) as image:
            short = min(image.size)
            image.draft("RGB", (image.size[0] * 256 // short, image.size[1] * 256 // short))
            return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)

    decoders: dict[str, Callable[[bytes], torch.Tensor]] = {
        "torchvision decode_jpeg (libjpeg-turbo)": tv,
        "PIL open+convert": pil,
        "PIL + draft (DCT downscale to >= 256)": pil_draft,
    }
    try:
        import simplejpeg

        decoders["simplejpeg"] = lambda d: torch.from_numpy(simplejpeg.decode_jpeg(d, "RGB")).permute(2, 0, 1)
        decoders["simplejpeg fastdct+fastupsample"] = lambda d: torch.from_numpy(
            simplejpeg.decode_jpeg(d, "RGB", fastdct=True, fastupsample=True)
        ).permute(2, 0, 1)
    except ImportError:  # optional: measured only where installed
        pass

    def val_uint8(tensor: torch.Tensor) -> torch.Tensor:
        return F.center_crop(F.resize(tensor.contiguous(), 256, antialias=True), 224)

    def pil_val(data: bytes) -> torch.Tensor:  # the conventional v1 path: PIL resize + crop
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")
            short = min(image.size)
            size = (round(image.size[0] * 256 / short), round(image.size[1] * 256 / short))
            image = image.resize(size, Image.BILINEAR)
            left, top = (size[0] - 224) // 2, (size[1] - 224) // 2
            image = image.crop((left, top, left + 224, top + 224))
            return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)

    reference = [val_uint8(tv(d)) for d in jpegs]

    def error(outputs: list[torch.Tensor]) -> tuple[float, bool]:
        mae = statistics.fmean(
            float(((o.float() - r.float()).abs() / 255.0 / std).mean()) for o, r in zip(outputs, reference)
        )
        return mae, all(torch.equal(o, r) for o, r in zip(outputs, reference))

    pipelines = {name: (lambda d, decode=decode: val_uint8(decode(d))) for name, decode in decoders.items()}
    pipelines[PIL_V1] = pil_val
    decode_ms = interleaved_ms(decoders, jpegs, repeats)
    pipeline_ms = interleaved_ms(pipelines, jpegs, repeats)
    rows = []
    for name, pipeline in pipelines.items():
        mae, exact = error([pipeline(d) for d in jpegs])
        rows.append({"option": name, "decode_ms": decode_ms.get(name), "val_uint8_ms": pipeline_ms[name],
                     "mae": mae, "exact": exact})
    sizes = [Image.open(io.BytesIO(d)).size for d in jpegs]
    width, height = statistics.median(w for w, _ in sizes), statistics.median(h for _, h in sizes)
    return [dict(row, images=len(jpegs), mean_bytes=statistics.fmean(map(len, jpegs)),
                 median_size=f"{width:.0f}x{height:.0f}") for row in rows]

