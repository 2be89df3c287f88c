"""The run: ``python -m bench.gpu`` (its options, the parts in order, the results written)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .budget import Budget, run_part, write_results
from .checks import prefetch_checks, run_tests
from .constants import INSTALLED, SIZE, WHEELS
from .loaders import bandwidth, floor_and_loaders
from .shards import make_shards, shard_folder
from .training import training
from .wheels import environment, import_all, install, needed_modules, on_carried_wheels, wheels_problem

# ---- the run ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="the training side on a GPU "
                                     "(docs/benchmarks.md, GPU)")
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
