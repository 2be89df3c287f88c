"""The cost AIS adds: the same shards through a real AIS target (inline hpush, inline ws, an offline copy)
beside the same pods driven directly, side by side in one run.

The cluster is the tests' real AIS with ETL (``testbed/etl_cluster.py``: a proxy and two targets in
Kubernetes mode, each ETL pod a local ``wds-transform serve``, all in a network namespace of this
process; needs root or an unprivileged user namespace, and Go for the first aisnode build). Cases, in
an order rotated every round:

* ``direct``: each shard sent to the pod on the target that stores it, as that target does it (hpush
  ``PUT`` with ``etl_fqn``), no AIS in the path: the pod's own cost;
* ``inline-hpush`` / ``inline-ws``: a reader GETs each shard through the proxy with ``etl_name``
  (redirected to the target, which asks its pod and relays the body);
* ``offline``: one bucket-to-bucket job (``etl-bck``) writing every shard to another bucket.

Each case reads every shard with two concurrent readers and reports images/s and CPU per image: the
CPU seconds of the pods, of aisnode (proxy and targets), and of the reader, over the images. Each ETL's
``register`` (``ais etl init`` until every pod is Running and ready) is timed too.

``--pods both`` runs every case twice in each round, once with ETL pods as local processes and once as
podman containers of the image ``make image`` built (root, podman; ``testbed/pods.py``), side by side.

    python -m bench.through_ais [--shards 8] [--samples 64] [--rounds 3] [--pods process|container|both]
                                [--out bench/results/through-ais]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import requests

from bench.report import save_run
from bench.stamp import stamp
from testbed.shardgen import imagenet_like_members, make_tar

CASES = ("direct", "inline-hpush", "inline-ws", "offline")
ARGS = {"preset": "imagenet-train", "dtype": "float32", "seed": 5}


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fqn(mountpath: Path, bucket: str, name: str) -> str:
    return str(mountpath / "@ais" / bucket / "%ob" / name)


def measure(cluster, client, *, shards: int = 8, samples: int = 64, rounds: int = 3, progress=print,
            images: dict[str, str] | None = None) -> dict:
    """Run every case ``rounds`` times on ``shards`` shards of ``samples`` ImageNet-sized JPEGs.

    ``images`` maps a label for each kind of pod to the image its ETLs name (default: the cluster's own pods).
    """
    from aistore.sdk.etl import ETLConfig

    from testbed.etl_cluster import settings
    from transformer.client import register, transform_bucket, unregister

    names = [f"bench-{i:04d}.tar" for i in range(shards)]
    bucket = client.bucket("bench-src")
    bucket.create(exist_ok=True)
    for index, name in enumerate(names):
        members = [(f"s{index}-{member}", data) for member, data in imagenet_like_members(samples, extra=False)]
        bucket.object(name).get_writer().put_content(make_tar(members))
    images = images or {cluster.kube.runtime.kind: settings().image}
    kwargs = {"preset": ARGS["preset"], "dtype": ARGS["dtype"], "seed": ARGS["seed"], "workers": None,
              "obj_timeout": "300s"}
    kinds = {}
    for label, image in images.items():
        etls = {comm: f"bench-{comm}-{label[0]}" for comm in ("hpush", "ws")}
        init = {}
        for comm, etl in etls.items():
            started = time.perf_counter()
            register(client, etl, settings(comm, **kwargs, image=image))
            init[comm] = time.perf_counter() - started
        progress(f"{label} pods: registered in {', '.join(f'{c} {s:.1f} s' for c, s in init.items())}")
        kinds[label] = {"etls": etls, "init_seconds": init}
    args = json.dumps(ARGS, separators=(",", ":"))
    owners = {}
    for name in names:
        owners[name] = next(i for i, mp in enumerate(cluster.mountpaths) if Path(_fqn(mp, "bench-src", name)).is_file())
    pods = {etl: {cluster.target_of(pod): pod for pod in cluster.kube.pods_of(etl)} for kind in kinds.values()
            for etl in kind["etls"].values()}  # ETL -> target index -> its pod

    def drain(response: requests.Response) -> int:  # every case reads its bytes the same way
        response.raise_for_status()
        return sum(len(chunk) for chunk in response.iter_content(1 << 20))

    def direct(etl: str):
        def read(name: str) -> int:
            owner = owners[name]
            pod = pods[etl][owner]
            fqn = quote(quote(_fqn(cluster.pod_mountpaths[owner], "bench-src", name), safe=""), safe="")
            url = f"http://{pod.host}:{pod.port}/bench-src/{name}?etl_fqn={fqn}&etl_args={quote(args, safe='')}"
            with requests.put(url, data=b"", stream=True, timeout=300) as response:
                return drain(response)
        return read

    def inline(etl: str):
        urls = {name: bucket.object(name).get_url(etl=ETLConfig(etl, args=args)) for name in names}

        def read(name: str) -> int:
            with requests.get(urls[name], stream=True, timeout=300) as response:  # redirected to the target
                return drain(response)
        return read

    readers = {(label, case): reader for label, kind in kinds.items() for case, reader in (
        ("direct", direct(kind["etls"]["hpush"])), ("inline-hpush", inline(kind["etls"]["hpush"])),
        ("inline-ws", inline(kind["etls"]["ws"])))}
    processes = [pod.pid for group in pods.values() for pod in group.values()]
    ais = [node.process.pid for node in cluster.nodes()]
    steps = [(label, case) for case in CASES for label in kinds]
    rows = []
    try:
        for round_ in range(rounds):
            order = steps[round_ % len(steps):] + steps[:round_ % len(steps)]
            for label, case in order:
                before_pods = sum(cpu_seconds(pid) for pid in processes)
                before_ais = sum(cpu_seconds(pid) for pid in ais)
                before_self = time.process_time()
                started = time.perf_counter()
                if case == "offline":
                    destination = f"bench-dst-{label[0]}{round_}"
                    job = transform_bucket(client, kinds[label]["etls"]["hpush"], "bench-src", destination,
                                           timeout=1800, options={k: ARGS[k] for k in ("preset", "dtype", "seed")})
                    assert job.success and not job.object_errors, job
                    out = sum(len(client.bucket(destination).object(n).get_reader().read_all()) for n in [names[0]])
                else:
                    with ThreadPoolExecutor(2) as pool:
                        out = sum(pool.map(readers[label, case], names))
                seconds = time.perf_counter() - started
                count = shards * samples
                row = {"case": case, "pods": label, "round": round_, "seconds": seconds,
                       "images_per_s": count / seconds,
                       "pod_cpu_ms_per_image": 1000 * (sum(cpu_seconds(p) for p in processes) - before_pods) / count,
                       "ais_cpu_ms_per_image": 1000 * (sum(cpu_seconds(p) for p in ais) - before_ais) / count,
                       "reader_cpu_ms_per_image": 1000 * (time.process_time() - before_self) / count,
                       "bytes_out_first": out}
                progress(f"round {round_ + 1}/{rounds} {label:9s} {case:13s} {row['images_per_s']:7.1f} images/s, "
                         f"pod {row['pod_cpu_ms_per_image']:.2f} + AIS {row['ais_cpu_ms_per_image']:.2f} + "
                         f"reader {row['reader_cpu_ms_per_image']:.2f} CPU ms/image")
                rows.append(row)
    finally:
        for kind in kinds.values():
            for etl in kind["etls"].values():
                unregister(client, etl)
    return {"shards": shards, "samples": samples, "rounds": rounds, "etl_args": ARGS, "rows": rows,
            "init_seconds": {label: kind["init_seconds"] for label, kind in kinds.items()},
            "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """Per case (``case`` alone with one kind of pod; ``<pods> <case>`` with several): the median and range."""
    out = {}
    labels = list(dict.fromkeys(r.get("pods", "") for r in rows))
    for label, case in [(label, case) for label in labels for case in CASES]:
        mine = [r for r in rows if r["case"] == case and r.get("pods", "") == label]
        if not mine:
            continue
        rates = [r["images_per_s"] for r in mine]
        out[case if len(labels) == 1 else f"{label} {case}"] = {
            "pods": label, "case": case,
            "images_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "pod_cpu_ms_per_image": statistics.median(r["pod_cpu_ms_per_image"] for r in mine),
            "ais_cpu_ms_per_image": statistics.median(r["ais_cpu_ms_per_image"] for r in mine),
            "reader_cpu_ms_per_image": statistics.median(r["reader_cpu_ms_per_image"] for r in mine),
        }
    return out


def markdown(result: dict) -> str:
    lines = [f"{result['shards']} shards x {result['samples']} images (500x375 JPEG), etl_args "
             f"`{json.dumps(result['etl_args'])}`, {result['rounds']} rounds, median (min-max):", "",
             "| case | images/s | vs direct | pod CPU ms/image | AIS CPU ms/image | reader CPU ms/image |",
             "|---|---|---|---|---|---|"]
    for case, row in result["summary"].items():
        direct = next((r["images_per_s"] for r in result["summary"].values()
                       if r["case"] == "direct" and r["pods"] == row["pods"]), None)
        ratio = f"{row['images_per_s'] / direct:.2f}x" if direct else "-"
        lines.append(f"| {case} | {row['images_per_s']:.0f} ({row['min']:.0f}-{row['max']:.0f}) | {ratio} | "
                     f"{row['pod_cpu_ms_per_image']:.2f} | {row['ais_cpu_ms_per_image']:.2f} | "
                     f"{row['reader_cpu_ms_per_image']:.2f} |")
    inits = result.get("init_seconds", {})
    if inits:
        lines += ["", "`register` (ais etl init until every pod is ready), seconds: " + "; ".join(
            f"{label} pods: " + ", ".join(f"{comm} {seconds:.1f}" for comm, seconds in init.items())
            for label, init in inits.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pods", choices=("process", "container", "both"), default="process",
                        help="ETL pods as local processes, as containers of the built image, or both side by side")
    parser.add_argument("--out", type=Path, default=Path("bench/results/through-ais"))
    options = parser.parse_args()
    from testbed.cluster import install_aisnode
    from testbed.etl_cluster import IMAGE, NODES, pod_runtime, start_etl_cluster
    from testbed.netns import enter_network_namespace

    kinds = ("process", "container") if options.pods == "both" else (options.pods,)
    runtimes = {kind: pod_runtime(kind) for kind in kinds}
    # Both kinds in one cluster: the container pods' ETLs name an image of their own.
    images = {kind: IMAGE if kind == kinds[0] else f"{IMAGE.split(':')[0]}:{kind}" for kind in kinds}

    binary = install_aisnode(log=lambda message: print(message, file=sys.stderr))
    started = stamp()
    namespace = enter_network_namespace(list(NODES.values()))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ais-") as root, \
                start_etl_cluster(binary, Path(root) / "cluster", runtime=runtimes[kinds[0]],
                                  runtimes={images[k]: runtimes[k] for k in kinds[1:]}) as cluster:
            result = measure(cluster, cluster.client(), shards=options.shards, samples=options.samples,
                             rounds=options.rounds, progress=lambda line: print(line, flush=True), images=images)
    finally:
        namespace.leave()
    return save_run(options.out, result, "Through AIS, side by side",
                    f"python -m bench.through_ais --shards {options.shards} --samples {options.samples} "
                    f"--rounds {options.rounds} --pods {options.pods}", markdown(result), started)


if __name__ == "__main__":
    sys.exit(main())
