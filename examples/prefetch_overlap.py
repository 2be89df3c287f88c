"""Measure whether CudaPrefetcher's host-to-device copies overlap the training step (CUDA events).

Four timings per batch, on synthetic pinned batches (no loader in the way):

1. copy alone: ``x.to(cuda, non_blocking=True)`` bracketed by CUDA events (and the H2D bandwidth);
2. compute alone: a fixed matmul workload that reads the batch, bracketed by CUDA events;
3. serial: copy, then compute, on one stream (what a loop without prefetch does);
4. prefetched: the same compute over ``CudaPrefetcher(batches, depth=...)``.

``overlap = (serial - prefetched) / min(copy, compute)``: 1.0 means the copy is fully hidden behind
the compute, 0 means none of it is. Run on a GPU machine::

    python examples/prefetch_overlap.py --batch 256 --dtype uint8 --depth 2

``--json PATH`` also writes the figures there (``python -m bench.gpu`` reads them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from transformer.client import CudaPrefetcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--dtype", choices=["uint8", "float32"], default="uint8", help="what the service sends")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--matmuls", type=int, default=0, help="compute per batch (0: calibrate to the copy time)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing to measure on this machine")
        return 0
    device = torch.device("cuda")
    dtype = torch.uint8 if args.dtype == "uint8" else torch.float32
    shape = (args.batch, 3, args.size, args.size)
    pinned = [(torch.randint(0, 255, shape, dtype=torch.uint8).to(dtype).pin_memory(),
               torch.randint(0, 1000, (args.batch,)).pin_memory()) for _ in range(4)]
    weight = torch.randn(4096, 4096, device=device)

    def compute(images: torch.Tensor, matmuls: int) -> torch.Tensor:
        out = weight
        for _ in range(matmuls):
            out = out @ weight
        return out.sum() + images.float().mean()  # reads the batch, so it must wait for its copy

    def timed(fn, repeats: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # warm-up
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats

    copy_ms = timed(lambda: pinned[0][0].to(device, non_blocking=True), 10)
    per_matmul = timed(lambda: weight @ weight, 10)
    matmuls = args.matmuls or max(1, round(copy_ms / per_matmul))
    compute_ms = timed(lambda: compute(pinned[0][0][:1].to(device), matmuls), 5)

    def batches():
        for i in range(args.batches):
            yield pinned[i % len(pinned)]

    torch.cuda.synchronize()
    started = time.perf_counter()
    for images, _ in batches():
        compute(images.to(device, non_blocking=False), matmuls)
    torch.cuda.synchronize()
    serial_ms = (time.perf_counter() - started) * 1000 / args.batches

    prefetcher = CudaPrefetcher(batches(), device=device, depth=args.depth, normalize=args.dtype == "uint8")
    torch.cuda.synchronize()
    started = time.perf_counter()
    for images, _ in prefetcher:
        compute(images, matmuls)
    torch.cuda.synchronize()
    prefetched_ms = (time.perf_counter() - started) * 1000 / args.batches

    gigabytes = pinned[0][0].numel() * pinned[0][0].element_size() / 1e9
    overlap = (serial_ms - prefetched_ms) / min(copy_ms, compute_ms)
    print(f"device: {torch.cuda.get_device_name(device)}; batch {shape} {args.dtype}, depth {args.depth}")
    print(f"copy alone      {copy_ms:8.2f} ms/batch  ({gigabytes / copy_ms * 1000:.1f} GB/s host-to-device)")
    print(f"compute alone   {compute_ms:8.2f} ms/batch  ({matmuls} matmuls 4096^2)")
    print(f"serial          {serial_ms:8.2f} ms/batch")
    print(f"prefetched      {prefetched_ms:8.2f} ms/batch  (host wait {prefetcher.stats.wait_seconds:.3f} s)")
    print(f"overlap         {overlap:8.2f}  (1.0 = copy fully hidden behind compute)")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device), "batch": list(shape), "dtype": args.dtype,
            "depth": args.depth, "copy_ms": copy_ms, "h2d_gb_per_s": gigabytes / copy_ms * 1000,
            "compute_ms": compute_ms, "matmuls": matmuls, "serial_ms": serial_ms, "prefetched_ms": prefetched_ms,
            "host_wait_s": prefetcher.stats.wait_seconds, "overlap": overlap}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
