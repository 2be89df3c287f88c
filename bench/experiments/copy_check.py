"""What proving an offline copy whole costs: the client's check (``transformer.client.whole_copy.check_copy``)
on a bucket of small ETL'd shards through a real AIS, beside the listing alone (its floor) and beside
reading every object whole through the strict reader (the check a tail read replaces), in one run.

The cluster is the tests' real AIS with ETL (``testbed/etl_cluster.py``: a proxy and two targets, each
ETL pod a local ``wds-transform serve``, in a network namespace of this process). The copy is made once
by ``transform_bucket`` from ``--objects`` one-sample shards; every round then runs each case, in an
order rotated every round:

* ``list``: one listing of the copy (names and sizes, its pages), nothing read;
* ``check``: ``check_copy``: that listing, then the last 2 KiB of each object by range GET, 16 at a time;
* ``read-whole``: every object read whole and through ``shard_samples`` (end marker, member count), 16 at
  a time.

    python -m bench.experiments.copy_check [--objects 300] [--rounds 3] [--out bench/results/copy-check]

Decided: ``transform_bucket`` proves a copy whole by a 2 KiB tail read per object, not by reading it whole
(``bench/results/copy-check/``, docs/offline.md "The copy, proven whole").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import save_run
from bench.stamp import stamp
from testbed.shardgen import jpeg_bytes, make_tar

CASES = ("list", "check", "read-whole")
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what testbed.etl_cluster.settings() registers


def measure(client, etl: str, *, objects: int = 300, rounds: int = 3,
            progress: Callable[[str], None] = print) -> dict:
    """Copy ``objects`` one-sample shards with the hpush ETL ``etl`` (registered with ``OPTIONS``), then time
    each case ``rounds`` times on the copy."""
    import io

    from transformer.client import transform_bucket
    from transformer.client.reading import shard_samples
    from transformer.client.whole_copy import TAIL_READERS, check_copy
    from transformer.integrity import TAIL_BYTES

    names = [f"cc-{i:05d}.tar" for i in range(objects)]
    source, copy = client.bucket("copy-check-src"), "copy-check-dst"
    source.create(exist_ok=True)
    for index, name in enumerate(names):
        source.object(name).get_writer().put_content(make_tar([("s-000.jpg", jpeg_bytes(index, (64, 48))),
                                                               ("s-000.cls", b"%d" % index)]))
    started = time.perf_counter()
    job = transform_bucket(client, etl, "copy-check-src", copy, options=OPTIONS, timeout=1800)
    progress(f"copied {job.verified} objects in {time.perf_counter() - started:.1f} s (the check included)")
    sizes = {entry.name: entry.size for entry in client.bucket(copy).list_all_objects(props="name,size")}
    assert sorted(sizes) == names, "the copy is not whole"

    def listing() -> tuple[int, int]:
        return len(list(client.bucket(copy).list_objects_iter(props="name,size"))), 0

    def check() -> tuple[int, int]:
        found = check_copy(client, copy, {name: name for name in names}, set())
        assert found.whole == objects, found
        return found.tail_reads, found.tail_reads * TAIL_BYTES

    def read_whole() -> tuple[int, int]:
        def one(name: str) -> int:
            data = client.bucket(copy).object(name).get_reader().read_all()
            for _ in shard_samples(io.BytesIO(data), name):
                pass
            return len(data)

        with ThreadPoolExecutor(TAIL_READERS) as pool:
            return objects, sum(pool.map(one, names))

    cases = {"list": listing, "check": check, "read-whole": read_whole}
    rows = []
    for round_ in range(rounds):
        for case in CASES[round_ % len(CASES):] + CASES[:round_ % len(CASES)]:
            started = time.perf_counter()
            reads, read_bytes = cases[case]()
            seconds = time.perf_counter() - started
            rows.append({"case": case, "round": round_, "seconds": seconds, "ms_per_object": 1000 * seconds / objects,
                         "object_reads": reads, "bytes_read": read_bytes})
            progress(f"round {round_ + 1}/{rounds} {case:10s} {seconds:6.2f} s, {rows[-1]['ms_per_object']:.2f} ms per "
                     f"object, {read_bytes / 1e6:.1f} MB read")
    return {"objects": objects, "rounds": rounds, "object_bytes": statistics.median(sizes.values()), "rows": rows,
            "summary": summarize(rows), "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for case in CASES:
        mine = [row for row in rows if row["case"] == case]
        if mine:
            seconds = [row["seconds"] for row in mine]
            out[case] = {"seconds": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
                         "ms_per_object": statistics.median(row["ms_per_object"] for row in mine),
                         "bytes_read": mine[0]["bytes_read"]}
    return out


def markdown(result: dict) -> str:
    lines = [f"{result['objects']} objects of {result['object_bytes'] / 1e3:.0f} KB (one 224x224 uint8 sample each), "
             f"{result['rounds']} rounds, median (min-max); {result['cpus']} CPUs, load average "
             f"{result['load_average']:.1f} at the end:", "",
             "| case | seconds | ms per object | bytes read |", "|---|---|---|---|"]
    for case, row in result["summary"].items():
        lines.append(f"| {case} | {row['seconds']:.2f} ({row['min']:.2f}-{row['max']:.2f}) | "
                     f"{row['ms_per_object']:.2f} | {row['bytes_read'] / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/copy-check"))
    options = parser.parse_args()
    from testbed.etl_cluster import cluster_with_etl, settings

    started = stamp()
    with cluster_with_etl("bench-copy-check", settings("hpush")) as (_, client):
        result = measure(client, "bench-copy-check", objects=options.objects, rounds=options.rounds,
                         progress=lambda line: print(line, flush=True))
    return save_run(options.out, result, "The offline copy check, side by side",
                    f"python -m bench.experiments.copy_check --objects {options.objects} --rounds {options.rounds}",
                    markdown(result), started)


if __name__ == "__main__":
    sys.exit(main())
