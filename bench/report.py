"""``results.md`` (tables, targets, machine, versions, command) and ``results.png`` from one run's figures."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path

import psutil

from .stamp import cpu_name, git_state, short_commit, stamp, stamp_line
from .stats import median, ratio
from .summary import summarize

PACKAGES = ("torch", "torchvision", "pillow", "numpy", "simplejpeg", "webdataset", "aistore", "fastapi", "uvicorn",
            "httptools", "uvloop", "websockets", "psutil")


def finish(results: dict, json_path: Path | None, text: str) -> int:
    """A one-off command's last step: its figures as JSON where asked, its report on stdout; exit status 0."""
    if json_path:
        json_path.write_text(json.dumps(results, indent=1))
    print(text)
    return 0


def save_run(out: Path, results: dict, title: str, command: str, text: str, started: dict | None = None) -> int:
    """A run's folder: ``results.json`` and ``results.md`` (the title, the command, the commit and date of
    ``started`` (``stamp()`` taken when the run began; now, if not given), the report); the report on stdout;
    exit status 0."""
    out.mkdir(parents=True, exist_ok=True)
    meta = results.setdefault("meta", {})
    meta.update(started or stamp())
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(f"# {title}\n\n`{command}`\n\n{stamp_line(meta)}\n\n{text}")
    print(text)
    return 0


def run_name(started: float) -> str:
    """A run's folder name: its start (local time) and the checked-out commit, so names sort by date."""
    return f"{time.strftime('%Y%m%d-%H%M', time.localtime(started))}-{short_commit() or 'nogit'}"


def newest_run(root: Path) -> Path:
    """The newest run folder under ``root`` that holds a ``results.json``."""
    runs = sorted(p.parent for p in root.glob("*/results.json"))
    if not runs:
        raise FileNotFoundError(f"no run with a results.json under {root}: run python -m bench.run first")
    return runs[-1]


def metadata(argv: list[str], args, started: float, git: dict[str, str] | None = None) -> dict:
    from transformer.config import available_cpus

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    curl = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA install must not lose the whole report
        gpu = None
    return {
        "command": "python -m bench.run " + shlex.join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_s": time.time() - started,
        **(git or git_state()),
        "machine": {"cpu": cpu_name(), "cpus_usable": available_cpus(), "cpus_online": os.cpu_count(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
                    "gpu": gpu, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"python": platform.python_version(), **{p: version(p) for p in PACKAGES},
                     "curl": curl[0] if curl else None},
        "settings": {"workers": args.workers, "concurrency": args.concurrency, "rounds": args.rounds,
                     "shards": args.shards, "samples": args.samples, "big_mib": args.big_mib, "smoke": args.smoke,
                     "presets": list(getattr(args, "presets", ()))},
    }


# ------------------------------------------------------------------------------------------ targets


def _row(table: list[dict], **match) -> dict | None:
    return next((r for r in table if all(r.get(k) == v for k, v in match.items())), None)


def _by_round(rows: list[dict], **match) -> dict[int, float]:
    """Round -> images/s of the rows matching every field of ``match`` (rows without a figure left out)."""
    return {r["round"]: r["images_per_s"] for r in rows
            if all(r.get(k) == v for k, v in match.items()) and r["images_per_s"]}


def _per_round_ratio(results: dict, a: dict, b: dict) -> float | None:
    """Median over rounds of measurement(a) / measurement(b), both from the same round."""
    left, right = _by_round(results["measurements"], **a), _by_round(results["measurements"], **b)
    return median([left[k] / right[k] for k in left if k in right])


def targets(results: dict, table: list[dict]) -> list[dict]:
    rows = []
    concurrency = results["meta"]["settings"]["concurrency"]
    single = {p: median([r["ms_per_image"] for r in results["single_thread"] if r["preset"] == p])
              for p in ("imagenet-train", "imagenet-val")}

    for mode, c in (("hpush-body", 1), ("hpush-fqn", 1), ("hpush-fqn", concurrency)):
        row = _row(table, system="service", preset="imagenet-train", mode=mode, concurrency=c, shard="demo")
        value = row["of_limit"] if row else None
        rows.append({"target": f"service {mode} x{c}, imagenet-train float32 >= 90% of the compute limit",
                     "measured": _pct(value), "met": None if value is None else value >= 0.9})

    limits = {r["round"]: r["images_per_s"] for r in results["compute"] if r["preset"] == "imagenet-train"}
    for mode, c in (("hpush-body", 1), ("hpush-fqn", 1), ("hpush-fqn", concurrency)):
        base = {"preset": "imagenet-train", "mode": mode, "concurrency": c, "shard": "demo"}
        speedup = _per_round_ratio(results, {"system": "service", **base}, {"system": "peer", **base})
        # What 4x asks of the service: the compute limit's own multiple of the conventional ETL, per round.
        premise = median([limits[r["round"]] / r["images_per_s"] for r in results["measurements"]
                          if r["system"] == "peer" and all(r.get(k) == v for k, v in base.items())
                          and r["images_per_s"] and r["round"] in limits])
        ours, theirs = _row(table, system="service", **base), _row(table, system="peer", **base)
        rss = ratio(ours["peak_rss_mb"], theirs["peak_rss_mb"]) if ours and theirs else None
        rows.append({"target": f"{mode} x{c}: >= 4x the conventional ETL's images/s",
                     "measured": None if speedup is None else f"{speedup:.2f}x (compute limit: "
                                                              f"{_x(premise) or '–'} the conventional ETL)",
                     "met": None if speedup is None else speedup >= 4})
        rows.append({"target": f"{mode} x{c}: peak RSS < 1/3 of the conventional ETL's",
                     "measured": None if rss is None else f"{rss:.2f} of it ({ours['peak_rss_mb']:.0f} vs "
                                                          f"{theirs['peak_rss_mb']:.0f} MB)",
                     "met": None if rss is None else rss < 1 / 3})

    for mode in ("hpush-fqn", "hpush-body"):
        row = _row(table, system="service", preset="imagenet-train", mode=mode, concurrency=1, shard="demo")
        bound = 50 + (single["imagenet-train"] or 0)
        ttfb = row["ttfb_ms_p50"] if row else None
        rows.append({"target": f"{mode} time to first byte < 50 ms + one sample ({bound:.1f} ms)",
                     "measured": None if ttfb is None else f"p50 {ttfb:.1f} ms",
                     "met": None if ttfb is None else ttfb < bound})

    for mode in ("hpush-fqn", "hpush-body"):
        small = next((m for m in results["memory"] if m["mode"] == mode and m["shard"] == "small"), None)
        big = next((m for m in results["memory"] if m["mode"] == mode and m["shard"] == "big"), None)
        if small and big:
            delta = (big["peak_rss"] - small["peak_rss"]) / 2**20
            rows.append({"target": f"{mode}: peak RSS, {big['bytes'] / 2**30:.2f} GiB shard within 100 MB of the "
                                   f"{small['bytes'] / 1e6:.0f} MB shard's",
                         "measured": f"{delta:+.0f} MB ({small['peak_rss'] / 2**20:.0f} -> "
                                     f"{big['peak_rss'] / 2**20:.0f} MB)", "met": delta < 100})
    return rows


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.0f}%"


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


# ----------------------------------------------------------------------------------------- markdown


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def write_markdown(results: dict, path: Path) -> None:
    """results.md: the run's stamp and targets, then one section per measurement (each skipped when not run)."""
    table = summarize(results)
    lines = _header(results, table) + _compute(results) + _against_http_limit(results) + _round_by_round(results)
    lines += _cpu_budget(results, table) + _uint8(results) + _throughput(table) + _memory(results, table)
    lines += _client(results) + _decoders(results) + _skipped_and_failed(results)
    path.write_text("\n".join(lines) + "\n")


def _header(results: dict, table: list[dict]) -> list[str]:
    """The run's command, commit, machine, versions and shards, then the targets table."""
    meta = results["meta"]
    shards = results["shards"]
    demo = shards["demo"]
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{meta['command']}` (git {meta['git']}), started {meta['started']}, took "
        f"{meta['duration_s'] / 60:.1f} min.",
        "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cpus_usable']} usable CPUs "
        f"({meta['machine']['cpus_online']} online), {meta['machine']['memory_gib']} GiB RAM, "
        f"{meta['machine']['platform']}; GPU: {meta['machine']['gpu'] or 'none'}; "
        f"load average (1, 5, 15 min) at the start {meta['machine'].get('load_average_start')} and at the end "
        f"{meta['machine']['load_average_end']} (other jobs share these CPUs: "
        "compare ratios taken in the same round, not absolute figures across runs).",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        "",
        f"Shards: {len(demo)} demo shards of {demo[0]['samples']} samples "
        f"({demo[0]['bytes'] / 1e6:.1f} MB each, {demo[0]['bytes'] / max(1, demo[0]['images']) / 1e3:.0f} KB per "
        f"sample)" + (f"; memory comparison: {shards['small']['bytes'] / 1e6:.0f} MB ({shards['small']['images']} "
                      f"images) and {shards['big']['bytes'] / 2**30:.2f} GiB ({shards['big']['images']} images) "
                      "shards made of the demo samples" if shards.get("big") else "")
        + f". Workers: {meta['settings']['workers']} (service threads, "
        f"compute-limit threads, peer uvicorn workers). Rounds: {len(results.get('round_seconds', []))}.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for row in targets(results, table):
        met = {True: "yes", False: "**no**", None: "not measured"}[row["met"]]
        lines.append(f"| {row['target']} | {row['measured'] or '–'} | {met} |")
    return lines


def _compute(results: dict) -> list[str]:
    """The compute limit, the same in processes and sent to curl, and the engine without HTTP."""
    lines: list[str] = []
    lines += ["", "## Compute limit, and the engine without HTTP", "",
              "Compute limit: `transform_sample` (decode, v2 transforms, .npy) over in-memory samples on the "
              "service's thread count, no tar, no HTTP. Engine: `transform_shard` from the shard file to /dev/null "
              "(tar in and out, ordered window; what `wds-transform apply` does). CPU ms/image is process CPU "
              "over images, so it does not depend on how much of the machine other jobs took. The same in "
              "processes: `transform_sample` in as many forked processes as threads, each on its share of the "
              "samples: the same work without the GIL (not the service's design: it would need a copy of torch "
              "per process and samples and arrays passed between processes). The same, each .npy sent to curl: "
              "the compute limit's loop with each image's array written, in order, as one chunked HTTP frame to "
              "curl over loopback on the same cores (`bench.compute.http_limit`: no tar, no request, no event "
              "loop, no window): about what delivering these arrays over HTTP costs before a service does "
              "anything else.", "",
              "| preset | stage | images/s | of limit | CPU ms/image | one sample, 1 thread (ms) |",
              "|---|---|---|---|---|---|"]
    for preset in ("imagenet-train", "imagenet-val"):
        rows = [r for r in results["compute"] if r["preset"] == preset]
        engine = [r for r in results["engine"] if r["preset"] == preset]
        single = [r["ms_per_image"] for r in results["single_thread"] if r["preset"] == preset]
        if rows:
            lines.append(f"| {preset} | compute limit | {_fmt(median([r['images_per_s'] for r in rows]))} | 100% | "
                         f"{_fmt(median([r['cpu_ms_per_image'] for r in rows]), 2)} | {_fmt(median(single), 2)} |")
        processes = [r for r in results.get("process_limit", []) if r["preset"] == preset]
        limits = {r["round"]: r["images_per_s"] for r in rows}
        sent = [r for r in results.get("http_limit", []) if r["preset"] == preset]
        for label, stage in (("the same in processes (no GIL)", processes),
                             ("the same, each .npy sent to curl (no tar, no server)", sent),
                             ("engine, no HTTP", engine)):
            if rows and stage:
                fraction = median([s["images_per_s"] / limits[s["round"]] for s in stage if s["round"] in limits])
                lines.append(f"| {preset} | {label} | {_fmt(median([s['images_per_s'] for s in stage]))} | "
                             f"{_pct(fraction) or '–'} | {_fmt(median([s['cpu_ms_per_image'] for s in stage]), 2)} | |")
    return lines


def _uint8(results: dict) -> list[str]:
    """The same with uint8 output."""
    lines: list[str] = []
    if results.get("uint8"):
        u = results["uint8"]
        fraction = median([r["service_images_per_s"] / r["compute_images_per_s"] for r in u
                           if r["service_images_per_s"]])
        server, client = median([r["server_cpu_ms_per_image"] for r in u]), median([r["client_cpu_ms_per_image"]
                                                                                    for r in u])
        compute8 = median([r["compute_cpu_ms_per_image"] for r in u])
        lines += ["", "## The same with uint8 output (imagenet-train, hpush-fqn, 1 shard in flight)", "",
                  "uint8 CHW is a quarter of float32's bytes (150,656 vs 602,240 per image) and skips the float "
                  "math; the compute limit is measured again with uint8 output.", "",
                  "| compute limit images/s | CPU ms/image | service images/s | of limit | server CPU ms/image | "
                  "client CPU ms/image | MB/s out |", "|---|---|---|---|---|---|---|",
                  f"| {_fmt(median([r['compute_images_per_s'] for r in u]))} | {_fmt(compute8, 2)} | "
                  f"{_fmt(median([r['service_images_per_s'] for r in u]))} | {_pct(fraction) or '–'} | "
                  f"{_fmt(server, 2)} | {_fmt(client, 2)} | {_fmt(median([r['mb_out_per_s'] for r in u]))} |"]
    return lines


def _throughput(table: list[dict]) -> list[str]:
    """Throughput over HTTP: every system, preset, mode and shards in flight."""
    lines: list[str] = []
    lines += ["", "## Throughput over HTTP (loopback, float32 output)", "",
              "Medians over rounds; latency percentiles over every shard request; `of limit` is the ratio to the "
              "compute limit measured in the same round. CPU ms/image counts the whole server process tree.", "",
              "| system | preset | mode | shards in flight | images/s | of limit | MB/s in | MB/s out | "
              "TTFB p50 ms | latency p50 ms | latency p99 ms | peak RSS MB | server CPU ms/image | "
              "client CPU ms/image |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        if r["shard"] != "demo":
            continue
        name = "this service" if r["system"] == "service" else "conventional ETL"
        lines.append(
            f"| {name} | {r['preset']} | {r['mode']} | {r['concurrency']} | {_fmt(r['images_per_s'])} | "
            f"{_pct(r['of_limit']) or '–'} | {_fmt(r['mb_in_per_s'], 1)} | {_fmt(r['mb_out_per_s'])} | "
            f"{_fmt(r['ttfb_ms_p50'], 1)} | {_fmt(r['latency_ms_p50'])} | {_fmt(r['latency_ms_p99'])} | "
            f"{_fmt(r['peak_rss_mb'])} | {_fmt(r['cpu_ms_per_image'], 2)} | "
            f"{_fmt(r['client_cpu_ms_per_image'], 2)} |" + (f" {r['failed']} failed" if r["failed"] else ""))
    return lines


def _memory(results: dict, table: list[dict]) -> list[str]:
    """Memory: small then large shard, and what the conventional ETL would need."""
    lines: list[str] = []
    if results["memory"]:
        lines += ["", "## Memory: small then large shard (one fresh service per input mode, imagenet-train, "
                      "1 shard in flight)", "",
                  "| input | shard | images | images/s | MB/s in | MB/s out | TTFB ms | latency ms | idle RSS MB | "
                  "peak RSS MB |", "|---|---|---|---|---|---|---|---|---|---|"]
        for m in results["memory"]:
            size = f"{m['bytes'] / 2**30:.2f} GiB" if m["bytes"] > 2**30 / 2 else f"{m['bytes'] / 1e6:.0f} MB"
            row = next((r for r in results["measurements"] if r["shard"] == m["shard"] and r["mode"] == m["mode"]
                        and r["system"] == "service"), None)
            lines.append(f"| {m['mode']} | {size} | {m['images']} | {_fmt(m['images_per_s'])} | "
                         f"{_fmt(row and row['mb_in_per_s'], 1)} | {_fmt(row and row['mb_out_per_s'])} | "
                         f"{_fmt(None if m['ttfb_s'] is None else m['ttfb_s'] * 1e3, 1)} | "
                         f"{_fmt(row['latency_s'][0] * 1e3 if row and row['latency_s'] else None)} | "
                         f"{_fmt(m['idle_rss'] / 2**20)} | {_fmt(m['peak_rss'] / 2**20)} |")
        lines.append("")
        peer = next((r for r in table if r["system"] == "peer" and r["mode"] == "hpush-fqn"
                     and r["concurrency"] == 1 and r["shard"] == "demo" and r["preset"] == "imagenet-train"), None)
        idle = (results.get("servers", {}).get("peer") or {}).get("idle_rss")
        big = results["shards"].get("big")
        if peer and idle and big:
            growth = peer["peak_rss_mb"] - idle / 2**20
            per_byte = growth * 2**20 / results["shards"]["demo"][0]["bytes"]
            lines += ["", f"The conventional ETL is not run on the large shard. Its peak RSS grew by {growth:,.0f} MB "
                          f"for one {results['shards']['demo'][0]['bytes'] / 1e6:.0f} MB demo shard "
                          f"({per_byte:.1f} bytes per input byte: the input, the output tar in a BytesIO and its "
                          f"getvalue() copy), so the {big['bytes'] / 2**30:.2f} GiB shard would need about "
                          f"{per_byte * big['bytes'] / 2**30:.0f} GiB more, on a machine shared with other jobs."]
    return lines


def _client(results: dict) -> list[str]:
    """What the training loop receives."""
    lines: list[str] = []
    if results["client"]:
        lines += ["", "## What the training loop receives (WebLoader, batches of 32)", "",
                  "| reader | preset | dtype | workers | samples/s | MB/s | first batch s | samples |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in results["client"]:
            lines.append(f"| {c['reader']} | {c['preset']} | {c['dtype']} | {c['workers']} | "
                         f"{_fmt(c['samples_per_s'])} | {_fmt(c.get('mb_per_s'))} | {_fmt(c['first_batch_s'], 2)} | "
                         f"{c['samples']}{'' if c['complete'] else ' (time limit)'} |")
    return lines


def _decoders(results: dict) -> list[str]:
    """Decode and resize options."""
    lines: list[str] = []
    if results["decoders"]:
        d0 = results["decoders"][0]
        lines += ["", f"## Decode and resize options (1 thread, {d0['images']} demo JPEGs, median "
                      f"{d0['median_size']}, {d0['mean_bytes'] / 1e3:.0f} KB)", "",
                  "Error: mean absolute difference of the imagenet-val output against torchvision's reference, "
                  "in normalized units (the service's accuracy check requires < 0.005); exact: identical uint8 "
                  "pixels (the service's uint8 check requires it).", "",
                  "| option | decode ms | decode + val resize/crop ms | error | exact |", "|---|---|---|---|---|"]
        for d in results["decoders"]:
            lines.append(f"| {d['option']} | {_fmt(d['decode_ms'], 3)} | {_fmt(d['val_uint8_ms'], 3)} | "
                         f"{d['mae']:.4f} | {'yes' if d['exact'] else 'no'} |")
    return lines


def _skipped_and_failed(results: dict) -> list[str]:
    """What was skipped, and every failed request."""
    lines: list[str] = []
    if results["skipped"]:
        lines += ["", "## Skipped", ""] + [f"* {s}" for s in results["skipped"]]
    failures = [r for r in results["measurements"] if r["failed"]]
    if failures:
        lines += ["", "## Failed requests", ""]
        lines += [f"* {r['system']} {r['preset']} {r['mode']} x{r['concurrency']}: {r['errors']}" for r in failures]
    return lines

def _against_http_limit(results: dict) -> list[str]:
    """This service's images/s over the limit's loop-plus-send, round by round: what its own parts cost."""
    parts = []
    for preset in ("imagenet-train", "imagenet-val"):
        sent = _by_round(results.get("http_limit", []), preset=preset)
        for mode in ("hpush-fqn", "hpush-body"):
            service = _by_round(results["measurements"], system="service", preset=preset, mode=mode,
                                concurrency=1, shard="demo")
            fraction = median([service[k] / sent[k] for k in service if k in sent])
            if fraction is not None:
                parts.append(f"{preset} {mode} {_pct(fraction)}")
    if not parts:
        return []
    return ["", "This service (1 shard in flight) against the same, each .npy sent to curl, in the same round "
            "(median over rounds): " + ", ".join(parts) + ". The rest of the way to the limit is, roughly, what "
            "delivering the arrays over HTTP to a client on the same cores costs."]


_ROUND_CASES = (("hpush-fqn", 1), ("hpush-body", 1), ("ws", 1), ("hpush-fqn", 4))


def _round_by_round(results: dict) -> list[str]:
    """Each round's fractions of that round's limit: the spread the medians above hide.

    Other jobs take these cores at random, so one round's limit or service case can read far off (a
    ratio over 100% means the limit's pass was the one slowed). The loop with each .npy sent to curl is
    in every round too: it is what any service must pay to deliver the arrays, so a round where the
    service and that loop move together was the machine, not the service.
    """
    lines: list[str] = []
    for preset in ("imagenet-train", "imagenet-val"):
        limit = _by_round(results["compute"], preset=preset)
        if len(limit) < 2:
            continue  # one round: the tables above already say it all
        columns = {"each .npy sent to curl": _by_round(results.get("http_limit", []), preset=preset)}
        for mode, concurrency in _ROUND_CASES:
            columns[f"{mode} x{concurrency}"] = _by_round(results["measurements"], system="service", preset=preset,
                                                          mode=mode, concurrency=concurrency, shard="demo")
        columns = {name: values for name, values in columns.items() if values}
        if not lines:
            lines += ["", "## Round by round (fraction of the same round's compute limit)", "",
                      "The medians above hide the spread: other jobs take these cores at random, so a round's "
                      "limit or case can read far off (over 100%: the limit's pass was the one slowed). The "
                      "loop with each .npy sent to curl (no tar, no server) is measured in every round: what "
                      "any service pays here to deliver the arrays to a client on the same cores."]
        lines += ["", f"{preset}:", "", "| round | limit images/s | " + " | ".join(columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for index in sorted(limit):
            cells = [_pct(values[index] / limit[index]) if index in values else "–" for values in columns.values()]
            lines.append(f"| {index + 1} | {_fmt(limit[index])} | " + " | ".join(cells) + " |")
        spreads = []
        for values in columns.values():
            ratios = sorted(values[k] / limit[k] for k in values if k in limit)
            spreads.append(f"{_pct(median(ratios))} ({_pct(ratios[0])}-{_pct(ratios[-1])})" if ratios else "–")
        lines.append("| median (min-max) | | " + " | ".join(spreads) + " |")
    return lines


def _cpu_budget(results: dict, table: list[dict]) -> list[str]:
    """Where the CPU of one image goes, stage by stage, and the fraction of the limit that leaves."""
    lines = ["", "## Where an image's CPU goes (imagenet-train, float32, 1 shard in flight)", "",
             "With every core busy, throughput is cores / (CPU per image), so the ratio of CPU per image bounds "
             "the fraction of the compute limit a stage can reach on this machine, whatever the scheduling.", "",
             "| stage | CPU ms/image | added | bound: fraction of the limit |", "|---|---|---|---|"]
    compute = median([r["cpu_ms_per_image"] for r in results["compute"] if r["preset"] == "imagenet-train"])
    engine = median([r["cpu_ms_per_image"] for r in results["engine"] if r["preset"] == "imagenet-train"])
    if compute is None:
        return []
    lines.append(f"| compute limit (decode, transforms, .npy) | {compute:.2f} | | 100% |")
    sent = [r for r in results.get("http_limit", []) if r["preset"] == "imagenet-train"]
    if sent:
        both = median([r["cpu_ms_per_image"] + r["client_cpu_ms_per_image"] for r in sent])
        lines.append(f"| the same, each .npy sent to curl (process + curl; no tar, no server) | {both:.2f} | "
                     f"{both - compute:+.2f} | {_pct(compute / both)} |")
    if engine is not None:
        lines.append(f"| + tar in/out, ordered window (engine, no HTTP) | {engine:.2f} | {engine - compute:+.2f} | "
                     f"{_pct(compute / engine)} |")
    for mode in ("hpush-fqn", "hpush-body"):
        row = _row(table, system="service", preset="imagenet-train", mode=mode, concurrency=1, shard="demo")
        if row and row["cpu_ms_per_image"] and row["client_cpu_ms_per_image"] is not None:
            server, client = row["cpu_ms_per_image"], row["client_cpu_ms_per_image"]
            base = engine if engine is not None else compute
            lines.append(f"| service {mode}: server process (+ event loop, HTTP, TCP send) | {server:.2f} | "
                         f"{server - base:+.2f} | {_pct(compute / server)} |")
            lines.append(f"| service {mode}: + the client on the same cores (curl receiving) | "
                         f"{server + client:.2f} | {client:+.2f} | {_pct(compute / (server + client))} |")
    floors = results.get("http_floor") or []
    send = median([f["server_cpu_ms_per_image"] for f in floors])
    receive = median([f["client_cpu_ms_per_image"] for f in floors])
    if send is not None and receive is not None:
        base = engine if engine is not None else compute
        ceiling = base + send + receive
        lines += ["", "The floor under the HTTP part: 602 KB chunked frames written from one buffer with `sendmsg` "
                  "to curl over loopback (`bench.services.http_floor`: no tar, no compute, no event loop), "
                  "measured in the same rounds. Adding it to the engine gives the best fraction of the limit "
                  "an HTTP service can reach here with every core busy.", "",
                  "| floor | CPU ms/image | bound: fraction of the limit |", "|---|---|---|",
                  f"| kernel send (server side) | {send:.2f} | |",
                  f"| kernel receive (curl) | {receive:.2f} | |",
                  f"| engine + send + receive | {ceiling:.2f} | {_pct(compute / ceiling)} |"]
    return lines


# ------------------------------------------------------------------------------------------------ plot


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(results)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [2.2, 2.2, 1.4]})
    colors = {"service": "#2a7ab9", "peer": "#d1603d", "limit": "#444444", "client": "#7f9f3f"}
    for ax, preset in zip(axes[:2], ("imagenet-train", "imagenet-val")):
        labels, values, shades = [], [], []
        limit = median([r["images_per_s"] for r in results["compute"] if r["preset"] == preset])
        if limit:
            labels.append("compute limit")
            values.append(limit)
            shades.append(colors["limit"])
        for r in table:
            if r["preset"] == preset and r["shard"] == "demo" and r["images_per_s"]:
                who = "service" if r["system"] == "service" else "conventional"
                labels.append(f"{who} {r['mode']} x{r['concurrency']}")
                values.append(r["images_per_s"])
                shades.append(colors[r["system"]])
        for c in results["client"]:
            if c["preset"] == preset and c["reader"].startswith("client-side"):
                labels.append("client-side decoding")
                values.append(c["samples_per_s"])
                shades.append(colors["client"])
        _bars(ax, labels, values, shades)
        if limit:
            ax.axvline(limit, color=colors["limit"], linestyle=":", linewidth=1)
            ax.axvline(0.9 * limit, color=colors["limit"], linestyle="--", linewidth=0.8)
        ax.set_xlabel("images/s (float32 224x224 out)")
        ax.set_title(f"{preset}: throughput (dashed: 90% of the limit)", fontsize=10)
        ax.set_xlim(0, max(values or [1]) * 1.18)

    ax = axes[2]
    labels, values, shades = [], [], []
    for r in table:
        if r["preset"] == "imagenet-train" and r["shard"] == "demo" and r["concurrency"] == 1 and r["mode"] != "ws":
            labels.append(f"{'service' if r['system'] == 'service' else 'conventional'} {r['mode']}")
            values.append(r["peak_rss_mb"])
            shades.append(colors[r["system"]])
    for m in results["memory"]:
        size = f"{m['bytes'] / 2**30:.1f} GiB" if m["shard"] == "big" else f"{m['bytes'] / 1e6:.0f} MB"
        labels.append(f"service {m['mode']}, {size} shard")
        values.append(m["peak_rss"] / 2**20)
        shades.append("#5fa2d6" if m["shard"] == "big" else colors["service"])
    _bars(ax, labels, values, shades)
    ax.set_xlabel("peak RSS of the server process tree (MB)")
    ax.set_title("peak RSS, imagenet-train, 1 shard", fontsize=10)
    ax.set_xlim(0, max(values or [1]) * 1.25)

    meta = results["meta"]
    fig.suptitle(f"{meta['machine']['cpu']}, {meta['machine']['cpus_usable']} CPUs, no GPU — "
                 f"{meta['command']} ({meta['started']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels: list[str], values: list[float], shades: list[str]) -> None:
    """Horizontal bars, top to bottom in the order given, each labelled with its value."""
    positions = range(len(labels))
    ax.barh(list(positions), values, color=shades)
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.invert_yaxis()
    for y, v in zip(positions, values):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
