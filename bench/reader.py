"""The training node's cost of reading ETL'd shards: ``python -m bench.reader`` (``--smoke`` for CI).

On one core (``num_workers=0``), the same ETL'd shards on local disk (the service's own output,
imagenet-val preset, uint8 and float32), side by side in rounds: each round runs every reader once
per dtype, in turn, so ratios compare figures taken under the same load; each run in a fresh process
(``client_side.read_in_process``: the heap a reader inherits decides which batches page-fault).
Readers (``client_side``): the minimal one-copy reader (the floor), ``make_loader`` without and with
a 1000-sample shuffle buffer, the latter also in one DataLoader worker (``num_workers=1``: the
reading on a second core, each batch sent through shared memory; its CPU figure is the receiving
process's alone), ``web_loader`` (the webdataset way, shards read whole), plain webdataset. Then
the loader's memory (PSS of its process and workers) per shuffle buffer and worker count.

Outputs in ``--out`` (default ``bench/results/reader``): ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import client_side, data
from .stamp import git_state
from .stats import median

log = logging.getLogger("bench")

DTYPES = ("uint8", "float32")
FLOOR = "one-copy reader (floor)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.reader", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shards, one round: checks the harness, not speed")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "reader")
    parser.add_argument("--work", type=Path, help="folder for the shards (default: a temporary folder)")
    parser.add_argument("--shards", type=int, help="shards (default 8; smoke 2)")
    parser.add_argument("--samples", type=int, help="samples per shard (default 256; smoke 8)")
    parser.add_argument("--passes", type=int, help="times each reader reads the shard list in one epoch "
                        "(default 4; smoke 1): a 1000-sample shuffle buffer fills and drains once per epoch, so an "
                        "epoch needs several times its samples for the steady state to count")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, help="rounds (default 5; smoke 1)")
    parser.add_argument("--memory", default=None, help="loader memory cases, shuffle_buffer:workers,... "
                        "(default 0:0,1000:0,1000:2; smoke 0:0,4:1); '' for none")
    args = parser.parse_args(argv)
    defaults = {"shards": (2, 8), "samples": (8, 256), "passes": (1, 4), "rounds": (1, 5),
                "memory": ("0:0,4:1", "0:0,1000:0,1000:2")}
    for name, (smoke, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    args.memory = [tuple(int(v) for v in case.split(":")) for case in args.memory.split(",") if case]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("transformer").setLevel(logging.WARNING)
    started, git = time.time(), git_state()["git"]
    with tempfile.TemporaryDirectory(prefix="wds-reader-") as temporary:
        work = args.work or Path(temporary)
        results = run(args, work)
    results["meta"] = {"command": "python -m bench.reader " + shlex.join(argv if argv is not None else sys.argv[1:]),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), "git": git,
                       "duration_s": round(time.time() - started, 1), "load_average_end": os.getloadavg(),
                       "cpus": os.cpu_count(), "shards": args.shards, "samples_per_shard": args.samples,
                       "passes": args.passes,
                       "batch_size": args.batch_size, "rounds": args.rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(markdown(results))
    log.info("wrote %s/results.{json,md} in %.0f s", args.out, time.time() - started)
    return 0


def run(args: argparse.Namespace, work: Path) -> dict:
    log.info("shards: %d x %d demo samples, transformed by the service (imagenet-val) to uint8 and float32",
             args.shards, args.samples)
    sources = [shard.path for shard in data.demo_shards(work, args.shards, args.samples)]
    shards = {dtype: args.passes * client_side.etl_shards(work / f"etl-{dtype}", sources, "imagenet-val", dtype)
              for dtype in DTYPES}
    expected = args.passes * args.shards * args.samples
    cases = client_side.reader_cases(args.batch_size)
    results: dict = {"reads": [], "memory": [],
                     "shard_bytes": {dtype: sum(p.stat().st_size for p in set(paths))
                                     for dtype, paths in shards.items()}}
    for dtype in DTYPES:  # a first pass, not measured: the page cache holds every shard from here on
        client_side.read_all(cases[FLOOR], shards[dtype], expected)
    for round_index in range(args.rounds):
        for dtype in DTYPES:
            for name in cases:
                row = client_side.read_in_process(name, shards[dtype], expected, args.batch_size)
                results["reads"].append({"round": round_index, "dtype": dtype, "reader": name, **row})
            log.info("round %d, %s: %s", round_index + 1, dtype, ", ".join(
                f"{r['reader'].split(' (')[0]} {r['samples_per_s']:.0f}" for r in results["reads"]
                if r["round"] == round_index and r["dtype"] == dtype))
    log.info("mixing: make_loader's open batches against a buffer that picks samples at random")
    results["mixing"] = mixing(args.batch_size)
    for shuffle_buffer, workers in args.memory:
        log.info("memory: make_loader float32, shuffle_buffer=%d, num_workers=%d", shuffle_buffer, workers)
        row = client_side.loader_memory(shards["float32"], args.batch_size, shuffle_buffer, workers)
        results["memory"].append({"dtype": "float32", "array_bytes": 3 * 224 * 224 * 4, **row})
    return results


def mixing(batch_size: int, samples: int = 40_000, shard: int = 256) -> list[dict]:
    """How well each shuffle mixes in-order shards of ``shard`` samples, per batch (the first and last
    ten left out): distinct shards, the largest share of one shard, and how often two samples that
    follow each other in the stream land in one batch. ``make_loader`` (open batches filled at once,
    its ``Batcher``) against a buffer that picks samples at random (``SampleStream``'s, as
    webdataset's ``shuffle``), by the samples each holds at most."""
    from transformer.client.batching import Batcher
    from transformer.client.stream import SampleStream, StreamSpec, generator_key

    class Shards:  # in-order shards of labelled samples, as SampleStream reads them
        def read(self, url: str, start: int = 0, anchor: str | None = None):
            first = int(url) * shard
            return enumerate({"__key__": str(n), "cls": n} for n in range(first + start, first + shard))

    urls = tuple(str(n) for n in range(samples // shard))

    def picked(buffer: int) -> list[int]:
        spec = StreamSpec(urls, tuple(range(len(urls))), b"", generator_key("mixing"), buffer, ("cls",))
        return [label for (label,) in SampleStream(spec, Shards(), lambda exc: False).tuples()]

    def scattered(count: int) -> list[int]:
        batcher, order = Batcher(batch_size, ("cls",), "partial", count, generator_key("mixing")), []
        for label in range(len(urls) * shard):
            batch = batcher.add((label,), None)
            order += [] if batch is None else batch[0].tolist()
        return order + [label for batch in batcher.drain() for label in batch[0].tolist()]

    rows = []
    cases = [(f"make_loader, shuffle_buffer={n}", -(-n // batch_size) * batch_size,
              lambda n=n: scattered(-(-n // batch_size))) for n in (1000, 2000)]
    cases += [(f"picking buffer of {n}", n, lambda n=n: picked(n)) for n in (500, 1000, 2000)]
    for name, held, order_of in cases:
        order = order_of()
        position = {label: index for index, label in enumerate(order)}
        batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)][10:-10]
        rows.append({"shuffle": name, "held": held,
                     "shards_per_batch": sum(len({n // shard for n in b}) for b in batches) / len(batches),
                     "largest_share": sum(max(Counter(n // shard for n in b).values()) for b in batches)
                     / len(batches) / batch_size,
                     "neighbours_together": sum(position[n] // batch_size == position[n + 1] // batch_size
                                                for n in range(len(order) - 1)) / (len(order) - 1)})
    return rows


def summary(results: dict) -> list[dict]:
    """Per dtype and reader: median samples/s over rounds, its range, and the ratio to the floor of the
    same round (median and range)."""
    rows = []
    reads = results["reads"]
    for dtype in DTYPES:
        floors = {r["round"]: r for r in reads if r["dtype"] == dtype and r["reader"] == FLOOR}
        for reader in dict.fromkeys(r["reader"] for r in reads):
            mine = [r for r in reads if r["dtype"] == dtype and r["reader"] == reader]
            if not mine:
                continue
            rates = [r["samples_per_s"] for r in mine]
            ratios = [r["samples_per_s"] / floors[r["round"]]["samples_per_s"] for r in mine if r["round"] in floors]
            steady_ratios = [r["steady_samples_per_s"] / floors[r["round"]]["steady_samples_per_s"] for r in mine
                             if r["round"] in floors]
            rows.append({"dtype": dtype, "reader": reader, "samples_per_s": median(rates), "min": min(rates),
                         "max": max(rates), "ratio": median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "cpu_ms_per_sample": median(
                             [r["cpu_s"] / r["samples"] * 1e3 for r in mine]),
                         "steady_samples_per_s": median([r["steady_samples_per_s"] for r in mine]),
                         "steady_ratio": median(steady_ratios), "steady_ratio_min": min(steady_ratios),
                         "steady_ratio_max": max(steady_ratios)})
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# Reading ETL'd shards on one core (and in one DataLoader worker)", "",
        f"`{meta['command']}` at commit {meta.get('git', 'unknown')}, {meta['started']}, {meta['duration_s']:.0f} s; "
        f"{meta['shards']} shards x {meta['samples_per_shard']} samples (3x224x224), read {meta['passes']} times "
        "per epoch, batches of "
        f"{meta['batch_size']}, {meta['rounds']} "
        f"round(s); {meta['cpus']} CPUs, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in meta['load_average_end'])}.",
        "",
        "Whole epoch, and its middle (a fifth of its batches to four fifths: after a shuffle's batches",
        "first filled, touching their memory for the first time, and before they drain):",
        "",
        "| dtype | reader | samples/s (median) | min - max over rounds | of the floor, same round (median) | "
        "min - max | CPU ms/sample | middle: samples/s | of the floor | min - max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary(results):
        lines.append(f"| {row['dtype']} | {row['reader']} | {row['samples_per_s']:,.0f} | {row['min']:,.0f} - "
                     f"{row['max']:,.0f} | {row['ratio']:.2f}x | {row['ratio_min']:.2f} - {row['ratio_max']:.2f} | "
                     f"{row['cpu_ms_per_sample']:.3f} | {row['steady_samples_per_s']:,.0f} | "
                     f"{row['steady_ratio']:.2f}x | {row['steady_ratio_min']:.2f} - {row['steady_ratio_max']:.2f} |")
    if results.get("mixing"):
        lines += ["", f"| shuffle (in-order shards of 256 samples, batches of {meta['batch_size']}) | samples held "
                  "| shards per batch | largest share of one shard | neighbours in one batch |",
                  "|---|---|---|---|---|"]
        for row in results["mixing"]:
            lines.append(f"| {row['shuffle']} | {row['held']} | {row['shards_per_batch']:.1f} | "
                         f"{row['largest_share']:.2f} | {row['neighbours_together']:.3f} |")
    if results["memory"]:
        lines += ["", "| make_loader, float32 | samples | PSS before the epoch | PSS peak | growth |",
                  "|---|---|---|---|---|"]
        for row in results["memory"]:
            lines.append(f"| shuffle_buffer={row['shuffle_buffer']}, num_workers={row['workers']} | "
                         f"{row['samples']} | {row['pss_before'] / 2**20:,.0f} MiB | "
                         f"{row['pss_peak'] / 2**20:,.0f} MiB | "
                         f"{(row['pss_peak'] - row['pss_before']) / 2**20:,.0f} MiB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
