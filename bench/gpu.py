"""The training side on a GPU: ``python -m bench.gpu --out DIR`` (``--smoke`` for CI, on any machine).

One command for a GPU machine that has Python 3.12, PyTorch with CUDA and the packages
``requirements/gpu-machine.txt`` lists, but no network. The client's other packages travel as wheels
(``--wheels``, default ``.gpu-wheels/``: ``make gpu-wheels`` fetches ``requirements/gpu-check.txt`` into it),
installed with ``pip --no-index --no-deps`` into a folder of their own; the run goes on in a child with that
folder first on its path, and the machine's torch is left as it is. Every part has a time cap inside
``--budget`` (seconds), so the run ends in time even where a part is slow; a part or case left without time is
reported as cut (the headline says which), never as passed or failed.
``results.json`` and ``results.md`` are written again after each part, so a run stopped from outside
keeps what it measured.

A lent GPU machine is there for minutes, so whatever would fail the run half-way stops it at once, saying why:
wheels missing or not the pins (exit 2 before anything else), a module the run imports missing (the
``imports`` part: every third-party module of the script, the example and the collected tests, imports inside
functions included, from ``bench/imports.py``), no CUDA device (but for ``--smoke``).

Parts, in order:

1. ``tests``: ``pytest tests/client -m "not server"``, the CUDA tests included. The tests that need
   the pod's side (marked ``server`` in tests/client/conftest.py) are left out, each listed with its
   reason; a skip other than the expected ones (the CPU fallback's check, DALI not installed) fails.
2. ``prefetch``: ``CudaPrefetcher`` on the device against its CPU path on the same batches; a batch
   handed to the step is not overwritten while the step still reads it (a long kernel on the consumer
   stream while later copies land), and the same check with ``record_stream`` left out must see the
   overwrite; the overlap that ``examples/prefetch_overlap.py`` measures, uint8 and float32, which must
   reach ``MIN_OVERLAP``.
3. ``shards``: ETL'd shards written here in the pod's output format (``<key>.npy`` of (3, 224, 224)
   and ``<key>.cls``, then the end marker, by the pod's own tar writer), the same images as uint8 and
   as float32 (normalized as the pod does), ``--gigabytes`` of float32.
4. ``reference``: the pinned and pageable host-to-device bandwidth, the cost of pinning a batch (the
   DataLoader's pin thread copies every batch), and the one-copy floor
   (``bench.client_side.one_copy_batches`` on one core, delivered through ``CudaPrefetcher``).
5. ``loaders``: samples/s and GB/s delivered into device memory through ``CudaPrefetcher``:
   ``make_loader`` with 0, 4 and 8 workers and ``web_loader`` with 8 (``pin_memory`` on), then
   ``make_loader`` with 8 and ``pin_memory`` off, uint8 and float32; every batch of each case is
   checked against the images the shards hold (uint8 normalized on the device against the float32).
6. ``training``: a ResNet-50 step at batch 256 (torchvision, bf16 autocast, channels_last, SGD) alone,
   then fed by ``make_loader`` through ``CudaPrefetcher``: the prefetcher's ``wait_seconds`` over the
   steady steps says whether the step is starved.

Writes ``results.json`` and ``results.md`` into ``--out`` and prints the table; exits 1 if a check
failed. With ``--smoke`` the sizes are tiny and the parts that need CUDA are skipped on a machine
without it: it checks that the script runs, not how fast anything is.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
INSTALLED = "BENCH_GPU_INSTALLED"  # set for the run on the carried wheels: the parent's results so far (JSON)
SIZE = 224
CLASSES = 1000
DISTINCT = 16  # distinct images in the shards: sample i shows image i % DISTINCT (and has label i)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# Skips that the GPU run expects; any other skip there fails the tests part.
EXPECTED_SKIPS = ("checks the fallback of a machine without CUDA", "DALI (the dali extra) is not installed")
WHEELS = REPO / ".gpu-wheels"
CARRIED = REPO / "requirements" / "gpu-check.txt"  # the wheels' pins: make gpu-wheels fetches exactly these
# The pod's side, which the run never calls (the client tests that need it are marked server and left out): an
# import of it inside a function is not followed when the run's imports are listed (bench/imports.py).
NEVER_CALLED = ("transformer.cli", "transformer.serve", "transformer.server", "transformer.apply", "transformer.engine",
                "transformer.spec", "transformer.samples", "transformer.preview", "transformer.demo",
                "transformer.cropdecode", "testbed.service")
# Modules the run's code imports that the machine lacks on purpose, each with the skip (EXPECTED_SKIPS) that
# keeps the run from needing it.
ABSENT = {"nvidia": "DALI (the dali extra) is not installed"}
# The prefetcher must hide at least half of a batch's copy behind the step (examples/prefetch_overlap.py:
# 1.0 = all of it): a copy on the step's stream, or one from pageable memory, gives about 0.
MIN_OVERLAP = 0.5


# ---- the pytest plugin (-p bench.gpu): each test's outcome, and the tests left out, as JSON lines --------


def _record(entry: dict) -> None:
    path = os.environ.get("BENCH_GPU_RECORD")
    if path:
        with open(path, "a") as stream:
            stream.write(json.dumps(entry) + "\n")


def pytest_deselected(items: list) -> None:
    for item in items:
        marker = item.get_closest_marker("server")
        reason = marker.kwargs.get("reason", "needs the pod's side") if marker else "deselected"
        _record({"test": item.nodeid, "outcome": "left out", "reason": reason})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _record({"test": report.nodeid, "outcome": "error", "when": "collect", "reason": str(report.longrepr)[-1500:]})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            reason = str(report.longrepr)[-1500:]
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        _record({"test": report.nodeid, "outcome": outcome, "when": report.when, "reason": reason,
                 "seconds": round(report.duration, 3)})


# ---- budget and parts ---------------------------------------------------------------------------------------


class Budget:
    """The run's deadline; ``cap(s)`` is a part's limit: ``s`` or what is left, whichever is less."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cap(self, seconds: float) -> float:
        return max(0.0, min(seconds, self.left()))


class Skip(Exception):
    """A part that cannot run here (no CUDA): reported as skipped with its reason."""


class Cut(Exception):
    """A part left without time: reported as cut, which fails nothing and passes nothing."""


def run_part(results: dict, name: str, function: Callable[[], dict], budget: Budget, minimum: float,
             out: Path | None = None) -> None:
    started = time.monotonic()
    entry: dict[str, Any] = {"status": "passed"}
    try:
        if budget.left() < minimum:
            raise Cut(f"out of time: {budget.left():.0f} s left, the part needs at least {minimum:.0f} s")
        entry.update(function())
    except Skip as skip:
        entry = {"status": "skipped", "reason": str(skip)}
    except Cut as cut:
        entry = {"status": "cut", "reason": str(cut)}
    except Exception as exc:  # one part's failure must not lose the others' figures
        import traceback

        entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                 "traceback": traceback.format_exc()[-4000:]}
    entry["seconds"] = round(time.monotonic() - started, 1)
    results["parts"][name] = entry
    print(f"bench.gpu: {name}: {entry['status']} in {entry['seconds']} s"
          + (f" ({entry['reason'][:300]})" if entry.get("reason") else ""), flush=True)
    if out is not None:
        write_results(results, out)


def verdict_of(results: dict, smoke: bool) -> None:
    """``ok``: no part failed, and (but for a smoke run) none was skipped; ``cut``: the parts out of time."""
    parts = results["parts"].items()
    failed = [name for name, part in parts if part["status"] == "failed"]
    skipped = [name for name, part in parts if part["status"] == "skipped"]
    results["ok"] = not failed and (smoke or not skipped)
    results["cut"] = [name for name, part in parts if part["status"] == "cut"]


def write_results(results: dict, out: Path, finished: bool = False) -> None:
    """results.json and results.md as they stand: after each part, and at the end (``finished``)."""
    out.mkdir(parents=True, exist_ok=True)
    results.setdefault("meta", {})["finished"] = finished
    verdict_of(results, results["meta"].get("smoke", False))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))


def check(entry: dict, name: str, ok: bool, detail: str) -> None:
    """One named check of a part: the part fails when any of its checks does."""
    entry.setdefault("checks", []).append({"check": name, "ok": bool(ok), "detail": detail})
    if not ok:
        entry["status"] = "failed"
        entry["reason"] = "; ".join(c["check"] for c in entry["checks"] if not c["ok"])


# ---- 0. the carried wheels, and every module the run imports ----------------------------------------------


def run_files() -> list[Path]:
    """The files the run starts from: this script, the example it runs and the tests it collects."""
    tests = REPO / "tests"
    return [REPO / "bench" / "gpu.py", REPO / "examples" / "prefetch_overlap.py", tests / "conftest.py",
            *sorted((tests / "client").glob("*.py"))]


def needed_modules() -> dict[str, str]:
    """Each third-party module the run imports (inside functions too, the pod's side left out) -> where; without
    the ``ABSENT`` ones."""
    from .imports import third_party_imports

    found = third_party_imports(run_files(), follow_functions=True, never_called=NEVER_CALLED)
    return {module: where for module, where in sorted(found.items()) if module not in ABSENT}


def wheels_problem(wheels: Path, carried: Path = CARRIED) -> str | None:
    """Why ``wheels`` is not the set of ``carried``'s pins (missing, empty, a pin without its wheel, a wheel
    without its pin), or None. Checked before anything else: the run cannot work without them."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    fix = (f"run `make gpu-wheels` in the checkout the call is made from, and carry the folder: "
           f"run(command=..., carry=[\"{WHEELS.name}\"], ...)")
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels}: {fix}"
    pins = {}
    for line in carried.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            requirement = Requirement(text)
            pins[canonicalize_name(requirement.name)] = str(next(iter(requirement.specifier)).version)
    found = {str(parse_wheel_filename(f.name)[0]): str(parse_wheel_filename(f.name)[1]) for f in files}
    if found != pins:
        missing = sorted(f"{n}=={v}" for n, v in pins.items() if found.get(n) != v)
        extra = sorted(f"{n}=={v}" for n, v in found.items() if pins.get(n) != v)
        return (f"{wheels} is not {carried.relative_to(REPO)}: missing {', '.join(missing) or 'none'}; not pinned "
                f"{', '.join(extra) or 'none'}: {fix}")
    return None


def import_all(modules: dict[str, str]) -> dict:
    """Each module of ``modules`` imported here (the machine's packages and the carried wheels): a missing one
    fails the run in seconds instead of half-way through."""
    import importlib

    failed = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import error names what to carry or install
            failed[module] = f"{type(exc).__name__}: {exc}"[:300]
    result = {"modules": sorted(modules), "failed": failed}
    check(result, "every module the run imports is there", not failed,
          "; ".join(f"{m} (imported at {modules[m]}): {why}" for m, why in failed.items()))
    return result


def install(wheels: Path, site: Path) -> dict:
    """The wheels in ``wheels`` installed into ``site`` (no index, no dependencies resolved: the
    machine's own packages stay); and every requirement of an installed wheel that ``site`` and this
    process's path together do not meet. The run goes on in a child with ``site`` first on its path
    (``carried_env``)."""
    from importlib import metadata

    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise RuntimeError(f"no wheels in {wheels} (make gpu-wheels fetches them)")
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(site), *map(str, files)],
                   check=True, timeout=120)
    from packaging.requirements import Requirement
    from packaging.version import Version

    search = [str(site), *sys.path]  # the child's path: the carried wheels first
    unmet = []
    installed = []
    for dist in metadata.distributions(path=[str(site)]):
        installed.append(f"{dist.metadata['Name']}=={dist.version}")
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            found = next((d.version for d in metadata.distributions(name=requirement.name, path=search)), None)
            if found is None:
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(Version(found), prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: {found} is installed")
    result = {"wheels": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files),
              "installed": sorted(installed), "unmet": sorted(unmet)}
    check(result, "every requirement of the wheels met", not unmet, "; ".join(sorted(unmet)))
    return result


def carried_env(site: Path, **extra: str) -> dict[str, str]:
    """This environment with ``site`` first on PYTHONPATH: a child imports the carried wheels before the machine's."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
            **extra}


def on_carried_wheels(argv: list[str], site: Path, work: Path, budget: Budget, results: dict, started: float) -> int:
    """The rest of the run in a child whose path has the carried wheels first; the child writes the results.

    It gets the same arguments, the same work folder and the budget left; ``INSTALLED`` hands it what this
    process measured so far (the install part, the start time, the command as given)."""
    state = {"parts": results["parts"], "meta": results["meta"], "started": started}
    command = [sys.executable, "-m", "bench.gpu", *argv, "--work", str(work), "--budget", f"{budget.left():.1f}"]
    return subprocess.run(command, cwd=REPO, env=carried_env(site, **{INSTALLED: json.dumps(state)})).returncode


def environment(smoke: bool) -> dict:
    import importlib.metadata as metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    return {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpus": os.cpu_count(), "dev_shm_gib": round(shm.total / 2**30, 1) if shm else None,
        "packages": {name: version(name) for name in ("torchvision", "numpy", "webdataset", "aistore", "pydantic",
                                                      "requests", "urllib3", "pytest")},
        "smoke": smoke,
    }


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
    command = [sys.executable, "-m", "pytest", *paths, "-m", "not server", "-p", "bench.gpu", "-p", "no:cacheprovider",
               "-q", "--basetemp", str(work / "pytest")]
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(10_000_000 * sleep_ms / max(start.elapsed_time(end), 1e-3))
    original = prefetch._tensors
    if planted:
        prefetch._tensors = lambda batch: iter(())  # no tensor gets record_stream(consumer)
    try:
        sums = []
        for images, _ in CudaPrefetcher(source, device="cuda", depth=2):
            torch.cuda._sleep(cycles)  # the step is busy; the side stream copies on meanwhile
            sums.append(images.double().sum())  # queued behind the kernel: reads the batch late
            del images  # the step lets go of the batch before its read ran
        got = [float(s) for s in sums]
    finally:
        prefetch._tensors = original
        torch.cuda.synchronize()
    wrong = sum(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, expected))
    return {"batches": count, "sleep_ms": sleep_ms, "wrong_batches": wrong, "intact": wrong == 0}


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


# ---- 3. shards ----------------------------------------------------------------------------------------------


def distinct_images(size: int) -> Any:
    """The DISTINCT uint8 images the shards hold (seeded noise: nothing compresses, every byte counts)."""
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (DISTINCT, 3, size, size), dtype=np.uint8)


def as_float32(images: Any) -> Any:
    """The pod's float32 output of uint8 images: ``x * (1 / (255 std)) + (-mean / std)`` in float32,
    the multiply-add of transformer/samples.py."""
    import numpy as np

    mean = np.array(MEAN, np.float32).reshape(3, 1, 1)
    std = np.array(STD, np.float32).reshape(3, 1, 1)
    scale, shift = np.float32(1.0) / (np.float32(255.0) * std), -mean / std
    return images.astype(np.float32) * scale + shift


def write_shards(folder: Path, dtype: str, shards: int, per_shard: int, size: int) -> list[Path]:
    """Shards as the pod writes them (its tar writer, ``.npy`` then ``.cls`` per sample, the end
    marker): sample i is ``sample-<i>`` with label i and image i % DISTINCT."""
    import tarfile

    import numpy as np
    from numpy.lib import format as npy

    from transformer.integrity import end_marker_payload
    from transformer.shards import Member, json_member, member_bytes
    from transformer.wire import END_MARKER_NAME, END_OF_ARCHIVE

    images = distinct_images(size)
    images = images if dtype == "uint8" else as_float32(images)
    rows = [memoryview(np.ascontiguousarray(image)).cast("B") for image in images]
    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": npy.dtype_to_descr(images.dtype), "fortran_order": False,
                                        "shape": images.shape[1:]})

    def member(name: str, pieces: list) -> Member:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = sum(len(piece) for piece in pieces), 1_700_000_000, 0o644
        return Member(info=info, pieces=pieces)

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = folder / f"train-{s:04d}.tar"
        written = members = 0
        with open(path, "wb") as out:
            for i in range(s * per_shard, (s + 1) * per_shard):
                key = f"sample-{i:07d}"
                for sample_member in (member(f"{key}.npy", [header.getvalue(), rows[i % DISTINCT]]),
                                      member(f"{key}.cls", [b"%d" % i])):
                    members += 1
                    for piece in member_bytes(sample_member):
                        written += len(piece)
                        out.write(piece)
            payload = end_marker_payload(samples_in=per_shard, samples_out=per_shard, skipped=0, passed_through=0,
                                         members=members, bytes_before=written)
            for piece in member_bytes(json_member(END_MARKER_NAME, payload, 1_700_000_000)):
                out.write(piece)
            out.write(END_OF_ARCHIVE)
        paths.append(path)
    return paths


def shard_folder(work: Path, gigabytes: float) -> Path:
    """Where the shards go: memory (/dev/shm) when it has room for four times them, so that writing
    them costs no disk writeback (the loaders read them from memory either way: the page cache holds
    what was just written); else ``work``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * 1.25 * gigabytes * 1e9:
        return Path(tempfile.mkdtemp(prefix="bench-gpu-shards-", dir=shm))
    return work / "shards"


def make_shards(work: Path, gigabytes: float, per_shard: int, size: int) -> tuple[dict, dict]:
    sample_bytes = 3 * size * size * 4
    samples = max(per_shard, int(gigabytes * 1e9 / sample_bytes + per_shard - 1) // per_shard * per_shard)
    shards = {}
    for dtype in ("uint8", "float32"):
        shards[dtype] = write_shards(work / dtype, dtype, samples // per_shard, per_shard, size)
    sizes = {dtype: sum(p.stat().st_size for p in paths) for dtype, paths in shards.items()}
    return shards, {"folder": str(work), "samples": samples, "shards_per_dtype": samples // per_shard,
                    "samples_per_shard": per_shard, "image": [3, size, size], "bytes": sizes,
                    "gigabytes": round(sum(sizes.values()) / 1e9, 2)}


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


# ---- 6. the training step -----------------------------------------------------------------------------------


def training(shards: dict, batch: int, steps: int, workers: int, model_name: str, size: int, budget: Budget,
             limit_s: float) -> dict:
    import torch
    import torch.nn.functional as functional

    from transformer.client import CudaPrefetcher, make_loader

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if model_name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None)
    else:  # a stand-in small enough for a CPU smoke run
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))
    model = model.to(device, memory_format=torch.channels_last)
    parameters = list(model.parameters())
    torch.backends.cudnn.benchmark = True

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = functional.cross_entropy(model(images), labels % CLASSES)
        for parameter in parameters:
            parameter.grad = None
        loss.backward()
        with torch.no_grad():  # plain SGD in one multi-tensor op, as torch.optim.SGD(foreach=True) does it
            torch._foreach_add_(parameters, [p.grad for p in parameters], alpha=-0.01)

    fixed = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    fixed_labels = torch.randint(0, CLASSES, (batch,), device=device)
    for _ in range(3):
        step(fixed, fixed_labels)
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    timed = 0
    while timed < 10 and (timed < 2 or time.perf_counter() - started < limit_s / 2):
        step(fixed, fixed_labels)
        timed += 1
    if cuda:
        torch.cuda.synchronize()
    alone_s = (time.perf_counter() - started) / timed
    result: dict[str, Any] = {"model": model_name, "batch_size": batch, "step_alone_ms": alone_s * 1000,
                              "step_alone_samples_per_s": batch / alone_s, "fed": []}
    warm = 3  # steps before the steady state: the workers' start and the first batches
    for dtype in ("uint8", "float32"):
        limit = budget.cap(limit_s)
        if limit < 2:
            result["fed"].append({"dtype": dtype, "status": "cut: out of time"})
            continue
        # Drawn with replacement: one epoch of ``steps`` batches, the workers started once.
        loader = make_loader([str(p) for p in shards[dtype]], batch, num_workers=workers, split_by_node=False,
                             resampled=True, epoch_batches=steps, pin_memory=cuda)
        prefetcher = CudaPrefetcher(loader, depth=2, channels_last=True)
        done = 0
        began = time.perf_counter()
        wait_at_warm = steady_from = None
        for images, labels in prefetcher:
            step(images, labels)
            done += 1
            if done == warm:
                if cuda:
                    torch.cuda.synchronize()
                wait_at_warm, steady_from = prefetcher.stats.wait_seconds, time.perf_counter()
            if time.perf_counter() - began > limit:
                break
        if cuda:
            torch.cuda.synchronize()
        ended = time.perf_counter()
        row: dict[str, Any] = {"dtype": dtype, "workers": workers, "steps": done, "seconds": round(ended - began, 2),
                               "wait_s": prefetcher.stats.wait_seconds}
        del prefetcher, loader
        gc.collect()
        if steady_from is None or done <= warm:
            row["status"] = "failed: fewer steps than the warm-up"
        else:
            steady_s = ended - steady_from
            wait = row["wait_s"] - wait_at_warm
            rate = (done - warm) * batch / steady_s
            row.update(steady_steps=done - warm, steady_samples_per_s=rate, steady_wait_s=wait,
                       steady_wait_share=wait / steady_s, starved=rate < 0.95 * result["step_alone_samples_per_s"],
                       status="passed")
        result["fed"].append(row)
        print(f"bench.gpu: training: {dtype}: {row}", flush=True)
    for row in result["fed"]:
        check(result, f"fed by make_loader ({row['dtype']})", not row["status"].startswith("failed"), row["status"])
    late = [row["dtype"] for row in result["fed"] if row["status"].startswith("cut")]
    if late and result.get("status") != "failed":
        result.update(status="cut", reason=f"out of time for the fed step: {', '.join(late)}")
    return result


# ---- the run ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CUDA parts skipped without CUDA: "
                        "checks the script, not speed")
    parser.add_argument("--wheels", type=Path, help=f"install these wheels first (default {WHEELS.name}/ but for a "
                        "smoke run; missing, or not requirements/gpu-check.txt's pins, the run stops at once)")
    parser.add_argument("--work", type=Path, help="folder for the shards and the installed wheels (default: a "
                      "temporary folder)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default 270; smoke 200)")
    parser.add_argument("--tests", nargs="*", help="pytest paths (default tests/client; smoke the prefetcher's)")
    parser.add_argument("--tests-seconds", type=float, dest="tests_s", help="the tests' cap (default 100; smoke 45)")
    parser.add_argument("--gigabytes", type=float, help="float32 shard bytes (default 2.0, with a quarter of that "
                        "in uint8 shards of the same samples; smoke 0.0004)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    # The smoke run's tests: the prefetcher's (CUDA ones skip without CUDA) and the example's (left out: server).
    smoke_tests = ["tests/client/test_prefetch.py", "tests/client/test_example.py"]
    defaults = {"budget": (200.0, 270.0), "tests": (smoke_tests, ["tests/client"]), "gigabytes": (0.0004, 2.0),
                "tests_s": (45.0, 100.0)}
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
    if args.wheels is None and not smoke:
        args.wheels = WHEELS  # missing, main() stops at once: the run cannot work without them
    sizes = {"batch": (8, 256), "size": (32, SIZE), "per_shard": (16, 256), "workers": ([0, 1], [0, 4, 8]),
             "web_workers": (0, 8), "case_s": (3.0, 7.0), "model": ("tiny", "resnet50"), "steps": (5, 40),
             "train_workers": (0, 8), "train_s": (4.0, 20.0), "passes": (1, 5)}
    for name, (small, full) in sizes.items():
        setattr(args, name, small if smoke else full)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    carried = os.environ.get(INSTALLED)
    if args.wheels is not None and not carried and not args.smoke:
        problem = wheels_problem(args.wheels)
        if problem:
            print(f"bench.gpu: {problem}", file=sys.stderr, flush=True)
            return 2
    started = time.time()
    budget = Budget(args.budget)
    results: dict[str, Any] = {"parts": {}, "meta": {
        "command": "python -m bench.gpu " + shlex.join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), "budget_s": args.budget,
        "smoke": args.smoke}}
    if carried:  # the run on the carried wheels: what the parent measured so far
        state = json.loads(carried)
        results["parts"], results["meta"] = state["parts"], state["meta"]
        started = state["started"]
    out = args.out
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        if args.wheels is not None and not carried:
            run_part(results, "install", lambda: install(args.wheels, work / "site"), budget, 0, out)
            if results["parts"]["install"]["status"] != "passed":
                return finish(results, out, started)
            return on_carried_wheels(argv, work / "site", work, budget, results, started)
        run_part(results, "imports", lambda: import_all(needed_modules()), budget, 0, out)
        results["environment"] = environment(args.smoke)
        cuda = results["environment"]["device"] is not None
        if not cuda and not args.smoke:
            results["parts"]["cuda"] = {"status": "failed", "reason": "no CUDA device: this run is for a GPU machine "
                                        "(--smoke runs the script anywhere)", "seconds": 0}
        if results["parts"]["imports"]["status"] != "passed" or "cuda" in results["parts"]:
            return finish(results, out, started)  # the rest would fail half-way: stop at once, saying why
        run_part(results, "tests", lambda: run_tests(args.tests, budget.cap(args.tests_s), work, cuda), budget, 20, out)
        run_part(results, "prefetch", lambda: prefetch_checks(args.batch if args.smoke else 64, budget, args.smoke,
                                                              work), budget, 10, out)
        shards: dict = {}
        folder = shard_folder(work, args.gigabytes)

        def make() -> dict:
            made, summary = make_shards(folder, args.gigabytes, args.per_shard, args.size)
            shards.update(made)
            return summary

        try:
            run_part(results, "shards", make, budget, 10, out)
            run_part(results, "bandwidth", lambda: bandwidth(args.batch, args.size), budget, 3, out)
            # What training needs is kept back from the loaders: their cases end earlier instead.
            reserve = 2 * args.train_s + 15
            loaders_budget = Budget(max(0.0, budget.left() - reserve))
            if shards:
                run_part(results, "loaders", lambda: floor_and_loaders(
                    shards, args.batch, args.workers, args.web_workers, args.case_s, loaders_budget, args.size,
                    args.passes), budget, 10, out)
                run_part(results, "training", lambda: training(
                    shards, args.batch, args.steps, args.train_workers, args.model, args.size, budget, args.train_s),
                    budget, 10, out)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # in memory when it is under /dev/shm
    return finish(results, out, started)


def finish(results: dict, out: Path, started: float) -> int:
    """The results written and printed; exit status 0 if the run passed."""
    results["meta"]["duration_s"] = round(time.time() - started, 1)
    write_results(results, out, finished=True)
    print((out / "results.md").read_text(), flush=True)
    return 0 if results["ok"] else 1


def _figure(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    meta = results.get("meta", {})
    cut = results.get("cut") or []
    headline = "FAILED" if not results.get("ok") else "passed" + (f", cut for time: {', '.join(cut)}" if cut else "")
    if not meta.get("finished", True):
        headline += " (so far: the run has not finished)"
    lines = [f"# GPU check: {headline}", "",
             f"{env.get('device') or 'no CUDA device'}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
             f"torchvision {env.get('packages', {}).get('torchvision')}, Python {env.get('python')}, "
             f"{env.get('cpus')} CPUs, /dev/shm {env.get('dev_shm_gib')} GiB; {meta.get('started')}, "
             f"{meta.get('duration_s')} s of a {meta.get('budget_s'):.0f} s budget; `{meta.get('command')}`", "",
             "| part | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, part in results["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '-')} | {part.get('reason', '')[:200]} |")
    parts = results["parts"]
    for name, part in parts.items():
        for failed in (c for c in part.get("checks", []) if not c["ok"]):
            lines.append(f"- {name}: {failed['check']}: {failed['detail'][:500]}")
    install_part = parts.get("install", {})
    if "wheels" in install_part:
        lines.append(f"\nInstalled {len(install_part['wheels'])} carried wheels "
                     f"({install_part['bytes'] / 1e6:.1f} MB): {', '.join(install_part['installed'])}")
    tests = parts.get("tests", {})
    if "counts" in tests:
        lines += ["", f"Tests: {', '.join(f'{n} {k}' for k, n in sorted(tests['counts'].items()))}."]
        for entry in tests.get("failed", []):
            lines.append(f"- FAILED {entry['test']}: {entry['reason'][-300:]}")
        for entry in tests.get("skipped", []):
            lines.append(f"- skipped {entry['test']}: {entry['reason']}")
        for entry in tests.get("left_out", []):
            lines.append(f"- left out {entry['test']}: {entry['reason']}")
    prefetch = parts.get("prefetch", {})
    for row in prefetch.get("overlap", []) if isinstance(prefetch.get("overlap"), list) else []:
        lines.append(f"\nprefetch_overlap.py, batch 256 {row['dtype']}: copy {_figure(row.get('copy_ms'), 2)} ms "
                     f"({_figure(row.get('h2d_gb_per_s'), 1)} GB/s), compute {_figure(row.get('compute_ms'), 2)} ms, "
                     f"serial {_figure(row.get('serial_ms'), 2)} ms, prefetched {_figure(row.get('prefetched_ms'), 2)} "
                     f"ms: overlap {_figure(row.get('overlap'), 2)} (1.0: the copy hidden)")
    if isinstance(prefetch.get("kept_while_read"), dict):
        for name, row in prefetch["kept_while_read"].items():
            lines.append(f"\nKept while read ({name}): {row['wrong_batches']} of {row['batches']} batches read "
                         "overwritten")
    bandwidth_part = parts.get("bandwidth", {})
    if "h2d_pinned_gb_per_s" in bandwidth_part:
        lines.append(f"\nOne float32 batch ({bandwidth_part['batch_bytes'] / 1e6:.0f} MB): host-to-device "
                     f"{bandwidth_part['h2d_pinned_gb_per_s']:.1f} GB/s pinned, "
                     f"{bandwidth_part['h2d_pageable_gb_per_s']:.1f} GB/s pageable; pinning it (the pin thread's "
                     f"copy) {bandwidth_part['pin_memory_gb_per_s']:.1f} GB/s, "
                     f"{bandwidth_part['pin_memory_ms_per_batch']:.1f} ms")
    loaders = parts.get("loaders", {})
    if loaders.get("rows"):
        lines += ["", f"Into device memory through CudaPrefetcher, batch {loaders['batch_size']}, pin_memory "
                  f"{loaders['pin_memory']} (but where the row says otherwise), the shards read {loaders['passes']} "
                  f"times over, each case for {loaders['case_limit_s']:.0f} s at most:", "",
                  "| dtype | reader | samples/s | steady samples/s | GB/s | first batch s | host wait s | status |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in loaders["rows"]:
            lines.append(f"| {row['dtype']} | {row['reader']} | {_figure(row.get('samples_per_s'))} | "
                         f"{_figure(row.get('steady_samples_per_s'))} | {_figure(row.get('gb_per_s'), 2)} | "
                         f"{_figure(row.get('first_batch_s'), 2)} | {_figure(row.get('wait_s'), 2)} | "
                         f"{row['status']} |")
    train = parts.get("training", {})
    if "step_alone_ms" in train:
        lines += ["", f"Training step ({train['model']}, batch {train['batch_size']}): alone "
                  f"{train['step_alone_ms']:.1f} ms ({train['step_alone_samples_per_s']:,.0f} samples/s)", ""]
        for row in train["fed"]:
            if "steady_samples_per_s" in row:
                lines.append(f"- fed by make_loader ({row['workers']} workers), {row['dtype']}: "
                             f"{row['steady_samples_per_s']:,.0f} samples/s over {row['steady_steps']} steady steps, "
                             f"host wait {row['steady_wait_s']:.2f} s ({row['steady_wait_share']:.0%}): "
                             f"{'STARVED' if row['starved'] else 'not starved'}")
            else:
                lines.append(f"- {row['dtype']}: {row['status']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
