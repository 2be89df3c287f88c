"""The benchmark's summary table: one row per case, medians over rounds and percentiles over requests.

Shared by ``bench.run`` (which measures) and ``bench.report`` (which writes the tables and the plot), so
neither imports the other for it.
"""

from __future__ import annotations

from .stats import median, percentile

MODES = ("hpush-body", "hpush-fqn", "ws")


def summarize(results: dict) -> list[dict]:
    """One row per (system, preset, mode, concurrency, shard): medians over rounds, percentiles over requests."""
    groups: dict[tuple, list[dict]] = {}
    for row in results["measurements"]:
        key = (row["system"], row["preset"], row["mode"], row["concurrency"], row["shard"])
        groups.setdefault(key, []).append(row)
    limits = {}
    for row in results["compute"]:
        limits.setdefault(row["preset"], {})[row["round"]] = row["images_per_s"]
    table = []
    for (system, preset, mode, concurrency, shard), rows in groups.items():
        ttfb = [t for r in rows for t in r["ttfb_s"]]
        latency = [t for r in rows for t in r["latency_s"]]
        fractions = [r["images_per_s"] / limits[preset][r["round"]] for r in rows
                     if r["images_per_s"] and r["round"] in limits.get(preset, {}) and r["shard"] == "demo"]
        table.append({
            "system": system, "preset": preset, "mode": mode, "concurrency": concurrency, "shard": shard,
            "rounds": len(rows), "failed": sum(r["failed"] for r in rows),
            "images_per_s": median([r["images_per_s"] for r in rows]),
            "of_limit": median(fractions),
            "mb_in_per_s": median([r["mb_in_per_s"] for r in rows]),
            "mb_out_per_s": median([r["mb_out_per_s"] for r in rows]),
            "ttfb_ms_p50": _ms(percentile(ttfb, 50)), "latency_ms_p50": _ms(percentile(latency, 50)),
            "latency_ms_p99": _ms(percentile(latency, 99)), "peak_rss_mb": max(r["peak_rss"] for r in rows) / 2**20,
            "cpu_ms_per_image": median([r["cpu_ms_per_image"] for r in rows]),
            "client_cpu_ms_per_image": median([r["client_cpu_ms_per_image"] for r in rows]),
        })
    order = {"service": 0, "peer": 1}
    table.sort(key=lambda r: (r["preset"], r["shard"] != "demo", order[r["system"]], MODES.index(r["mode"]),
                              r["concurrency"]))
    return table


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
