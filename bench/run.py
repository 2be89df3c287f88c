"""One command for the whole benchmark: ``python -m bench.run`` (``--smoke`` for the CI-sized run).

Everything is measured side by side in one run on the same shards, in rounds: each round measures the
compute limit, this service and the conventional peer once per preset, so that ratios compare figures
taken under the same load; tables report medians over rounds and percentiles over all shard requests.
The run is bounded by ``--budget`` seconds: what does not fit is recorded as skipped, never left hanging.

Outputs in ``--out`` (default ``bench-out/<date>-<time>-<commit>`` in the checkout, the run's start and the
checked-out commit; git ignores it): ``results.json`` (every raw figure), ``results.md`` (tables, targets,
machine, load average, versions, command) and ``results.png`` (plot). A run never goes into
``bench/results/headline/`` by default: the documents' figures come from there, and only
``python -m bench.headline`` (``make bench``) writes there, at the headline's size, then rewrites the sections
README.md and docs/ generate from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import client_side, compute, data, report, services, stamp
from .summary import MODES

log = logging.getLogger("bench")

PRESETS = ("imagenet-train", "imagenet-val")
HEADLINE_ROOT = Path(__file__).parent / "results" / "headline"
# Where a run goes without --out: outside bench/results/, which holds kept runs only.
SCRATCH = Path(__file__).resolve().parents[1] / "bench-out"


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shards, one round: checks the harness, not speed")
    parser.add_argument("--out", type=Path, help="results folder (default: bench-out/<date>-<time>-<commit>; with "
                        "--render, the kept headline run)")
    parser.add_argument("--work", type=Path, help="folder for shards and logs (default: a temporary folder)")
    parser.add_argument("--shards", type=int, help="demo shards (default 4; smoke 2)")
    parser.add_argument("--samples", type=int, help="samples per demo shard (default 1000; smoke 16)")
    parser.add_argument("--small-mb", type=int, help="size of the small shard of the memory comparison in MB "
                        "(default 25; smoke 1)")
    parser.add_argument("--big-mib", type=int, help="size of the large shard in MiB (default 1024; smoke 8)")
    parser.add_argument("--rounds", type=int, help="measurement rounds (default 3; smoke 1)")
    parser.add_argument("--concurrency", type=int, help="concurrent shards of the 'several' case (default 4)")
    parser.add_argument("--workers", type=int, help="threads of the service and of the compute limit, and the "
                        "peer's uvicorn workers (default: the CPUs this process may use)")
    parser.add_argument("--budget", type=float, help="wall-clock bound in seconds (default 1500; smoke 240)")
    parser.add_argument("--render", action="store_true", help="only re-render results.md and results.png from the "
                        "results.json in --out (no measurement)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets measured in every "
                        f"round (default {','.join(PRESETS)})")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out: "
                        "decoders,peer,ws,big,client")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"shards": 2 if smoke else 4, "samples": 16 if smoke else 1000, "big_mib": 8 if smoke else 1024,
                "small_mb": 1 if smoke else 25,
                "rounds": 1 if smoke else 3, "concurrency": 2 if smoke else 4, "budget": 240 if smoke else 1500}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.workers is None:
        from transformer.config import available_cpus

        args.workers = available_cpus()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    unknown = sorted(set(args.presets) - set(PRESETS))
    if unknown or not args.presets:
        parser.error(f"--presets: {', '.join(unknown) or 'none given'}; choose from {', '.join(PRESETS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s", datefmt="%H:%M:%S")
    if args.render:
        if args.out is None:
            args.out = report.newest_run(HEADLINE_ROOT)
        results = json.loads((args.out / "results.json").read_text())
        report.write_markdown(results, args.out / "results.md")
        report.write_plot(results, args.out / "results.png")
        return 0
    if not services.curl_available():
        log.error("curl is needed: it plays the AIS target (a C client that streams body and response at once)")
        return 2
    budget = Budget(args.budget)
    started = time.time()
    git = stamp.git_state()
    args.out = out_folder(args.out, started)
    load_start = [round(x, 2) for x in os.getloadavg()]
    temporary = None
    if args.work is None:
        temporary = tempfile.mkdtemp(prefix="wds-bench-")
        args.work = Path(temporary)
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    try:
        results = run(args, budget, logs)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    results["meta"] = report.metadata(argv if argv is not None else sys.argv[1:], args, started, git)
    results["meta"]["machine"]["load_average_start"] = load_start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report.write_markdown(results, args.out / "results.md")
    report.write_plot(results, args.out / "results.png")
    log.info("wrote %s/results.{json,md,png} in %.0f s", args.out, time.time() - started)
    return 0


def out_folder(out: Path | None, started: float) -> Path:
    """``--out``, else a folder named for the run's start and commit under bench-out/: never bench/results/, whose
    runs the documents cite (a smoke run there would become the next headline)."""
    return out if out is not None else SCRATCH / report.run_name(started)


def run(args: argparse.Namespace, budget: Budget, logs: Path) -> dict:
    from transformer.config import Settings

    settings = Settings.from_env({})  # defaults: the shell's ETL_* must not skew the compute limit
    results: dict = {"measurements": [], "skipped": [], "compute": [], "process_limit": [], "engine": [],
                     "single_thread": [], "decoders": [], "memory": [], "client": [], "uint8": [], "http_floor": [],
                     "http_limit": []}

    log.info("shards: %d demo shards x %d samples; %d MB and %d MiB shards from their samples", args.shards,
             args.samples, args.small_mb, args.big_mib)
    shards = data.demo_shards(args.work, args.shards, args.samples)
    small = big = None
    if "big" not in args.skip:
        small = data.sized_shard(args.work, shards, args.small_mb * 10**6, f"small-{args.small_mb}MB.tar")
        big = data.sized_shard(args.work, shards, args.big_mib << 20, f"big-{args.big_mib}MiB.tar")

    def describe(shard: data.Shard | None) -> dict | None:
        if shard is None:
            return None
        return {"name": shard.path.name, "bytes": shard.size, "samples": shard.samples, "images": shard.images}

    results["shards"] = {"demo": [describe(s) for s in shards], "small": describe(small), "big": describe(big)}
    samples = compute.load_samples(shards[0].path, settings)

    if "decoders" not in args.skip:
        log.info("decode options (single thread)")
        results["decoders"] = compute.decode_options(samples, images=10 if args.smoke else 100,
                                                     repeats=1 if args.smoke else 3)

    # ws gets server instances of its own: the peer holds each one-message reply whole in memory (this
    # service did too before it sent replies frame by frame), and the heap that leaves behind would
    # otherwise inflate the peak RSS of every HTTP case measured after it.
    servers: dict[str, services.Server] = {"service": services.start_service(logs, args.work, args.workers)}
    if "ws" not in args.skip:
        servers["service-ws"] = services.start_service(logs, args.work, args.workers, name="service-ws")
    if "peer" not in args.skip:
        servers["peer"] = services.start_peer(logs, args.workers)
        if "ws" not in args.skip:
            servers["peer-ws"] = services.start_peer(logs, args.workers, name="peer-ws")
    try:
        for server in servers.values():
            server.ready()
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    service = servers["service"]
    results["servers"] = {name: {"idle_rss": server.idle_rss} for name, server in servers.items()}
    try:
        for round_index in range(args.rounds):
            if round_index > 0 and budget.remaining() < _round_estimate(results):
                results["skipped"].append(f"rounds {round_index + 1}..{args.rounds}: time budget")
                break
            round_start = time.monotonic()
            measure_round(args, budget, results, round_index, samples, settings, shards, servers)
            results.setdefault("round_seconds", []).append(time.monotonic() - round_start)
            if round_index == 0:
                # Sections that must appear in every report run after the first round, before extra rounds.
                if big is not None:
                    measure_memory(args, budget, results, logs, small, big, None if not args.smoke else service)
                if "client" not in args.skip:
                    measure_client(args, budget, results, shards, service)
    finally:
        for server in servers.values():
            server.stop()
    return results


def _round_estimate(results: dict) -> float:
    seconds = results.get("round_seconds") or [0.0]
    return 1.2 * max(seconds)


def measure_round(args, budget: Budget, results: dict, round_index: int, samples, settings, shards,
                  servers: dict[str, services.Server]) -> None:
    paths = [s.path for s in shards]
    for preset in args.presets:
        log.info("round %d, %s: compute limit", round_index + 1, preset)
        limit = compute.compute_limit(samples, preset, "float32", args.workers, settings)
        results["compute"].append({"round": round_index, "preset": preset, **limit})
        log.info("round %d, %s: the same in processes (no GIL)", round_index + 1, preset)
        processes = compute.process_limit(samples, preset, "float32", args.workers, settings)
        results["process_limit"].append({"round": round_index, "preset": preset, **processes})
        if services.curl_available():
            log.info("round %d, %s: the same, each .npy sent to curl (no tar, no server)", round_index + 1, preset)
            sent = compute.http_limit(samples, preset, "float32", args.workers, settings)
            results["http_limit"].append({"round": round_index, "preset": preset, **sent})
        log.info("round %d, %s: engine without HTTP", round_index + 1, preset)
        engine = compute.engine_limit(shards[0].path, preset, "float32", args.workers, settings)
        results["engine"].append({"round": round_index, "preset": preset, **engine})
        single = compute.compute_limit(samples[: max(8, len(samples) // 5)], preset, "float32", 1, settings)
        # CPU time: on a shared machine a lone thread's wall time says more about the neighbours.
        results["single_thread"].append({"round": round_index, "preset": preset,
                                         "ms_per_image": single["cpu_ms_per_image"]})
        etl_args = json.dumps({"preset": preset})
        if preset == "imagenet-train" and services.curl_available():
            # What moving a float32 image over loopback HTTP costs at least (3 x 224 x 224 x 4 + npy header).
            floor = services.http_floor(3 * 224 * 224 * 4 + 128, 50 if args.smoke else 1000)
            results["http_floor"].append({"round": round_index, **floor})
        if preset == "imagenet-train" and budget.remaining() > 60:
            # The same with uint8 output (a quarter of the bytes): separates the cost of moving float32
            # arrays through tar, HTTP and the client from the rest of the service's overhead.
            limit8 = compute.compute_limit(samples, preset, "uint8", args.workers, settings)
            row8 = measure(budget, results, servers["service"], "service", preset, "hpush-fqn", 1,
                           paths[: max(1, len(paths) // 2)], shards, json.dumps({"preset": preset, "dtype": "uint8"}),
                           round_index, shard_label="demo-uint8")
            if row8 is not None:
                results["uint8"].append({"round": round_index, "compute_images_per_s": limit8["images_per_s"],
                                         "compute_cpu_ms_per_image": limit8["cpu_ms_per_image"],
                                         "service_images_per_s": row8["images_per_s"],
                                         "server_cpu_ms_per_image": row8["cpu_ms_per_image"],
                                         "client_cpu_ms_per_image": row8["client_cpu_ms_per_image"],
                                         "mb_out_per_s": row8["mb_out_per_s"]})
        for system in ("service", "peer"):
            if system not in servers:
                continue
            cases = [(mode, 1) for mode in MODES if not (mode == "ws" and "ws" in args.skip)]
            cases.append(("hpush-fqn", args.concurrency))
            for mode, concurrency in cases:
                server = servers[f"{system}-ws" if mode == "ws" else system]
                requests = paths if concurrency > 1 else paths[: max(1, len(paths) // 2)]
                if concurrency > 1 and len(requests) < concurrency:
                    requests = (requests * concurrency)[:concurrency]
                measure(budget, results, server, system, preset, mode, concurrency, requests, shards, etl_args,
                        round_index)


def measure(budget: Budget, results: dict, server: services.Server, system: str, preset: str, mode: str,
            concurrency: int, requests: list[Path], shards, etl_args: str, round_index: int,
            shard_label: str = "demo") -> dict | None:
    label = f"{system} {preset} {mode} x{concurrency} ({shard_label})"
    if budget.remaining() < 30:
        results["skipped"].append(f"{label}, round {round_index + 1}: time budget")
        return None
    timeout = max(30.0, budget.remaining() - 20)
    images = {s.path: s.images for s in shards}

    def call(path: Path) -> services.Result:
        if mode == "ws":
            return services.ws_request(server.url, path, etl_args, timeout)
        relative = f"{data.BUCKET}/{path.name}"
        return services.hpush(server.url, relative, path, mode.split("-")[1], etl_args, timeout)

    log.info("  %s: %d shard(s)", label, len(requests))
    server.rss.reset()
    cpu = server.cpu_seconds()
    # The client's CPU: curl runs as waited-for children; the ws client runs in this process.
    client_cpu = _children_cpu() + (time.process_time() if mode == "ws" else 0.0)
    outcomes, wall = services.run_requests(call, requests, concurrency)
    cpu = server.cpu_seconds() - cpu
    client_cpu = _children_cpu() + (time.process_time() if mode == "ws" else 0.0) - client_cpu
    failed = [r.error for r in outcomes if not r.ok]
    total_images = sum(images[p] for p, r in zip(requests, outcomes) if r.ok)
    row = {
        "system": system, "preset": preset, "mode": mode, "concurrency": concurrency, "shard": shard_label,
        "round": round_index, "requests": len(requests), "failed": len(failed), "errors": failed[:3],
        "wall_s": wall, "images": total_images, "images_per_s": total_images / wall if not failed else None,
        "bytes_in": sum(r.bytes_in for r in outcomes), "bytes_out": sum(r.bytes_out for r in outcomes),
        "ttfb_s": [r.ttfb for r in outcomes if r.ok], "latency_s": [r.seconds for r in outcomes if r.ok],
        "peak_rss": server.rss.peak(), "server_cpu_s": cpu,
        "cpu_ms_per_image": cpu / total_images * 1e3 if total_images else None,
        "client_cpu_ms_per_image": client_cpu / total_images * 1e3 if total_images else None,
    }
    row["mb_in_per_s"] = row["bytes_in"] / wall / 1e6
    row["mb_out_per_s"] = row["bytes_out"] / wall / 1e6
    if failed:
        log.warning("  %s: %d of %d requests failed: %s", label, len(failed), len(requests), failed[0])
    results["measurements"].append(row)
    return row


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_memory(args, budget: Budget, results: dict, logs: Path, small, big,
                   reuse: services.Server | None) -> None:
    """Peak RSS for a small and then a large shard (imagenet-train, one in flight), per input mode.

    Each mode gets a fresh service (``reuse`` only in smoke runs, to save start-ups), sent the small
    shard first and then the large one: with bounded memory the large shard's peak stays at the small
    one's; anything that grows with the shard shows up as the difference.
    """
    etl_args = json.dumps({"preset": "imagenet-train"})
    for mode in ("hpush-fqn", "hpush-body"):
        if budget.remaining() < 90:
            results["skipped"].append(f"memory {mode}: time budget")
            continue
        server = reuse or services.start_service(logs, args.work, args.workers, name=f"service-memory-{mode}").ready()
        try:
            for label, shard in (("small", small), ("big", big)):
                row = measure(budget, results, server, "service", "imagenet-train", mode, 1, [shard.path], [shard],
                              etl_args, 0, shard_label=label)
                if row is not None:
                    results["memory"].append({"mode": mode, "shard": label, "bytes": shard.size,
                                              "images": shard.images, "idle_rss": server.idle_rss,
                                              "fresh_server": reuse is None, "peak_rss": row["peak_rss"],
                                              "images_per_s": row["images_per_s"],
                                              "ttfb_s": row["ttfb_s"][0] if row["ttfb_s"] else None})
        finally:
            if reuse is None:
                server.stop()


def measure_client(args, budget: Budget, results: dict, shards, service: services.Server) -> None:
    """Samples/s delivered to a training loop: client-side decoding vs reading the service's output."""
    from transformer.client.urls import pod_urls

    paths = [s.path for s in shards]
    for preset in args.presets:
        if budget.remaining() < 60:
            results["skipped"].append(f"client-side decoding {preset}: time budget")
            continue
        log.info("client-side decoding (WebLoader, PIL + torchvision v1), %s", preset)
        row = client_side.client_side_decoding(paths, preset, args.workers, 32, limit_s=budget.remaining() - 45)
        results["client"].append({"reader": "client-side decoding (raw shards)", "preset": preset,
                                  "dtype": "float32", **row})
    mountpath = str(args.work / "mp")
    for dtype in ("float32", "uint8"):
        etl = {"preset": "imagenet-train", "dtype": dtype}
        if budget.remaining() < 60:
            results["skipped"].append(f"ETL output reading {dtype}: time budget")
            continue
        log.info("transformer.client loader over the live service, %s", dtype)
        urls = pod_urls(service.url, data.BUCKET, [p.name for p in paths], etl_args=etl, mountpath=mountpath)
        row = client_side.read_with_client(urls, args.workers, 32, limit_s=budget.remaining() - 45)
        results["client"].append({"reader": "transformer.client, live service (same cores)",
                                  "preset": "imagenet-train", "dtype": dtype, **row})
        if budget.remaining() < 60:
            results["skipped"].append(f"ETL output reading from disk {dtype}: time budget")
            continue
        log.info("transformer.client loader over saved service output, %s", dtype)
        saved = client_side.save_outputs(service.url, data.BUCKET, paths[:2], json.dumps(etl),
                                         args.work / "etl-out" / dtype, timeout=budget.remaining() - 45)
        saved_bytes = sum(p.stat().st_size for p in saved)
        try:
            row = client_side.read_with_client([str(p) for p in saved], args.workers, 32,
                                               limit_s=budget.remaining() - 30)
        finally:
            for path in saved:
                path.unlink(missing_ok=True)
        results["client"].append({"reader": "transformer.client, saved output (loader cost only)",
                                  "preset": "imagenet-train", "dtype": dtype, "mb_per_s": None, **row})
        if row["complete"] and row["samples"]:
            results["client"][-1]["mb_per_s"] = saved_bytes / row["seconds"] / 1e6


if __name__ == "__main__":
    sys.exit(main())

