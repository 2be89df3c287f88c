"""Two versions of ``make_loader`` reading in DataLoader workers: ``python -m bench.experiments.loader_ab --base REV``.

The same ETL'd shards on local disk (the service's own output, imagenet-val, uint8 and float32) are
read whole by ``make_loader`` with 1 and 2 workers, without and with a 1000-sample shuffle buffer.
Each case runs version A, then version B, in fresh processes, for ``--rounds`` rounds, so both see the
same load. The main process lets each batch go when the next one arrives, as a training loop does.
``--base REV`` checks REV out in a temporary git worktree as A; B is this checkout.

Outputs in ``--out`` (default ``bench/results/loader-ab``): ``results.json`` and ``results.md``.

Decided: DataLoader workers fill batches in shared memory they keep (``batchmemory.SharedSlots``), 2-4x
PyTorch's copy (``bench/results/loader-ab/``, docs/design-loader.md "Batches from DataLoader workers").
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import client_side, data
from bench.stamp import git_state
from bench.stats import median

log = logging.getLogger("bench")
REPO = Path(__file__).resolve().parents[2]
CASES = [(dtype, workers, buffer) for dtype in ("float32", "uint8") for workers in (1, 2) for buffer in (0, 1000)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.loader_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to measure as A (a temporary worktree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples", type=int, default=256, help="samples per shard")
    parser.add_argument("--passes", type=int, default=2, help="times each shard is read per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "loader-ab")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("transformer").setLevel(logging.WARNING)
    started, git = time.time(), git_state()["git"]
    args.base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], check=True,
                               capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="wds-loader-ab-") as temporary:
        work = Path(temporary)
        base = work / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            runs = measure(args, work, {"A": base, "B": REPO})
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    command = "python -m bench.experiments.loader_ab " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = {"runs": runs, "meta": {"command": command, "git": git,
                                      "base": args.base, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z",
                                                                                  time.localtime(started)),
                                      "duration_s": round(time.time() - started, 1), "rounds": args.rounds,
                                      "shards": args.shards, "samples": args.samples, "passes": args.passes,
                                      "batch_size": args.batch_size}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(markdown(results))
    log.info("wrote %s/results.{json,md}", args.out)
    return 0


def measure(args: argparse.Namespace, work: Path, trees: dict[str, Path]) -> list[dict]:
    sources = [shard.path for shard in data.demo_shards(work, args.shards, args.samples)]
    shards = {dtype: [str(p) for p in args.passes * client_side.etl_shards(work / f"etl-{dtype}", sources,
                                                                           "imagenet-val", dtype)]
              for dtype in ("uint8", "float32")}
    runs = []
    for round_index in range(args.rounds):
        for dtype, workers, buffer in CASES:
            for version, tree in trees.items():
                spec = {"paths": shards[dtype], "batch_size": args.batch_size, "workers": workers, "buffer": buffer}
                done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=tree, capture_output=True,
                                      text=True, timeout=600, check=True)
                rate = json.loads(done.stdout.splitlines()[-1])["samples_per_s"]
                runs.append({"round": round_index, "dtype": dtype, "workers": workers, "shuffle_buffer": buffer,
                             "version": version, "samples_per_s": rate})
                log.info("round %d %s workers=%d shuffle_buffer=%d %s: %.0f samples/s", round_index + 1, dtype,
                         workers, buffer, version, rate)
    return runs


# Run in the version's own tree: ``python -c`` puts its working folder first on the path, so that tree's
# transformer and bench packages are the ones imported.
CHILD = """
import json, sys, time
from bench.client_side import _disk_loader
spec = json.loads(sys.argv[1])
loader = _disk_loader(spec["paths"], spec["batch_size"], spec["buffer"], spec["workers"])
start, samples = time.monotonic(), 0
for images, labels in loader:
    samples += len(images)
print(json.dumps({"samples_per_s": samples / (time.monotonic() - start)}))
"""


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# make_loader in DataLoader workers: A = {meta['base']}, B = this checkout", "",
             f"`{meta['command']}`, B at commit {meta.get('git', 'unknown')}, {meta['started']}, "
             f"{meta['duration_s']:.0f} s; {meta['shards']} shards x "
             f"{meta['samples']} samples (3x224x224) read {meta['passes']} times, batches of {meta['batch_size']}, "
             f"{meta['rounds']} round(s).", "",
             "| dtype | num_workers | shuffle_buffer | A samples/s | B samples/s | B/A per round |",
             "|---|---|---|---|---|---|"]
    for dtype, workers, buffer in CASES:
        case = (dtype, workers, buffer)
        mine = [r for r in results["runs"] if (r["dtype"], r["workers"], r["shuffle_buffer"]) == case]
        rates = {v: [r["samples_per_s"] for r in mine if r["version"] == v] for v in ("A", "B")}
        ratios = ", ".join(f"{b / a:.2f}" for a, b in zip(rates["A"], rates["B"]))
        lines.append(f"| {dtype} | {workers} | {buffer} | {median(rates['A']):,.0f} | {median(rates['B']):,.0f} | "
                     f"{ratios} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
