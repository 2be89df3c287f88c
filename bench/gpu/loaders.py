"""Parts 4 and 5: the host-to-device bandwidth and the one-copy floor, then the loaders' samples/s and
GB/s into device memory, every batch checked against the images the shards hold."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .budget import Budget, Skip, check
from .constants import DISTINCT, STD
from .shards import as_float32, distinct_images

# ---- 4. reference figures -----------------------------------------------------------------------------------


def bandwidth(batch: int, size: int) -> dict:
    """Host-to-device copies of one float32 batch (pinned, pageable), and the cost of pinning it."""
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA")
    pageable = torch.rand(batch, 3, size, size)
    pinned = pageable.pin_memory()
    gigabytes = pageable.numel() * 4 / 1e9

    def timed(copy: Callable[[], Any], repeats: int = 10) -> float:
        copy()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            copy()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats

    pinned_s = timed(lambda: pinned.to("cuda", non_blocking=True))
    pageable_s = timed(lambda: pageable.to("cuda"))
    pageable.pin_memory()  # the caching host allocator keeps the block: later pins are a copy alone
    started = time.perf_counter()
    for _ in range(5):
        pageable.pin_memory()
    pin_s = (time.perf_counter() - started) / 5
    return {"batch_bytes": int(gigabytes * 1e9), "h2d_pinned_gb_per_s": gigabytes / pinned_s,
            "h2d_pageable_gb_per_s": gigabytes / pageable_s, "pin_memory_gb_per_s": gigabytes / pin_s,
            "pin_memory_ms_per_batch": pin_s * 1000}


def deliver(batches: Iterable[Any], limit_s: float, expected: Callable[[Any, Any], float] | None,
            channels_last: bool = False) -> dict:
    """Iterate ``batches`` through ``CudaPrefetcher`` (uint8 normalized on the device) until they end or
    ``limit_s``: samples/s and GB/s of images delivered into device memory, the steady rate after the
    first batch, the prefetcher's host wait; every batch compared with ``expected`` (on the device, its
    largest difference kept there: no wait for the device per batch)."""
    import torch

    from transformer.client import CudaPrefetcher

    cuda = torch.cuda.is_available()
    prefetcher = CudaPrefetcher(batches, depth=2, channels_last=channels_last)
    samples = compared = delivered = 0
    worst: Any = 0.0
    first_s = first_samples = None
    started = time.perf_counter()
    complete = True
    for batch in prefetcher:
        delivered += 1
        images, labels = batch[0], batch[1]
        if expected is not None:
            difference = expected(images, labels)
            worst = difference if compared == 0 else torch.maximum(worst, difference)
            compared += 1
        samples += len(labels)
        if first_s is None:
            if cuda:
                torch.cuda.synchronize()
            first_s, first_samples = time.perf_counter() - started, samples
        if time.perf_counter() - started > limit_s:
            complete = False
            break
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    steady = (samples - first_samples) / (seconds - first_s) if first_s is not None and seconds > first_s else None
    return {"samples": samples, "seconds": round(seconds, 3), "samples_per_s": samples / seconds,
            "steady_samples_per_s": steady, "first_batch_s": first_s, "wait_s": prefetcher.stats.wait_seconds,
            "complete": complete, "max_abs_difference": float(worst), "batches_compared": compared,
            "batches": delivered}


def expectation(dtype: str, size: int) -> Callable[[Any, Any], float]:
    """The largest difference, in units of one uint8 step (1/255 before normalization), between a
    delivered normalized batch and the float32 images its labels name (the pod's float32 output)."""
    import torch

    images = torch.from_numpy(as_float32(distinct_images(size)))
    std = torch.tensor(STD).view(1, 3, 1, 1)
    cache: dict[str, torch.Tensor] = {}

    def compare(batch: Any, labels: Any) -> Any:
        device = str(batch.device)
        if device not in cache:
            cache[device] = images.to(device)
        wanted = cache[device][labels.to(batch.device) % DISTINCT]
        difference = (batch.float() - wanted).abs() * std.to(batch.device) * 255
        return difference.max()  # a tensor on the batch's device: the caller keeps the largest

    return compare


def floor_and_loaders(shards: dict, batch: int, workers: list[int], web_workers: int, case_s: float,
                      budget: Budget, size: int, passes: int) -> dict:
    """Each reader over the shard list read ``passes`` times, for ``case_s`` at most: with the default
    1000-sample shuffle, a worker's batches leave only once its open batches filled, so every worker
    needs a few times that many samples for its rate to be the steady one."""
    import torch

    from bench.client_side import one_copy_batches
    from transformer.client import make_loader, web_loader

    cuda = torch.cuda.is_available()
    rows = []
    result: dict[str, Any] = {"rows": rows, "pin_memory": cuda, "batch_size": batch, "passes": passes,
                              "case_limit_s": case_s}

    def cases(paths: list[Path]) -> list[tuple[str, Callable[[], Iterable[Any]]]]:
        paths = paths * passes
        urls = [str(p) for p in paths]
        made = [("one-copy floor (one core)", lambda: one_copy_batches(paths, batch))]
        for count in workers:
            made.append((f"make_loader, num_workers={count}", lambda count=count: make_loader(
                urls, batch, num_workers=count, split_by_node=False, pin_memory=cuda)))
        made.append((f"web_loader, num_workers={web_workers}", lambda: web_loader(
            urls, batch, keys=("npy", "cls"), num_workers=web_workers, pin_memory=cuda)))
        if cuda:  # what pinning buys: the copy from pageable memory cannot overlap the step
            made.append((f"make_loader, num_workers={workers[-1]}, pin_memory=False", lambda: make_loader(
                urls, batch, num_workers=workers[-1], split_by_node=False, pin_memory=False)))
        return made

    for dtype, paths in shards.items():
        compare = expectation(dtype, size)
        for name, build in cases(paths):
            limit = budget.cap(case_s)
            if limit < 1:
                rows.append({"dtype": dtype, "reader": name, "status": "cut: out of time"})
                continue
            try:
                row = deliver(build(), limit, compare)
            except Exception as exc:  # one reader failing leaves the others' figures
                row = {"status": f"failed: {type(exc).__name__}: {exc}"[:500]}
            gc.collect()
            sample_bytes = 3 * size * size * (1 if dtype == "uint8" else 4)
            if "samples" in row:
                row["gb_per_s"] = row["samples"] * sample_bytes / row["seconds"] / 1e9
                right = row["max_abs_difference"] <= 0.5 and row["batches_compared"] == row["batches"]
                row["status"] = "passed" if right else "failed: wrong images"
            rows.append({"dtype": dtype, "reader": name, **row})
            print(f"bench.gpu: loaders: {dtype} {name}: {row.get('samples_per_s', 0):.0f} samples/s, "
                  f"{row.get('gb_per_s', 0):.2f} GB/s, {row['status']}", flush=True)
    for row in rows:
        check(result, f"{row['dtype']} {row['reader']}", not row["status"].startswith("failed"), row["status"])
    late = [f"{row['dtype']} {row['reader']}" for row in rows if row["status"].startswith("cut")]
    if late and result.get("status") != "failed":
        result.update(status="cut", reason=f"out of time for {len(late)} cases: {', '.join(late)}")
    return result
