"""The through-AIS soak's figures (``bench/soak_ais.py``): the report as gzipped JSON, its bounds checked, a short
table (``results.md``) and a plot of the processes over time (``results.png``).

``python -m bench.soak_report FOLDER`` prints the table again from the folder's ``results.json.gz`` (a
30-minute run's series are megabytes of JSON, hence kept compressed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from .stamp import cpu_name
from .stats import percentile

AISNODES = ("proxy", "target1", "target2")
MB = 2**20


def _overlaps(start: float, end: float, window: tuple[float, float]) -> bool:
    return start <= window[1] and end >= window[0]


def _windows(soak, etl: str) -> list[tuple[float, float]]:
    return [kill.window for kill in soak.kills if kill.etl == etl]


def _reads(soak) -> dict:
    """Samples and reads: delivered, lost, wrong; how each read ended, and whether its ETL was down meanwhile."""
    reads, comm_of = soak.reads, soak.etls
    figures = Counter()
    by_comm: dict[str, Counter] = {}
    refused: Counter = Counter()
    examples: dict[str, list[str]] = {"lost": [], "wrong": [], "unnamed": [], "errors_while_up": [], "named": []}
    for read in reads:
        windows = _windows(soak, comm_of[read.comm])
        affected = any(_overlaps(read.start, read.end, window) for window in windows)
        counts = by_comm.setdefault(f"{read.comm}/{read.reader}", Counter())
        counts["reads"] += 1
        figures["delivered"] += read.delivered
        figures["wrong"] += read.wrong
        if read.wrong:
            examples["wrong"].append(f"{read.comm}/{read.reader} {read.kind}: {read.wrong} of {read.delivered}")
        if read.refused:
            if read.error is None:
                figures["refused_shards_delivered"] += 1
                examples["wrong"].append(f"{read.comm}/{read.reader} {read.kind}: delivered, should be refused")
            elif read.named:
                refused[read.kind] += 1
                counts["refused"] += 1
            else:
                figures["unnamed_errors"] += 1
                examples["unnamed"].append(f"{read.kind}: {read.error[:1000]}")
            continue
        missing = max(0, read.expected - read.delivered)
        if read.error is None:
            figures["lost"] += missing
            figures["whole"] += 1
            counts["whole"] += 1
            if read.opens > 1:
                figures["recovered_reads"] += 1
                counts["recovered"] += 1
            if missing:
                examples["lost"].append(f"{read.comm}/{read.reader} {read.kind}: {read.delivered} of {read.expected}")
            continue
        counts["errors"] += 1
        if not read.named:
            figures["lost"] += missing
            figures["unnamed_errors"] += 1
            examples["unnamed"].append(f"{read.comm}/{read.reader} {read.kind}: {read.error[:1000]}")
            continue
        figures["named_errors"] += 1
        figures["withheld_named"] += missing
        if affected:
            figures["named_errors_etl_down"] += 1
            if len(examples["named"]) < 5:
                examples["named"].append(f"{read.comm}/{read.reader} {read.kind}: {read.error[:1000]}")
        else:
            figures["errors_while_up"] += 1
            examples["errors_while_up"].append(f"{read.comm}/{read.reader} {read.kind}: {read.error[:1000]}")
    names = ("delivered", "lost", "wrong", "whole", "recovered_reads", "named_errors", "named_errors_etl_down",
             "errors_while_up", "unnamed_errors", "withheld_named", "refused_shards_delivered")
    irregular = [[round(r.start - soak.t0, 1), round(r.end - r.start, 1), f"{r.comm}/{r.reader}", r.kind,
                  f"{r.delivered}/{r.expected}", r.opens, (r.error or "")[:400]]
                 for r in reads if (not r.refused and (r.error is not None or r.opens > 1)) or r.wrong][:2000]
    return {"reads": len(reads), **{k: figures[k] for k in names}, "irregular": irregular,
        "shards_refused": dict(sorted(refused.items())), "by_reader": {k: dict(v) for k, v in sorted(by_comm.items())},
        "examples": {k: v[:5] for k, v in examples.items()}}


def _offline(soak) -> dict:
    copies = soak.copies
    # A copy is affected by the kill of any ETL: AIS 5.0 aborts every offline ETL job when one ETL stops
    # (ext/etl/transform.go, Stop: xreg.AbortKind(..., ActETLBck), "TODO: abort only related offline transforms").
    windows = [kill.window for kill in soak.kills]
    errors_while_up = [c for c in copies if c.outcome != "success" and not any(_overlaps(c.start, c.end, w)
                                                                                  for w in windows)]
    return {
        "etl": soak.offline_etl, "copies": len(copies), "outcomes": dict(Counter(c.outcome for c in copies)),
        "objects_whole": sum(c.whole for c in copies), "objects_missing": sum(len(c.missing) for c in copies),
        "objects_cut": sum(len(c.cut) for c in copies), "objects_wrong": sum(len(c.wrong) for c in copies),
        "objects_lost": sum(len(c.lost) for c in copies), "failed_while_up": len(errors_while_up),
        "examples": [{**asdict(c), "start": round(c.start - soak.t0, 1), "end": round(c.end - soak.t0, 1)}
                     for c in copies if c.outcome != "success" or c.lost or c.wrong or c.cut][:5],
    }


def _kills(soak) -> list[dict]:
    out = []
    for kill in soak.kills:
        mine = [r for r in soak.reads if soak.etls[r.comm] == kill.etl and not r.refused
                and _overlaps(r.start, r.end, kill.window)]
        out.append({**asdict(kill), "at": round(kill.at - soak.t0, 1), "recovered": kill.recovered,
                    "reads_during": len(mine),
                    "reads_continued_whole": sum(1 for r in mine if r.error is None and r.opens > 1),
                    "reads_named_errors": sum(1 for r in mine if r.error is not None and r.named),
                    "reads_unnamed_errors": sum(1 for r in mine if r.error is not None and not r.named)})
    return out


def _health(soak, probes) -> dict:
    def etl_of(pod: str) -> str:
        return next((etl for etl in soak.etls.values() if pod.startswith(f"{etl}-")), "")

    up = [p for p in probes if not any(_overlaps(p.start, p.end, w) for w in _windows(soak, etl_of(p.pod)))]
    seconds = [p.seconds for p in up if p.ok]
    failures = [f"{round(p.start - soak.t0, 1)} s {p.pod}: {p.why}" for p in up if not p.ok]

    def ms(q: float) -> float | None:
        value = percentile(seconds, q)
        return None if value is None else round(value * 1000, 1)

    return {"probes": len(probes), "probes_while_up": len(up), "failures_while_up": len(failures),
            "p50_ms": ms(50), "p99_ms": ms(99), "max_ms": ms(100),
            "left_out_etl_down": len(probes) - len(up), "examples": failures[:5],
            "series": _binned([(p.start - soak.t0, p.seconds * 1000) for p in up if p.ok])}


def _binned(points: list[tuple[float, float]], seconds: float = 10.0) -> list[list[float]]:
    """``[start of the bin, probes, p50, p99, max]`` of the probes' milliseconds, per ``seconds``."""
    bins: dict[int, list[float]] = {}
    for t, ms in points:
        bins.setdefault(int(t // seconds), []).append(ms)
    return [[round(key * seconds, 1), len(values), round(percentile(values, 50), 2), round(percentile(values, 99), 2),
             round(max(values), 2)] for key, values in sorted(bins.items())]


def _processes(soak) -> dict:
    """Per process: the idle readings at the quiet points, what the bounds compare, and its samples."""
    first_seen: dict[str, float] = {}
    for sample in soak.sampler.samples:
        first_seen.setdefault(sample["id"], sample["t"])
    out = {}
    for ident, seen in first_seen.items():
        aisnode = ident in AISNODES
        points = [(q["t"], q["label"], q["processes"][ident]) for q in soak.quiet if ident in q["processes"]]
        # The readings that count: every one for aisnode (the first is after warm-up); for a pod, those once
        # it has been up for the warm-up (a pod of the first hour is up since before the load began).
        counted = [p for p in points if aisnode or seen <= soak.t0 + 1 or p[0] - seen >= soak.options.warm_up]
        entry = {"kind": "aisnode" if aisnode else "pod", "first_seen_s": round(seen - soak.t0, 1),
                 "quiet": [{"t": round(t - soak.t0, 1), "label": label, "rss_mb": round(r["rss"] / MB, 1),
                            "threads": r["threads"], "fds": r["fds"]} for t, label, r in points]}
        if len(counted) >= 2:
            base, later = counted[0][2], [p[2] for p in counted[1:]]
            entry.update(assessed=True, baseline_t=round(counted[0][0] - soak.t0, 1),
                         rss_growth_mb=round((later[-1]["rss"] - base["rss"]) / MB, 1),
                         threads_growth=max(r["threads"] for r in later) - base["threads"],
                         fds_growth=max(r["fds"] for r in later) - base["fds"])
        else:
            entry["assessed"] = False
        series = [s for s in soak.sampler.samples if s["id"] == ident]
        entry["peak_rss_mb"] = round(max(s["rss"] for s in series) / MB, 1)
        entry["peak_threads"] = max(s["threads"] for s in series)
        entry["peak_fds"] = max(s["fds"] for s in series)
        entry["series"] = [[round(s["t"] - soak.t0, 1), round(s["rss"] / MB, 1), s["threads"], s["fds"]]
                           for s in series]
        out[ident] = entry
    return out


def build_report(soak, probes, loadavg_start: tuple[float, float, float]) -> dict:
    options, bounds = soak.options, soak.options.bounds
    reads, offline, kills = _reads(soak), _offline(soak), _kills(soak)
    health, processes = _health(soak, probes), _processes(soak)
    assessed = {ident: p for ident, p in processes.items() if p["assessed"]}
    load = soak.sampler.load
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(time.time() - (time.monotonic() - soak.t0))),
        "git": soak.git,
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "platform": platform.platform(),
                    "loadavg_start": loadavg_start,
                    "loadavg_end": os.getloadavg(), "loadavg_1min_max": max((x[1] for x in load), default=None),
                    "loadavg_1min_median": percentile([x[1] for x in load], 50)},
        "options": {**asdict(options), "comms": list(options.comms)},
        "etls": soak.etls,
        "setup_s": round(soak.setup_s, 1),
        "elapsed_s": round(time.monotonic() - soak.t0, 1),
        "samples": {k: reads[k] for k in ("delivered", "lost", "wrong", "withheld_named")},
        "reads": {k: v for k, v in reads.items() if k not in ("delivered", "lost", "wrong", "withheld_named")},
        "offline": offline,
        "kills": kills,
        "stage_transitions": [[round(t - soak.t0, 1), etl, old or "-", new or "-"]
                              for t, etl, old, new in soak.stages.transitions],
        "stage_poll_errors": soak.stages.errors[:5],
        "health": health,
        "quiet_points": [{"t": round(q["t"] - soak.t0, 1), "label": q["label"], "drained": q["drained"],
                          "hold_s": q["hold_s"]} for q in soak.quiet],
        "processes": processes,
        "load_series": [[round(t - soak.t0, 1), one] for t, one, _, _ in load],
        "failures": soak.failures,
        "aisnode_exits": list(soak.exited.values()),
        "aisnode_panics_recovered": soak.panics,
    }
    aisnodes_assessed = all(processes.get(n, {}).get("assessed") for n in AISNODES)
    report["criteria"] = {
        "samples_delivered_none_lost_or_wrong": (reads["delivered"] > 0 and reads["lost"] == 0 and reads["wrong"] == 0
                                                 and reads["refused_shards_delivered"] == 0
                                                 and offline["objects_lost"] == 0 and offline["objects_wrong"] == 0),
        "every_error_names_its_shard": reads["unnamed_errors"] == 0,
        "every_kill_recovered": bool(kills) and all(k["recovered"] for k in kills),
        "no_pod_process_outlived_a_kill": all(not k.get("left") for k in kills),
        "no_error_while_the_etl_is_up": reads["errors_while_up"] == 0 and offline["failed_while_up"] == 0,
        f"health_p99_under_{bounds.health_p99_ms:g}ms_while_up": (
            health["probes_while_up"] > 0 and health["failures_while_up"] == 0
            and health["p99_ms"] is not None and health["p99_ms"] < bounds.health_p99_ms),
        f"rss_growth_under_{bounds.rss_growth_mb:g}mb": aisnodes_assessed and all(
            p["rss_growth_mb"] < bounds.rss_growth_mb for p in assessed.values()),
        "threads_flat": aisnodes_assessed and all(p["threads_growth"] <= bounds.thread_slack
                                                  for p in assessed.values()),
        "fds_flat": aisnodes_assessed and all(p["fds_growth"] <= bounds.fd_slack for p in assessed.values()),
        "every_aisnode_stayed_up": not soak.exited,
        "every_worker_ran_and_drained": not soak.failures and all(q["drained"] for q in soak.quiet),
    }
    report["passed"] = all(report["criteria"].values())
    return report


# ---------------------------------------------------------------------------------------------- outputs


def markdown(report: dict) -> str:
    s, r, o, h = report["samples"], report["reads"], report["offline"], report["health"]
    kills = report["kills"]
    machine = report["machine"]
    aborted = [k["aborted_s"] for k in kills if k["aborted_s"] is not None]
    left = [k["left"] for k in kills if k.get("left") is not None]  # runs before this count have none
    running = [k["running_s"] for k in kills if k["running_s"] is not None]
    refused = ", ".join(f"{kind} {n}" for kind, n in r["shards_refused"].items()) or "none"
    lines = [
        "# Soak through AIS", "",
        f"`{report.get('command', 'python -m bench.soak --through-ais')}`, started {report['started']}, "
        f"git {report['git']}, {machine['cpus']} CPUs, load average {machine['loadavg_start'][0]:.1f} at the start, "
        f"median {machine['loadavg_1min_median'] or 0:.1f} and max {machine['loadavg_1min_max'] or 0:.1f} during the "
        f"run, {machine['loadavg_end'][0]:.1f} at the end. ETLs: {', '.join(report['etls'].values())}.", "",
        "| figure | value |", "|---|---|",
        f"| samples delivered | {s['delivered']:,}: {s['lost']} lost, {s['wrong']} wrong |",
        f"| reads | {r['reads']:,}: {r['whole']:,} whole ({r['recovered_reads']} of them continued after a "
        f"cut or an outage), {r['named_errors']} ended in an error naming the shard ({r['named_errors_etl_down']} "
        f"while its ETL was down or being killed; {s['withheld_named']} samples not delivered), "
        f"{r['unnamed_errors']} in an error not naming it |",
        f"| shards refused (hostile, each an error naming the shard) | {refused} |",
        f"| offline copies ({o['etl']}) | {o['copies']}: {', '.join(f'{k} {v}' for k, v in o['outcomes'].items())}; "
        f"objects whole {o['objects_whole']}, missing {o['objects_missing']}, stored cut {o['objects_cut']} (of "
        f"which lost, untold: {o['objects_lost']}), wrong {o['objects_wrong']} |",
        f"| pod kills | {len(kills)}, {sum(k['recovered'] for k in kills)} recovered; Aborted after "
        f"{_range(aborted)} s, Running again after {_range(running)} s (start included)"
        + (f"; pod processes left 15 s after a kill: {sum(left)}" if left else "") + " |",
        f"| ETL stage transitions | {len(report['stage_transitions'])} "
        f"({', '.join(sorted({f'{a}->{b}' for _, _, a, b in report['stage_transitions']}))}) |",
        f"| panics aisnode's HTTP server recovered from (a read dropped) | "
        f"{', '.join(f'{k} {v}' for k, v in report.get('aisnode_panics_recovered', {}).items()) or '-'} |",
        f"| /health while the ETL is up | {h['probes_while_up']:,} probes, {h['failures_while_up']} failed; p50 "
        f"{h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms |",
    ]
    lines += ["", "Idle readings at the quiet points (after warm-up, then every "
              f"{report['options']['quiet_every']:g} s, and at the end; growth from the first to the last):", "",
              "| process | quiet points | RSS MB | threads | fds |", "|---|---|---|---|---|"]
    processes = report["processes"]
    for ident in [*AISNODES, *sorted(k for k in processes if k not in AISNODES)]:
        p = processes.get(ident)
        if p is None:
            continue
        quiet = p["quiet"]
        if not p["assessed"]:
            lines.append(f"| {ident} | {len(quiet)} (not assessed: up for less than the warm-up, or one point) "
                         f"| peak {p['peak_rss_mb']} | peak {p['peak_threads']} | peak {p['peak_fds']} |")
            continue
        first, last = next(q for q in quiet if q["t"] == p["baseline_t"]), quiet[-1]
        lines.append(f"| {ident} | {len(quiet)} | {first['rss_mb']} -> {last['rss_mb']} ({p['rss_growth_mb']:+}) | "
                     f"{first['threads']} -> {last['threads']} (max {p['threads_growth']:+}) | "
                     f"{first['fds']} -> {last['fds']} (max {p['fds_growth']:+}) |")
    lines += ["", "| bound | held |", "|---|---|"]
    lines += [f"| {name} | {'yes' if held else '**no**'} |" for name, held in report["criteria"].items()]
    return "\n".join(lines) + "\n"


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 50):.1f} (median; {min(values):.1f}-{max(values):.1f})"


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(12, 13), sharex=True)
    colors = {"proxy": "#444444", "target1": "#2a7ab9", "target2": "#d1603d"}
    palette = ["#7f9f3f", "#9467bd", "#e6a100"]
    etl_colors = {etl: palette[i % len(palette)] for i, etl in enumerate(report["etls"].values())}
    for ident, p in report["processes"].items():
        series = p["series"]
        if not series:
            continue
        minutes = [t / 60 for t, *_ in series]
        if p["kind"] == "aisnode":
            style = {"color": colors.get(ident, "black"), "linewidth": 1.4, "label": ident}
            rss = axes[0]
        else:
            etl = next((e for e in etl_colors if ident.startswith(f"{e}-")), "")
            style = {"color": etl_colors.get(etl, "grey"), "linewidth": 0.8, "alpha": 0.8}
            rss = axes[1]
        for ax, column in zip((rss, axes[2], axes[3]), (1, 2, 3)):
            ax.plot(minutes, [row[column] for row in series], **style)
    for etl, color in etl_colors.items():
        axes[1].plot([], [], color=color, linewidth=0.8, label=f"pods of {etl}")
    axes[0].set_ylabel("aisnode RSS (MB)")
    axes[1].set_ylabel("pod RSS (MB)")
    axes[2].set_ylabel("threads")
    axes[3].set_ylabel("open fds")
    health = report["health"]["series"]
    minutes = [row[0] / 60 for row in health]
    axes[4].plot(minutes, [row[3] for row in health], color="#2a7ab9", linewidth=0.9, label="p99 per 10 s")
    axes[4].plot(minutes, [row[4] for row in health], color="#2a7ab9", linewidth=0.5, alpha=0.4, label="max")
    axes[4].legend(fontsize=7, loc="upper left")
    axes[4].axhline(report["options"]["bounds"]["health_p99_ms"], color="#d1603d", linestyle="--", linewidth=0.8)
    axes[4].set_yscale("log")
    axes[4].set_ylabel("GET /health (ms), ETL up")
    axes[4].set_xlabel("minutes")
    for ax in axes:
        for kill in report["kills"]:
            ax.axvline(kill["at"] / 60, color="#d1603d", linewidth=0.6, alpha=0.6)
        for quiet in report["quiet_points"]:
            ax.axvline(quiet["t"] / 60, color="#444444", linewidth=0.5, linestyle=":")
    axes[0].legend(fontsize=7, ncol=3, loc="upper left")
    axes[1].legend(fontsize=7, ncol=3, loc="lower right")
    fig.suptitle(f"{report.get('command', '')} ({report['started']}); red: pod kills, dotted: quiet points",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


REPORT = "results.json.gz"


def write_report(report: dict, folder: Path) -> None:
    """``results.json.gz`` (every figure and series), ``results.md`` and ``results.png`` under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1) + "\n"
    (folder / REPORT).write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    (folder / "results.md").write_text(markdown(report))
    write_plot(report, folder / "results.png")


def load_report(folder: Path) -> dict:
    """The report ``write_report`` kept in ``folder``."""
    return json.loads(gzip.decompress((folder / REPORT).read_bytes()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help=f"a soak's results folder (its {REPORT})")
    args = parser.parse_args(argv)
    sys.stdout.write(markdown(load_report(args.folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
