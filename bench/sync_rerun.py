"""What ``wds-transform sync`` costs on a real AIS when nothing (or one shard) changed: requests, bytes read, time.

The cluster is the tests' real AIS with ETL (``testbed/etl_cluster.py``: a proxy and two targets, each
ETL pod a local ``wds-transform serve``, in a network namespace of this process). ``--shards``
one-sample shards (a small JPEG each) are put into a source bucket and copied once through the ETL by
an incremental transform (everything is new: one bucket-to-bucket job). Then, ``--rounds`` times each,
in turn:

* ``rerun``: the same incremental transform again, nothing changed;
* ``one-changed``: one source shard rewritten, then the incremental transform.

For each run it reports the seconds, the client's HTTP requests (every request the SDK sent, each
hop of a redirect counted), and what the targets served: object GETs and their bytes, listing
requests, PUTs, and shards the ETL's pods transformed, from the targets' ``/metrics`` and the pods'
``/metrics`` before and after. The target of the issue this answers: a re-run with nothing changed
reads no object bytes beyond the listings and at most one small object, 10,000 shards in under 10 s.

    python -m bench.sync_rerun [--shards 10000] [--rounds 2] [--out bench/results/sync-rerun]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import save_run
from bench.stamp import cpu_name, stamp

CASES = ("rerun", "one-changed")
ETL = "bench-sync-rerun"
SOURCE, DESTINATION = "sync-rerun-src", "sync-rerun-dst"
TRANSFORMS = [{"Resize": {"size": [16, 16]}}]  # a small output: the bench is about the sync, not the transform
OPTIONS = {"transforms": TRANSFORMS, "dtype": "uint8", "seed": 7}
_TARGET_METRICS = {"get_count": "ais_target_get_count", "get_bytes": "ais_target_get_bytes",
                   "list_count": "ais_target_lst_count", "put_count": "ais_target_put_count"}


class RequestCounter:
    """Counts every HTTP request the process sends through ``requests`` (the aistore SDK's transport)."""

    def __init__(self) -> None:
        import requests

        self.count = 0
        self._lock = threading.Lock()
        self._send = requests.Session.send
        counter = self

        def send(session, request, **kwargs):
            with counter._lock:
                counter.count += 1
            return counter._send(session, request, **kwargs)

        requests.Session.send = send

    def close(self) -> None:
        import requests

        requests.Session.send = self._send


def target_counters(cluster) -> dict[str, float]:
    """The targets' counters summed (every bucket, every target): object GETs and bytes, listings, PUTs."""
    import httpx

    totals = dict.fromkeys(_TARGET_METRICS, 0.0)
    for target in cluster.targets:
        text = httpx.get(target.url + "/metrics", timeout=10).text
        for key, metric in _TARGET_METRICS.items():
            totals[key] += sum(float(value) for value in re.findall(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return totals


def pod_transforms(cluster, etl: str) -> float:
    """Shards the ETL's pods have delivered whole so far (their ``etl_delivered_total``)."""
    import httpx

    total = 0.0
    for pod in cluster.kube.pods_of(etl):
        text = httpx.get(f"http://{pod.host}:{pod.port}/metrics", timeout=10).text
        total += sum(float(value) for value in re.findall(r'^etl_delivered_total\{[^}]*\} (\S+)$', text, re.M))
    return total


def put_sources(client, names: list[str]) -> None:
    from testbed.shardgen import jpeg_bytes, make_tar

    bucket = client.bucket(SOURCE)
    bucket.create(exist_ok=True)
    image = jpeg_bytes(0, (32, 24))

    def put(index_name: tuple[int, str]) -> None:
        index, name = index_name
        bucket.object(name).get_writer().put_content(make_tar([("s-000.jpg", image), ("s-000.cls", b"%d" % index)]))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, enumerate(names)))


def measure(cluster, client, *, shards: int = 10000, rounds: int = 2,
            progress: Callable[[str], None] = print) -> dict:
    """Copy ``shards`` one-sample shards once through the ETL ``ETL`` (registered with ``OPTIONS``), then run each
    case ``rounds`` times, rotating their order, and measure each run."""
    from transformer.client import transform_bucket

    names = [f"shard-{i:06d}.tar" for i in range(shards)]
    started = time.perf_counter()
    put_sources(client, names)
    progress(f"put {shards} source shards in {time.perf_counter() - started:.1f} s")
    counter = RequestCounter()
    try:
        def sync(case: str, round_: int) -> dict:
            before, pods_before, requests_before = target_counters(cluster), pod_transforms(cluster, ETL), counter.count
            started = time.perf_counter()
            job = transform_bucket(client, ETL, SOURCE, DESTINATION, options=OPTIONS, incremental=True, timeout=3600)
            seconds = time.perf_counter() - started
            after = target_counters(cluster)
            changes = job.changes
            return {"case": case, "round": round_, "seconds": seconds, "requests": counter.count - requests_before,
                    **{key: after[key] - before[key] for key in _TARGET_METRICS},
                    "pod_transforms": pod_transforms(cluster, ETL) - pods_before, "stale": len(changes.stale),
                    "up_to_date": changes.counts["up_to_date"], "tail_reads": changes.tail_reads,
                    "ledger_hits": changes.ledger_hits, "probe": changes.probe, "job": job.kind if job.job_id else ""}

        first = sync("first", 0)
        assert first["stale"] == shards and first["job"] == "etl-bck", first
        progress(f"first copy: {shards} new in {first['seconds']:.1f} s (a bucket-to-bucket job)")
        rows = []
        for round_ in range(rounds):
            for case in CASES[round_ % len(CASES):] + CASES[:round_ % len(CASES)]:
                if case == "one-changed":
                    from testbed.shardgen import jpeg_bytes, make_tar

                    changed = names[(round_ * 7919) % shards]
                    client.bucket(SOURCE).object(changed).get_writer().put_content(
                        make_tar([("s-000.jpg", jpeg_bytes(1 + round_, (32, 24))), ("s-000.cls", b"changed")]))
                row = sync(case, round_)
                expected = 1 if case == "one-changed" else 0
                assert row["stale"] == expected and row["up_to_date"] == shards - expected, row
                rows.append(row)
                progress(f"round {round_ + 1}/{rounds} {case:11s} {row['seconds']:6.2f} s, {row['requests']} requests, "
                         f"{row['get_count']:.0f} GETs ({row['get_bytes'] / 1e3:.1f} kB), {row['list_count']:.0f} "
                         f"listings, {row['put_count']:.0f} PUTs, {row['pod_transforms']:.0f} transformed")
    finally:
        counter.close()
    ledger = [entry for entry in client.bucket(DESTINATION).list_all_objects(prefix="__etl__/sync/",
                                                                            props="name,size")]
    return {"shards": shards, "rounds": rounds, "first": first, "rows": rows, "summary": summarize(rows),
            "ledger_bytes": sum(entry.size for entry in ledger),
            "shard_bytes": {"source": len(client.bucket(SOURCE).object(names[1]).get_reader().read_all()),
                            "copy": client.bucket(DESTINATION).object(names[1]).head().size},
            "cpus": os.cpu_count(), "load_average": os.getloadavg()}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for case in CASES:
        mine = [row for row in rows if row["case"] == case]
        if mine:
            out[case] = {"seconds": statistics.median(row["seconds"] for row in mine),
                         "min": min(row["seconds"] for row in mine), "max": max(row["seconds"] for row in mine),
                         **{key: statistics.median(row[key] for row in mine)
                            for key in ("requests", "get_count", "get_bytes", "list_count", "put_count",
                                        "pod_transforms", "tail_reads")}}
    return out


def markdown(result: dict, header: str) -> str:
    shards = result["shards"]
    first = result["first"]
    lines = [header, "",
             f"{shards:,} one-sample shards ({result['shard_bytes']['source'] / 1e3:.1f} kB each, copies of "
             f"{result['shard_bytes']['copy'] / 1e3:.1f} kB), {result['rounds']} rounds, median (min-max); the copy "
             f"ledger: {result['ledger_bytes'] / 1e3:.0f} kB. First copy (all new, one bucket-to-bucket job): "
             f"{first['seconds']:.1f} s, {first['requests']} requests.", "",
             "| case | seconds | client requests | object GETs | bytes of objects read | listing requests | "
             "PUTs | shards transformed | tail reads |", "|---|---|---|---|---|---|---|---|---|"]
    for case, row in result["summary"].items():
        lines.append(f"| {case} | {row['seconds']:.2f} ({row['min']:.2f}-{row['max']:.2f}) | {row['requests']:.0f} "
                     f"| {row['get_count']:.0f} | {row['get_bytes']:,.0f} | {row['list_count']:.0f} | "
                     f"{row['put_count']:.0f} | {row['pod_transforms']:.0f} | {row['tail_reads']:.0f} |")
    lines += ["", "Every run:", "", "| case | round | seconds | requests | GETs | bytes read | listings | PUTs |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['case']} | {row['round']} | {row['seconds']:.2f} | {row['requests']} | "
                     f"{row['get_count']:.0f} | {row['get_bytes']:,.0f} | {row['list_count']:.0f} | "
                     f"{row['put_count']:.0f} |")
    lines += ["", "Object GETs and bytes are the targets' own counters (`ais_target_get_count`, "
              "`ais_target_get_bytes`), summed over both; listing requests count each target's answer to each "
              "page (`ais_target_lst_count`); client requests count every HTTP request the SDK sent, each hop of a "
              "redirect included."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sync-rerun"))
    options = parser.parse_args()
    from testbed.etl_cluster import cluster_with_etl, settings

    started = stamp()
    cpu = cpu_name()
    with cluster_with_etl(ETL, settings("hpush", transforms=TRANSFORMS)) as (cluster, client):
        result = measure(cluster, client, shards=options.shards, rounds=options.rounds,
                         progress=lambda line: print(line, flush=True))
    command = f"python -m bench.sync_rerun --shards {options.shards} --rounds {options.rounds}"
    header = (f"{cpu}, {os.cpu_count()} CPUs, shared with other jobs (load average "
              f"{', '.join(f'{x:.1f}' for x in result['load_average'])} at the end); AIS 5.0 (aisnode v1.5.0), a proxy "
              "and two targets on this machine, each ETL pod a local process.")
    result.update(**started, cpu=cpu, command=command)
    return save_run(options.out, result, "wds-transform sync: a re-run over up-to-date shards", command,
                    markdown(result, header), started)


if __name__ == "__main__":
    sys.exit(main())
