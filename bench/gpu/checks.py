"""Parts 1 and 2: the client's tests on the device (judged by their outcomes), and ``CudaPrefetcher`` on the
device: its CPU path's bytes, a batch never overwritten while the step reads it, the copy's overlap."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from .budget import Budget, check
from .constants import EXPECTED_SKIPS, MIN_OVERLAP, REPO, SIZE

# ---- 1. the client's tests ----------------------------------------------------------------------------------


def run_tests(paths: list[str], limit_s: float, work: Path, cuda: bool) -> dict:
    """``pytest paths -m "not server"`` in a subprocess, each test's outcome recorded by this module as a
    plugin (kept even if the run is stopped at ``limit_s``), then judged by ``verdict``."""
    record = work / "tests.jsonl"
    record.unlink(missing_ok=True)
    env = {**os.environ, "BENCH_GPU_RECORD": str(record), "PYTHONUNBUFFERED": "1"}
    # A fresh interpreter: it must import this checkout's packages (transformer, tests, testbed, bench as the
    # plugin); testbed and bench are never installed, and an installed transformer may be another copy.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    command = [sys.executable, "-m", "pytest", *paths, "-m", "not server", "-p", "bench.gpu.plugin",
               "-p", "no:cacheprovider", "-q", "--basetemp", str(work / "pytest")]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit_s)
        code, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as expired:
        code, tail = None, f"stopped after {limit_s:.0f} s\n" + str(expired.stdout or "")[-3000:]
    entries = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return {"command": shlex.join(["python", *command[1:]]), "output_tail": tail, **verdict(entries, code, cuda)}


def verdict(entries: list[dict], code: int | None, cuda: bool) -> dict:
    """The tests' counts and lists, and the checks: pytest ended (0 or 1), no test failed, some passed,
    and no skip but the expected ones (without CUDA, the CUDA tests' too)."""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    expected = EXPECTED_SKIPS if cuda else (*EXPECTED_SKIPS, "needs CUDA")
    unexpected = [e for e in entries if e["outcome"] == "skipped" and not any(r in e["reason"] for r in expected)]
    result: dict[str, Any] = {
        "exit_code": code, "counts": counts,
        "left_out": [e for e in entries if e["outcome"] == "left out"],
        "skipped": [e for e in entries if e["outcome"] == "skipped"],
        "failed": [e for e in entries if e["outcome"] in ("failed", "error")],
        "slowest": sorted((e for e in entries if "seconds" in e), key=lambda e: -e["seconds"])[:5],
    }
    check(result, "pytest finished", code in (0, 1), f"exit code {code}")
    check(result, "no test failed", not result["failed"], f"{len(result['failed'])} failed")
    check(result, "tests ran", counts.get("passed", 0) > 0, f"{counts.get('passed', 0)} passed")
    check(result, "no unexpected skip", not unexpected, "; ".join(f"{e['test']}: {e['reason']}" for e in unexpected))
    return result


# ---- 2. CudaPrefetcher on the device ------------------------------------------------------------------------


def prefetch_checks(batch: int, budget: Budget, smoke: bool, work: Path) -> dict:
    import torch

    from transformer.client import CudaPrefetcher

    result: dict[str, Any] = {}
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    generator = torch.Generator().manual_seed(0)
    size = 32 if smoke else SIZE

    def batches(layout: str, dtype: torch.dtype, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, 3, size, size) if layout == "CHW" else (batch, size, size, 3)
        made = []
        for i in range(count):
            images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
            images = images if dtype == torch.uint8 else images.to(dtype) / 255
            labels = torch.arange(batch) + i * batch
            made.append((images.pin_memory(), labels.pin_memory()) if cuda else (images, labels))
        return made

    cases = [("uint8 CHW, normalized, channels_last", "CHW", torch.uint8, {"channels_last": True}),
             ("uint8 HWC, normalized", "HWC", torch.uint8, {"layout": "HWC"}),
             ("uint8 CHW, not normalized", "CHW", torch.uint8, {"normalize": False}),
             ("float32 CHW", "CHW", torch.float32, {})]
    rows = []
    for name, layout, dtype, options in cases:
        source = batches(layout, dtype)
        on_device = [(images.cpu(), labels.cpu()) for images, labels in
                     CudaPrefetcher(source, device=device, depth=2, **options)]
        on_cpu = list(CudaPrefetcher(source, device="cpu", depth=2, **options))
        worst = max(float((a - b).abs().max()) for (a, _), (b, _) in zip(on_device, on_cpu))
        labels_ok = all(torch.equal(a, b) for (_, a), (_, b) in zip(on_device, on_cpu))
        layout_ok = all(a.is_contiguous(memory_format=torch.channels_last) for a, _ in on_device) \
            if options.get("channels_last") or layout == "HWC" else True
        ok = len(on_device) == len(source) and labels_ok and layout_ok and all(
            torch.allclose(a, b, atol=1e-5, rtol=1e-5) for (a, _), (b, _) in zip(on_device, on_cpu))
        rows.append({"case": name, "batches": len(on_device), "max_abs_difference": worst, "ok": ok})
        check(result, f"{device.type} path = CPU path: {name}", ok, f"max |difference| {worst:.2e}")
    result["equal_to_cpu"] = rows
    if not cuda:
        result["kept_while_read"] = result["overlap"] = "skipped: no CUDA"
        return result
    result["kept_while_read"] = kept = {
        "with record_stream": overwrite_check(batch, planted=False),
        "record_stream left out (planted defect)": overwrite_check(batch, planted=True),
    }
    check(result, "a batch handed out is kept while the step reads it", kept["with record_stream"]["intact"],
          f"{kept['with record_stream']['wrong_batches']} batches read overwritten")
    check(result, "the check sees an overwrite when record_stream is left out",
          not kept["record_stream left out (planted defect)"]["intact"],
          f"{kept['record_stream left out (planted defect)']['wrong_batches']} batches read overwritten")
    result["overlap"] = []
    for dtype in ("uint8", "float32"):
        row = overlap(dtype, budget.cap(45), work)
        result["overlap"].append(row)
        check_overlap(result, row)
    return result


def check_overlap(result: dict, row: dict) -> None:
    """prefetch_overlap.py's figures for one dtype: it ran, and hid at least ``MIN_OVERLAP`` of the copy."""
    dtype = row["dtype"]
    check(result, f"prefetch_overlap.py ran ({dtype})", row.get("overlap") is not None, row.get("error", ""))
    if row.get("overlap") is not None:
        check(result, f"the copy overlaps the step ({dtype}): overlap >= {MIN_OVERLAP}",
              row["overlap"] >= MIN_OVERLAP, f"overlap {row['overlap']:.2f}")


def overwrite_check(batch: int, planted: bool, count: int = 8, sleep_ms: float = 40.0) -> dict:
    """Each batch's sum, read on the consumer stream after a long kernel, against the CPU path's: later
    copies land while the kernel runs, so a batch whose memory was handed to a later copy sums wrong."""
    import torch

    from transformer.client import CudaPrefetcher, prefetch

    source = [(torch.full((batch, 3, SIZE, SIZE), 10 + 20 * i, dtype=torch.uint8).pin_memory(),
               torch.arange(batch).pin_memory()) for i in range(count)]
    expected = [float(images.double().sum()) for images, _ in CudaPrefetcher(source, device="cpu")]
    original = prefetch._tensors
    if planted:
        prefetch._tensors = lambda batch: iter(())  # no tensor gets record_stream(consumer)
    try:
        got = read_late(source, sleep_ms)
    finally:
        prefetch._tensors = original
        torch.cuda.synchronize()
    wrong = sum(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, expected))
    return {"batches": count, "sleep_ms": sleep_ms, "wrong_batches": wrong, "intact": wrong == 0}


def read_late(batches: list, sleep_ms: float) -> list[float]:
    """Each batch's sum, read on the consumer stream behind a kernel that keeps it busy ``sleep_ms``, the batch
    let go before the read ran: later copies land meanwhile, so one whose memory they reused sums wrong
    (``tests/client/test_prefetch.py`` reads its batches the same way)."""
    import torch

    from transformer.client import CudaPrefetcher

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(10_000_000 * sleep_ms / max(start.elapsed_time(end), 1e-3))
    sums = []
    for images, _ in CudaPrefetcher(batches, device="cuda", depth=2):
        torch.cuda._sleep(cycles)  # the step is busy; the side stream copies on meanwhile
        sums.append(images.double().sum())  # queued behind the kernel: reads the batch late
        del images  # the step lets go of the batch before its read ran
    return [float(total) for total in sums]  # the one synchronization, at the end


def overlap(dtype: str, limit_s: float, work: Path) -> dict:
    """``examples/prefetch_overlap.py`` at batch 256, depth 2: its figures (``--json``)."""
    figures = work / f"overlap-{dtype}.json"
    figures.unlink(missing_ok=True)
    command = [sys.executable, str(REPO / "examples" / "prefetch_overlap.py"), "--batch", "256", "--dtype", dtype,
               "--depth", "2", "--batches", "40", "--json", str(figures)]
    # A fresh interpreter: the example must import this checkout's transformer, not an installed copy (if any).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(limit_s, 1))
    except subprocess.TimeoutExpired:
        return {"dtype": dtype, "error": f"stopped after {limit_s:.0f} s"}
    if done.returncode != 0 or not figures.exists():
        return {"dtype": dtype, "error": (done.stdout + done.stderr)[-1500:]}
    return {"dtype": dtype, **json.loads(figures.read_text())}
