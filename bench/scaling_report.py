"""bench.scaling's report: ``scaling.md`` and ``scaling.png`` from the result ``bench/scaling.py`` measured (its
``scaling.json``), and the figures' formatting. It reads the result alone, so a kept run renders again without
measuring."""

from __future__ import annotations

import statistics
from pathlib import Path


def _projected_cores(result: dict) -> list[int]:
    """The core counts the model projected to (bench.scaling's CORES), read back from the result."""
    return sorted({int(c) for values in result["model"]["projection"].values() for c in values})


def _median(cases: list[dict], key: str) -> float:
    values = [c[key] for c in cases if c[key] is not None]
    return statistics.median(values) if values else 0.0


def markdown(result: dict) -> str:
    machine = result["machine"]
    lines = [f"# The pod's cores\n\n`{result['command']}` at {result['commit']}, {result['date']}; "
             f"{machine['cpus']} CPUs ({machine['cpu']}), load average at the end "
             f"{', '.join(f'{x:.1f}' for x in machine['load_average'])}; {result['shards']['count']} shards of "
             f"{result['shards']['samples']} demo samples, imagenet-train, float32.\n"]
    if result["inflight"]:
        lines += ["## Shards in flight (hpush etl_fqn, ETL_WORKERS=2; medians over rounds)\n",
                  "| design | shards in flight | images/s | pod cores used | machine cores used | pod CPU ms/image |",
                  "|---|---|---|---|---|---|"]
        for design in dict.fromkeys(c["design"] for c in result["inflight"]):
            for count in sorted({c["inflight"] for c in result["inflight"]}):
                cases = [c for c in result["inflight"] if c["design"] == design and c["inflight"] == count]
                if cases:
                    lines.append(f"| {design} | {count} | {_median(cases, 'images_per_second'):,.0f} | "
                                 f"{_median(cases, 'cores_used'):.2f} | {_median(cases, 'machine_cores'):.2f} | "
                                 f"{_median(cases, 'cpu_ms_per_image'):.2f} |")
        lines += ["", "Pod CPU per image, processes over threads, per round (the two pods taken in turns):\n",
                  "| shards in flight | median | range | all rounds pooled | rounds |", "|---|---|---|---|---|"]
        for count, ratio in result["ratios"].items():
            pooled = f"{ratio['pooled']:.3f}" if "pooled" in ratio else ""
            lines.append(f"| {count} | {ratio['median']:.3f} | {ratio['min']:.3f}-{ratio['max']:.3f} | {pooled} | "
                         f"{', '.join(f'{r:.3f}' for r in ratio['rounds'])} |")
    if result["comms"]:
        lines += ["", f"## The server process's GIL by comm type ({result['comms'][0]['inflight']} shards in flight)\n",
                  "| design | comm | images/s | pod cores used | GIL share: server; workers | cores ceiling "
                  "(cores / server share) | server GIL time / pod CPU time |", "|---|---|---|---|---|---|---|"]
        for case in result["comms"]:
            shares = [p for p in case["per_process"] if p["role"] in ("server", "worker")]
            text = "; ".join(_pct(p["gil_share"]) for p in shares)
            share = case["server_gil_share"]
            fraction = share * case["wall"] / case["pod_cpu"] if share is not None and case["pod_cpu"] else None
            lines.append(f"| {case['design']} | {case['comm']} | {case['images_per_second']:,.0f} | "
                         f"{case['cores_used']:.2f} | {text} | {_num(case['ceiling'])} | {_frac(fraction)} |")
    one = result["one_shard"]
    if one:
        spread = one["spread_gil_ms_per_image"]
        lines += ["", "## One shard in flight (processes)\n",
                  f"{one['images_per_second']:,.0f} images/s on {one['cores_used']:.2f} cores of the pod; the worker "
                  f"processes held their GIL outside the transform threads (leading the shard: reading it, sending "
                  f"samples, writing the output) {_num(spread, 3)} ms per image: one shard stops at about "
                  f"{_num(1000 / spread) if spread else 'n/a'} images/s, however many cores."]
    memory_ = result["memory"]
    if memory_:
        lines += ["", "## Memory (MiB; USS: a process's own pages; PSS: the pod's share of all it maps)\n",
                  "| design | when | pod PSS | server USS | fork server USS | USS per worker |",
                  "|---|---|---|---|---|---|"]
        spec = memory_.get("spec")
        rows = {when: dict(memory_.get(when, {})) for when in ("idle", "load")}
        if spec:
            for when in ("idle", "load"):
                rows[when][f"the spec's pod ({spec['workers']} workers, {spec['processes']} processes)"] = spec[when]
        for when in ("idle", "load"):
            for design, found in rows[when].items():
                uss = found["uss"]
                workers = uss.get("worker", [])
                lines.append(f"| {design} | {'idle' if when == 'idle' else 'full load'} | "
                             f"{found['pss'] / 2**20:,.0f} | {sum(uss.get('server', [0])) / 2**20:,.0f} | "
                             f"{sum(uss.get('forkserver', [0])) / 2**20:,.0f} | "
                             + (f"{sum(workers) / len(workers) / 2**20:,.0f} |" if workers else "|"))
    if result["peer"]:
        lines += ["", "## The SDK peer (uvicorn --workers N)\n", "| workers | images/s | CPU ms/image |",
                  "|---|---|---|"]
        for case in result["peer"]:
            lines.append(f"| {case['workers']} | {case['images_per_second']:,.0f} | "
                         f"{case['cpu_ms_per_image']:.2f} |")
    if result.get("model"):
        found = result["model"]
        cores_projected = _projected_cores(result)
        bandwidth = found["memory"]["bandwidth"]
        lines += ["", "## The model\n",
                  f"Memory bandwidth (numpy copies, measured): {bandwidth.get('core', 0) / 1e9:.1f} GB/s for one core, "
                  f"{bandwidth.get('machine', 0) / 1e9:.1f} GB/s for all {machine['cpus']}; a node's taken as "
                  f"{bandwidth.get('node', 0) / 1e9:.0f} GB/s (an assumption, --node-bandwidth). An image moves about "
                  f"{found['memory']['bytes_per_image'] / 1e6:.1f} MB through memory (an estimate).\n",
                  "| design | images/s per core (measured) | server process bound | one-shard bound | "
                  f"memory bound at {cores_projected[-1]} cores |",
                  "|---|---|---|---|---|"]
        for design, bounds in found["bounds"].items():
            lines.append(f"| {design} | {bounds['per_core']:,.0f} | {_num(bounds['server'])} | "
                         f"{_num(bounds['one_shard'])} | {_num(bounds['memory'])} |")
        lines += ["", "Projected images/s (the least of the bounds; only the 2-core column's inputs are measured "
                  "here):\n", "| cores | " + " | ".join(found["projection"]) + " |",
                  "|---|" + "---|" * len(found["projection"])]
        for cores in cores_projected:
            lines.append(f"| {cores} | " + " | ".join(f"{p[str(cores)]:,.0f}" for p in found["projection"].values())
                         + " |")
    if result["sweep"]:
        lines += ["", "## Measured by worker count (hpush etl_fqn; 2 shards per worker in flight, or 1)\n",
                  "| design | workers | shards in flight | images/s | pod cores used | pod CPU ms/image | "
                  "pod PSS MiB | server GIL share | cores ceiling | images/s over workers x the 1-worker rate |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        base = {(r["design"], r["inflight"] > 1): r["images_per_second"] / r["workers"]
                for r in sorted(result["sweep"], key=lambda r: -r["workers"])}
        for row in result["sweep"]:
            first = base.get((row["design"], row["inflight"] > 1))
            efficiency = row["images_per_second"] / (first * row["workers"]) if first else None
            pss = row.get("pss_bytes")
            lines.append(f"| {row['design']} | {row['workers']} | {row['inflight']} | "
                         f"{row['images_per_second']:,.0f} | {row['cores_used']:.2f} | {row['cpu_ms_per_image']:.2f} | "
                         f"{_num(pss / 2**20 if pss else None)} | {_pct(row['server_gil_share'])} | "
                         f"{_num(row['ceiling'])} | {_num(efficiency, 2)} |")
    if result["starts"]:
        lines += ["", "## Start (the command to /health = 200)\n", "| service | workers | processes | seconds |",
                  "|---|---|---|---|"]
        for row in result["starts"]:
            processes = "default" if row["processes"] is None else row["processes"]
            lines.append(f"| {row['name']} | {row['workers']} | {processes} | {row['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for name, values in result["model"]["projection"].items():
        axis.plot(_projected_cores(result), [values[str(c)] for c in _projected_cores(result)], marker="o", label=name,
                  linestyle="--" if "one shard" in name else "-")
    for case in result["inflight"]:
        if case["inflight"] == max(c["inflight"] for c in result["inflight"]):
            axis.scatter([2], [case["images_per_second"]], color="black", zorder=5, s=12)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(_projected_cores(result), [str(c) for c in _projected_cores(result)])
    axis.set_xlabel("cores given to the pod")
    axis.set_ylabel("images/s (imagenet-train, float32)")
    axis.set_title("Measured on 2 cores (dots) and the model's projection")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return "unbounded" if value == float("inf") else f"{value:,.{digits}f}"


def _frac(value: float | None) -> str:
    return "n/a" if value is None else f"1/{1 / value:,.0f}" if value > 0 else "0"
