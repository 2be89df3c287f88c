"""The headline run's figures as README.md and docs/ show them: one renderer per generated section.

``make bench`` (bench/headline.py) writes each section between its markers from the newest headline run's
``results.json``, and tests/test_bench_headline.py fails when a section differs from what its run gives, so no
figure of the headline run is ever typed by hand. Every sentence here holds whatever the figures are: verdicts
(met, not met) and comparisons are computed, never written in advance. imagenet-train, float32 throughout.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from collections.abc import Callable
from pathlib import Path

from .stats import median
from .summary import summarize

PRESET = "imagenet-train"
WIDTH = 110  # prose lines; table rows are never wrapped


# ------------------------------------------------------------------------------------------------ formatting


def ms(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f} ms" if value < 10 else f"{value:,.0f} ms" if value < 1000 else f"{value / 1e3:.1f} s"


def seconds(value: float | None) -> str:
    """Milliseconds as seconds: two decimals under 10 s."""
    return "–" if value is None else f"{value / 1e3:.2f} s" if value < 10_000 else f"{value / 1e3:.1f} s"


def n(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def change(old: float | None, new: float | None) -> str:
    """``new`` against ``old`` as a signed percentage."""
    return "" if not old or new is None else f"{100 * (new / old - 1):+.0f}%"


def listing(items: list[str]) -> str:
    """'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    """'a to b' over ``values`` (one value: 'a')."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low} to {high}"


def prose(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)


# ---------------------------------------------------------------------------------------------- the run


class Run:
    """One headline run's results.json, asked for the figures the documents show."""

    def __init__(self, results: dict):
        self.results = results
        self.meta = results["meta"]
        self.workers = self.meta["settings"]["workers"]
        self.concurrency = self.meta["settings"]["concurrency"]
        self.table = [r for r in summarize(results) if r["preset"] == PRESET]
        self.limits = {r["round"]: r["images_per_s"] for r in self.stage("compute")}

    @classmethod
    def read(cls, folder: Path) -> Run:
        return cls(json.loads((folder / "results.json").read_text()))

    def stage(self, name: str) -> list[dict]:
        return [r for r in self.results.get(name, []) if r.get("preset", PRESET) == PRESET]

    def stage_median(self, name: str, key: str) -> float | None:
        return median([r[key] for r in self.stage(name)])

    def fraction(self, name: str) -> float | None:
        """Median over rounds of a stage's images/s over the same round's compute limit."""
        return median([s["images_per_s"] / self.limits[s["round"]] for s in self.stage(name)
                       if s["round"] in self.limits])

    def fractions_by_round(self, name: str) -> list[float]:
        return sorted(s["images_per_s"] / self.limits[s["round"]] for s in self.stage(name)
                      if s["round"] in self.limits)

    def case(self, system: str, mode: str, concurrency: int = 1, shard: str = "demo") -> dict | None:
        return next((r for r in self.table if r["system"] == system and r["mode"] == mode
                     and r["concurrency"] == concurrency and r["shard"] == shard), None)

    def by_round(self, system: str, mode: str, concurrency: int = 1) -> dict[int, float]:
        return {r["round"]: r["images_per_s"] for r in self.results["measurements"]
                if r["system"] == system and r["preset"] == PRESET and r["mode"] == mode
                and r["concurrency"] == concurrency and r["shard"] == "demo" and r["images_per_s"]}

    def over_peer(self, mode: str, concurrency: int = 1) -> float | None:
        """Median over rounds of this service's images/s over the conventional ETL's, same case and round."""
        ours, theirs = self.by_round("service", mode, concurrency), self.by_round("peer", mode, concurrency)
        return median([ours[k] / theirs[k] for k in ours if k in theirs])

    def limit_over_peer(self, mode: str, concurrency: int = 1) -> float | None:
        """Median over rounds of the compute limit's images/s over the conventional ETL's, same round."""
        theirs = self.by_round("peer", mode, concurrency)
        return median([self.limits[k] / theirs[k] for k in theirs if k in self.limits])

    def over_sent(self, mode: str) -> float | None:
        """Median over rounds of this service's images/s over the limit's loop with each .npy sent to curl."""
        sent = {r["round"]: r["images_per_s"] for r in self.stage("http_limit")}
        ours = self.by_round("service", mode)
        return median([ours[k] / sent[k] for k in ours if k in sent])

    def idle_rss_mb(self, server: str) -> float | None:
        idle = (self.results.get("servers", {}).get(server) or {}).get("idle_rss")
        return None if idle is None else idle / 2**20

    def cases(self) -> list[tuple[str, str, int]]:
        """(label, mode, concurrency) of the server cases the tables show, in their order."""
        return [("`etl_fqn`", "hpush-fqn", 1), ("body", "hpush-body", 1),
                (f"{self.concurrency} shards in flight", "hpush-fqn", self.concurrency), ("ws", "ws", 1)]


def loaded(machine: dict) -> bool:
    """Whether other jobs took the cores: a 1-minute load average at or above the CPUs, at the start or end."""
    start, end = machine.get("load_average_start") or [0.0], machine["load_average_end"]
    return max(start[0], end[0]) >= machine["cpus_usable"]


# ------------------------------------------------------------------------------------------- the sections

FULL_HEADER = ("| imagenet-train, float32 | images/s | of the compute limit | TTFB p50 | latency p50 / p99 per shard "
               "| peak RSS | server CPU ms/image |", "|---|---|---|---|---|---|---|")
# The README's lines stay within 120 characters: no latency column, no variants of the limit but the send.
SHORT_HEADER = ("| imagenet-train, float32 | images/s | of the limit | TTFB p50 | peak RSS | server CPU ms/image |",
                "|---|---|---|---|---|---|")


def table_rows(run: Run, full: bool) -> list[str]:
    """The headline table's rows: the limit and its variants, each server case, the client. ``full`` False drops
    the latency column and the limit's variants but the send to curl."""
    blank = " |" * (3 if full else 2)  # the empty cells between "of the limit" and the CPU column
    lines = [f"| compute limit ({run.workers} threads) | {n(run.stage_median('compute', 'images_per_s'))} | 100% "
             f"|{blank} {n(run.stage_median('compute', 'cpu_ms_per_image'), 2)} |"]
    variants = [("process_limit", f"the same work in {run.workers} processes (no GIL)"),
                ("http_limit", "the same, each `.npy` sent to curl (no tar, no server)"),
                ("engine", "engine without HTTP (`wds-transform apply`)")]
    for name, label in variants:
        if not run.stage(name) or (not full and name != "http_limit"):
            continue
        cpu = n(run.stage_median(name, "cpu_ms_per_image"), 2)
        if name == "http_limit":
            cpu += f" (+{n(run.stage_median(name, 'client_cpu_ms_per_image'), 2)} curl)"
        lines.append(f"| {label} | {n(run.stage_median(name, 'images_per_s'))} | {pct(run.fraction(name))} |"
                     f"{blank} {cpu} |")
    names = {"hpush-fqn": "hpush `etl_fqn`", "hpush-body": "hpush body", "ws": "ws (`fqn`)"}
    order = [("hpush-fqn", 1), ("hpush-body", 1), ("hpush-fqn", run.concurrency), ("ws", 1)]
    for system, who in (("service", "this service"), ("peer", "conventional ETL")):
        for mode, concurrency in order:
            r = run.case(system, mode, concurrency)
            if r is None:
                continue
            shards = f"{concurrency} shard{'s' if concurrency > 1 else ''}"
            failed = f" ({r['failed']} requests failed)" if r["failed"] else ""
            latency = f" {seconds(r['latency_ms_p50'])} / {seconds(r['latency_ms_p99'])} |" if full else ""
            lines.append(f"| {who}, {names[mode]}, {shards}{failed} | {n(r['images_per_s'])} | "
                         f"{pct(r['of_limit'])} | {ms(r['ttfb_ms_p50'])} |{latency} {n(r['peak_rss_mb'])} MB | "
                         f"{n(r['cpu_ms_per_image'], 2)} |")
    client = next((c for c in run.results["client"] if c["preset"] == PRESET
                   and c["reader"].startswith("client-side")), None)
    if client is not None:
        lines.append(f"| client-side decoding (WebLoader, {client['workers']} workers) | "
                     f"{n(client['samples_per_s'])} | |{blank} |")
    return lines


def command(meta: dict) -> str:
    """The run's command as the docs show it: without ``--out``, whose folder (an absolute path on the machine that
    measured, bench.headline's choice) the report's link names anyway."""
    words, shown = shlex.split(meta["command"]), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif not word.startswith("--out="):
            shown.append(word)
    return shlex.join(shown)


def table(run: Run, folder: str, link: str, full: bool) -> list[str]:
    """Where the figures come from (command, commit, date, duration, machine, load, report), then the table."""
    meta, machine = run.meta, run.meta["machine"]
    start, end = machine.get("load_average_start") or [None], machine["load_average_end"]
    source = (f"Measured by `{command(meta)}` at commit {meta['git']} on {meta['started']}, in "
              f"{meta['duration_s'] / 60:.1f} min: {machine['cpus_usable']} usable CPUs ({machine['cpu']}, GPU: "
              f"{machine['gpu'] or 'none'}), load average {start[0]} at the start and {end[0]} at the end (1 minute; "
              f"other jobs shared these cores), report [`{folder}/results.md`]({link}{folder}/results.md).")
    if loaded(machine):
        source += (" Taken under load (a load average at or above the CPUs): compare the ratios to the limit, "
                   "not the images/s.")
    return [*prose(source), "", *(FULL_HEADER if full else SHORT_HEADER), *table_rows(run, full)]


def summary(run: Run) -> list[str]:
    """The Results section's paragraph: fractions of the limit, multiples of the peer, CPU, the limit's spread."""
    cases = [(label, run.case("service", mode, c), run.over_peer(mode, c)) for label, mode, c in run.cases()]
    cases = [(label, row, over) for label, row, over in cases if row is not None]
    fractions = [row["of_limit"] for _, row, _ in cases if row["of_limit"] is not None]
    peers = [r["cpu_ms_per_image"] for r in run.table if r["system"] == "peer" and r["shard"] == "demo"
             and r["cpu_ms_per_image"] is not None]
    ours = [row["cpu_ms_per_image"] for _, row, _ in cases if row["cpu_ms_per_image"] is not None]
    multiples = listing([f"{times(over)} ({label})" for label, _, over in cases if over is not None])
    limits = [run.limits[k] for k in sorted(run.limits)]
    text = (f"In that run the service delivered {span(fractions, pct)} of the compute limit (the cases below, "
            f"medians over rounds), {multiples} the conventional ETL's images/s (medians of the per-round ratios), "
            f"at {span(ours, lambda v: f'{v:.2f}')} ms of server CPU per image against the conventional ETL's "
            f"{span(peers, lambda v: f'{v:.2f}')}.")
    if len(limits) > 1:
        text += (f" Its compute limit moved from round to round ({', '.join(n(v) for v in limits[:-1])} and "
                 f"{n(limits[-1])} images/s): read the ratios taken in the same round (the \"of the compute "
                 "limit\" column), not absolute images/s.")
    return prose(text)


def memory(run: Run) -> list[str]:
    """The memory case: a small and a large shard, each input mode on a fresh service."""
    rows = run.results["memory"]
    if not rows:
        return prose("The run left out the memory case (`--skip big`).")
    big = run.results["shards"]["big"]
    small = run.results["shards"]["small"]
    lines = [*prose("The same run's memory case, each input mode on a fresh service, the small shard first:"), "",
             f"| {big['bytes'] / 2**30:.2f} GiB vs {small['bytes'] / 1e6:.0f} MB shard (fresh service, "
             f"{PRESET}) | images/s | MB/s in / out | TTFB | peak RSS |", "|---|---|---|---|---|"]
    labels = {"hpush-fqn": "hpush `etl_fqn`", "hpush-body": "hpush body"}
    for m in rows:
        size = f"{m['bytes'] / 2**30:.2f} GiB" if m["shard"] == "big" else f"{m['bytes'] / 1e6:.0f} MB"
        measured = next((r for r in run.results["measurements"] if r["shard"] == m["shard"]
                         and r["mode"] == m["mode"] and r["system"] == "service"), None)
        flow = f"{measured['mb_in_per_s']:.0f} / {measured['mb_out_per_s']:.0f}" if measured else "–"
        lines.append(f"| {labels[m['mode']]}, {size} ({n(m['images'])} images) | {n(m['images_per_s'])} | {flow} | "
                     f"{ms(None if m['ttfb_s'] is None else m['ttfb_s'] * 1e3) or '–'} | "
                     f"{n(m['peak_rss'] / 2**20)} MB |")
    return lines


def client(run: Run) -> list[str]:
    """What the training loop receives: client-side decoding against reading the service's output."""
    raw = next((c for c in run.results["client"] if c["reader"].startswith("client-side") and c["preset"] == PRESET),
               None)
    live = {c["dtype"]: c for c in run.results["client"] if "live service" in c["reader"]}
    saved = {c["dtype"]: c for c in run.results["client"] if "saved output" in c["reader"]}
    if raw is None or not live or not saved:
        return prose("The run left out the training loop's readers (`--skip client`, or its time budget).")
    text = (f"What the training loop receives in the same run (samples/s, {raw['workers']} loader workers, "
            f"{PRESET}): client-side decoding {n(raw['samples_per_s'])}; `transformer.client` over the live service "
            f"on the same {run.meta['machine']['cpus_usable']} cores "
            + " and ".join(f"{n(c['samples_per_s'])} ({d})" for d, c in live.items())
            + "; the same loader over saved service output "
            + " and ".join(f"{n(c['samples_per_s'])} ({d}" + (f", {n(c['mb_per_s'])} MB/s)" if c.get("mb_per_s")
                                                               else ")") for d, c in saved.items())
            + ". The saved-output rows are what a training node gets when the transform runs on the storage nodes, "
              "which is the point of the ETL: on the same cores the loader delivers "
            + " and ".join(f"{c['samples_per_s'] / raw['samples_per_s']:.1f}x ({d})" for d, c in saved.items())
            + " the samples/s of client-side decoding in this run ([The training node]"
              "(#the-training-node-reading-etld-shards) has the loader's own figures).")
    return prose(text)


def previous(run: Run, folder: Path) -> list[str]:
    """This run against the one it replaced (``previous.json``, kept beside its report by bench.headline)."""
    path = folder / "previous.json"
    if not path.exists():
        return prose("No earlier headline run was replaced by this one, so there is nothing to compare it with.")
    old = Run(json.loads(path.read_text()))
    om, nm = old.meta, run.meta
    lines = prose(f"The headline run this one replaced is kept beside its report as `previous.json` (that run's "
                  f"`results.json`): `{command(om)}` at commit {om['git']} on {om['started']}, load average "
                  f"{(om['machine'].get('load_average_start') or ['–'])[0]} at the start and "
                  f"{om['machine']['load_average_end'][0]} at the end; its figures measure that commit's code. "
                  f"{PRESET}, float32; the last column is the change (in points for a fraction of the limit):")
    lines += ["", f"| | {om['git']} | {nm['git']} | change |", "|---|---|---|---|"]

    def row(label: str, get: Callable[[Run], float | None], fmt: Callable[[float | None], str]) -> None:
        before, after = get(old), get(run)
        moved = (f"{100 * (after - before):+.0f} points" if fmt is pct and None not in (before, after)
                 else change(before, after))
        lines.append(f"| {label} | {fmt(before)} | {fmt(after)} | {moved} |")

    def case(key: str, mode: str, concurrency: int = 1) -> Callable[[Run], float | None]:
        return lambda r: (r.case("service", mode, concurrency if concurrency == 1 else r.concurrency) or {}).get(key)

    row("compute limit, images/s (median of its rounds)", lambda r: r.stage_median("compute", "images_per_s"), n)
    for label, mode, concurrency in run.cases():
        row(f"this service, {label}: of the limit", case("of_limit", mode, concurrency), pct)
    row("this service, `etl_fqn`: server CPU ms/image", case("cpu_ms_per_image", "hpush-fqn"), lambda v: n(v, 2))
    row("this service, body: server CPU ms/image", case("cpu_ms_per_image", "hpush-body"), lambda v: n(v, 2))
    row("compute limit: CPU ms/image", lambda r: r.stage_median("compute", "cpu_ms_per_image"), lambda v: n(v, 2))
    row("conventional ETL, `etl_fqn`: CPU ms/image",
        lambda r: (r.case("peer", "hpush-fqn") or {}).get("cpu_ms_per_image"), lambda v: n(v, 2))
    row("this service: idle RSS, MB", lambda r: r.idle_rss_mb("service"), n)
    row("this service, `etl_fqn`: peak RSS, MB", case("peak_rss_mb", "hpush-fqn"), n)
    row("conventional ETL: idle RSS, MB", lambda r: r.idle_rss_mb("peer"), n)
    row("this service, `etl_fqn`: TTFB p50, ms", case("ttfb_ms_p50", "hpush-fqn"), lambda v: n(v, 1))
    row("this service over the conventional ETL, `etl_fqn`", lambda r: r.over_peer("hpush-fqn"), times)
    row("this service over the conventional ETL, body", lambda r: r.over_peer("hpush-body"), times)
    return lines


def targets(run: Run) -> list[str]:
    """The Targets table: each target, met or not, with the figures that say why."""
    c = run.concurrency
    lines = ["| target | result |", "|---|---|"]
    rows = [(label, run.case("service", mode, conc)) for label, mode, conc in run.cases()]
    rows = [(label, r) for label, r in rows if r is not None and r["of_limit"] is not None]
    if rows:
        low = min(r["of_limit"] for _, r in rows)
        listed = ", ".join(f"{label} {pct(r['of_limit'])}" for label, r in rows)
        verdict = "**90%: met**" if low >= 0.9 else "**90%: not met**"
        eighty = ("**80%: met** in every case" if low >= 0.8 else
                  "**80%: not met** by " + ", ".join(label for label, r in rows if r["of_limit"] < 0.8))
        sent, by_round = run.fraction("http_limit"), run.fractions_by_round("http_limit")
        detail = ""
        if sent is not None:
            detail = (f" The compute limit's own loop with nothing added but each array sent to curl reached "
                      f"{pct(sent)} of the limit ({pct(by_round[0])}-{pct(by_round[-1])} by round; over 100% in a "
                      f"round where the limit's own pass was the one slowed), and the service delivered "
                      f"{pct(run.over_sent('hpush-fqn'))} (`etl_fqn`) and {pct(run.over_sent('hpush-body'))} (body) "
                      "of what that loop delivered in the same rounds")
            detail += (", so 90% is out of reach here for any HTTP service whose client shares the cores."
                       if sent < 0.9 else ".")
        lines.append(f"| hpush {PRESET} float32 >= 90% of the compute limit (80% at least) | {verdict}: {listed}; "
                     f"{eighty}.{detail} |")
    multiples = [(label, run.over_peer(mode, conc)) for label, mode, conc in run.cases()]
    multiples = [(label, m) for label, m in multiples if m is not None]
    if multiples:
        met = [label for label, m in multiples if m >= 4]
        verdict = ("**met**" if len(met) == len(multiples) else "**not met**" if not met else
                   f"**met** for {', '.join(met)} only")
        premise1, premise_c = run.limit_over_peer("hpush-fqn"), run.limit_over_peer("hpush-fqn", c)
        peer_case = run.case("peer", "hpush-fqn", c)
        peers = [r["cpu_ms_per_image"] for r in run.table if r["system"] == "peer" and r["shard"] == "demo"
                 and r["cpu_ms_per_image"] is not None]
        text = f"{verdict}: " + ", ".join(f"{label} {times(m)}" for label, m in multiples) + " (medians of the " \
               "per-round ratios)."
        if premise1 is not None and premise_c is not None:
            text += (f" In the same rounds the compute limit itself is {times(premise1)} the conventional ETL with 1 "
                     f"shard in flight and {times(premise_c)} with {c}"
                     + (f" (where the peer's {run.workers} workers reach {pct(peer_case['of_limit'])} of the limit)"
                        if peer_case and peer_case["of_limit"] else "")
                     + f", so with 1 shard 4x needs {pct(4 / premise1)} of the limit"
                     + (f", and with {c} it is out of reach." if premise_c < 4 else "."))
        if peers:
            text += (f" The conventional ETL costs {span(peers, lambda v: f'{v:.2f}')} ms of CPU per image against "
                     f"the limit's {n(run.stage_median('compute', 'cpu_ms_per_image'), 2)} (PIL decode, PIL resize, "
                     "ToTensor, two copies of the whole output).")
        lines.append(f"| >= 4x the conventional ETL's images/s | {text} |")
    ratios = []
    for label, mode, conc in run.cases():
        ours, theirs = run.case("service", mode, conc), run.case("peer", mode, conc)
        if ours and theirs:
            ratios.append((label, ours["peak_rss_mb"], theirs["peak_rss_mb"]))
    if ratios:
        met = [f"{label} ({n(a)} vs {n(b)} MB, {a / b:.2f})" for label, a, b in ratios if a / b < 1 / 3]
        missed = [f"{label} ({n(a)} vs {n(b)} MB, {a / b:.2f})" for label, a, b in ratios if a / b >= 1 / 3]
        parts = ([f"**met** with {', '.join(met)}"] if met else []) + (
            [f"**missed** with {', '.join(missed)}"] if missed else [])
        idle, fqn = run.idle_rss_mb("service"), run.case("service", "hpush-fqn")
        text = "; ".join(parts) + "."
        if idle is not None and fqn is not None:
            text += (f" The service's working set is about {n(fqn['peak_rss_mb'] - idle)} MB over {n(idle)} MB idle; "
                     "most of the idle part is importing PyPI's CUDA build of torch and torchvision (an estimate: "
                     "measured with psutil after each import, not kept). The conventional ETL pays the same import "
                     f"once per worker, so with {run.workers} workers the ratio cannot fall much below (idle + working "
                     f"set) / ({run.workers} x idle + its buffers).")
        lines.append(f"| < 1/3 of its peak RSS | {text} |")
    single = run.stage_median("single_thread", "ms_per_image")
    ttfb = [(label, run.case("service", mode)) for label, mode in (("`etl_fqn`", "hpush-fqn"), ("body", "hpush-body"),
                                                                   ("ws", "ws"))]
    ttfb = [(label, r["ttfb_ms_p50"]) for label, r in ttfb if r and r["ttfb_ms_p50"] is not None]
    if single is not None and ttfb:
        bound = 50 + single
        met = all(value < bound for _, value in ttfb)
        fresh = [m["ttfb_s"] * 1e3 for m in run.results["memory"] if m["ttfb_s"] is not None]
        text = (f"{'**met**' if met else '**not met**'}: p50 " + ", ".join(f"{ms(v)} ({label})" for label, v in ttfb)
                + (f"; {span(fresh, ms)} on the fresh-service memory runs" if fresh else "") + ".")
        lines.append(f"| TTFB < 50 ms + one sample's transform ({single:.1f} ms) | {text} |")
    growth = []
    for mode, label in (("hpush-fqn", "`etl_fqn`"), ("hpush-body", "body")):
        small = next((m for m in run.results["memory"] if m["mode"] == mode and m["shard"] == "small"), None)
        big = next((m for m in run.results["memory"] if m["mode"] == mode and m["shard"] == "big"), None)
        if small and big:
            growth.append((label, (big["peak_rss"] - small["peak_rss"]) / 2**20, big["bytes"], small["bytes"]))
    if growth:
        met = all(delta < 100 for _, delta, _, _ in growth)
        text = (f"{'**met**' if met else '**not met**'}: "
                + ", ".join(f"{delta:+.0f} MB ({label})" for label, delta, _, _ in growth) + ".")
        peer, idle = run.case("peer", "hpush-fqn"), run.idle_rss_mb("peer")
        demo = run.results["shards"]["demo"][0]["bytes"]
        if peer and idle is not None:
            per_byte = (peer["peak_rss_mb"] - idle) * 2**20 / demo
            text += (f" The conventional ETL would need about {per_byte * growth[0][2] / 2**30:.0f} GiB more for the "
                     f"large shard (it grew {n(peer['peak_rss_mb'] - idle)} MB for a {demo / 1e6:.0f} MB shard: "
                     f"{per_byte:.1f} bytes per input byte).")
        lines.append(f"| peak RSS, {growth[0][2] / 2**30:.2f} GiB shard within 100 MB of a {growth[0][3] / 1e6:.0f} MB "
                     f"shard | {text} |")
    lines.append("| compute limit as high as this CPU allows | the decoder, the resize kernels and the float math are "
                 "the fastest this CPU offers for exact output ([Decoder and resize]"
                 "(design-decoding.md#decoder-and-resize)); crops decode only what they need ([Partial decoding]"
                 "(design-decoding.md#partial-jpeg-decoding-crop_decode)). |")
    return lines


def gap(run: Run) -> list[str]:
    """Where the gap to the limit comes from: CPU per image stage by stage, and the bound each leaves."""
    compute = run.stage_median("compute", "cpu_ms_per_image")
    if compute is None:
        return prose("The run has no compute limit to compare with.")
    lines = prose(f"CPU per image, {PRESET}, float32, 1 shard in flight: medians of the run's rounds. On "
                  f"{run.workers} busy cores throughput is {run.workers} / (CPU per image), so the ratio bounds the "
                  "fraction of the limit reachable:")
    lines += ["", "| stage | CPU ms/image | bound |", "|---|---|---|",
              f"| compute limit: decode, v2 transforms, `.npy` | {compute:.2f} | 100% |"]
    process, curl = run.stage_median("http_limit", "cpu_ms_per_image"), run.stage_median("http_limit",
                                                                                          "client_cpu_ms_per_image")
    if process is not None and curl is not None:
        lines.append(f"| the same, each `.npy` sent to curl (process {process:.2f} + curl {curl:.2f}) | "
                     f"{process + curl:.2f} | {pct(compute / (process + curl))} |")
    engine = run.stage_median("engine", "cpu_ms_per_image")
    if engine is not None:
        lines.append(f"| + tar read and write, ordered window (engine, no HTTP) | {engine:.2f} | "
                     f"{pct(compute / engine)} |")
    fqn = run.case("service", "hpush-fqn")
    if fqn and fqn["cpu_ms_per_image"]:
        server, client_cpu = fqn["cpu_ms_per_image"], fqn["client_cpu_ms_per_image"] or 0.0
        lines.append(f"| service, hpush `etl_fqn`: + HTTP, 602 KB socket write per image | {server:.2f} | "
                     f"{pct(compute / server)} |")
        lines.append(f"| + curl receiving on the same cores | {server + client_cpu:.2f} | "
                     f"{pct(compute / (server + client_cpu))} |")
    for mode, label in (("hpush-body", "service, hpush body (+ receiving 100 KB per image)"),
                        ("ws", "service, ws (`fqn`)")):
        r = run.case("service", mode)
        if r and r["cpu_ms_per_image"]:
            client_cpu = r["client_cpu_ms_per_image"] or 0.0
            lines.append(f"| {label} | {r['cpu_ms_per_image']:.2f} (+{client_cpu:.2f} client) | "
                         f"{pct(compute / (r['cpu_ms_per_image'] + client_cpu))} |")
    floors = run.results.get("http_floor") or []
    send = median([f["server_cpu_ms_per_image"] for f in floors])
    receive = median([f["client_cpu_ms_per_image"] for f in floors])
    if send is not None and receive is not None and engine is not None:
        floor = engine + send + receive
        lines.append(f"| floor: 602 KB frames to curl with no compute (kernel send {send:.2f}, curl {receive:.2f}), "
                     f"added to the engine | {floor:.2f} | {pct(compute / floor)} |")
    sent, by_round = run.fraction("http_limit"), run.fractions_by_round("http_limit")
    if None not in (sent, send, receive, process) and fqn and fqn["cpu_ms_per_image"]:
        lines += ["", *prose(
            f"`bench.compute.http_limit` runs the compute limit's loop and writes each image's array, in order, with "
            f"`sendmsg` to curl on the same cores (no tar, no request, no event loop): it landed at {pct(sent)} of "
            f"the limit in this run ({pct(by_round[0])}-{pct(by_round[-1])} by round). Sending float32 arrays (six "
            f"times the input bytes) through loopback TCP costs about {send + receive:.2f} ms of kernel copying per "
            f"image (send {send:.2f}, receive {receive:.2f}) against {compute:.2f} ms of compute. The service, its "
            f"own parts on top (tar, ordered window, HTTP framing), costs {fqn['cpu_ms_per_image']:.2f} ms of CPU per "
            f"image (`etl_fqn`), {change(process, fqn['cpu_ms_per_image']) or '+0%'} against that loop's "
            f"{process:.2f}.")]
    return lines


def uint8(run: Run) -> list[str]:
    """uint8 output: the service against the uint8 compute limit, and the loader over saved uint8 output."""
    u = run.results.get("uint8") or []
    if not u:
        return prose("The run left out the uint8 case (its time budget).")
    fraction = median([r["service_images_per_s"] / r["compute_images_per_s"] for r in u if r["service_images_per_s"]])
    saved = {c["dtype"]: c for c in run.results["client"] if "saved output" in c["reader"]}
    text = (f"In the headline run hpush `etl_fqn` reaches {pct(fraction)} of the uint8 compute limit "
            f"({n(median([r['service_images_per_s'] for r in u]))} of "
            f"{n(median([r['compute_images_per_s'] for r in u]))} images/s)")
    if "uint8" in saved and "float32" in saved:
        text += (f", and a loader reading saved uint8 output delivers {n(saved['uint8']['samples_per_s'])} samples/s "
                 f"against {n(saved['float32']['samples_per_s'])} for float32")
    return prose(text + " (both in the run's report, linked above its table under [Results](performance.md#results)).")


# bench.compute's option names -> the table's, in the table's order.
DECODERS = {
    "torchvision decode_jpeg (libjpeg-turbo)": "torchvision `decode_jpeg` (libjpeg-turbo), the service's decoder",
    "simplejpeg": "simplejpeg",
    "simplejpeg fastdct+fastupsample": "simplejpeg `fastdct` + `fastupsample`",
    "PIL open+convert": "PIL",
    "PIL + draft (DCT downscale to >= 256)": "PIL + `draft` (DCT downscale keeping >= 256)",
    "PIL decode + PIL bilinear resize + crop (v1 path)": "PIL decode + PIL bilinear resize (the v1 path)",
}


def decoders(run: Run) -> list[str]:
    """The decoder case: each decode option's time, with the val resize, and its error against torchvision's."""
    rows = run.results.get("decoders") or []
    if not rows:
        return prose("The run left out the decoder case (`--skip decoders`).")
    first = rows[0]
    lines = prose(f"`bench.run`'s decoder case (1 thread, {first['images']} demo JPEGs, median {first['median_size']}, "
                  f"{first['mean_bytes'] / 1e3:.0f} KB, thread CPU time, taking turns; `--skip decoders` leaves it "
                  "out), from the headline run. Error: mean absolute difference of the imagenet-val output against "
                  "torchvision's reference, in normalized units.")
    lines += ["", "| option | decode ms | decode + val resize/crop ms | error | pixels |", "|---|---|---|---|---|"]
    order = sorted(rows, key=lambda d: list(DECODERS).index(d["option"]) if d["option"] in DECODERS else len(DECODERS))
    for d in order:
        decode = "" if d["decode_ms"] is None else f" {d['decode_ms']:.3f}"
        error = "0" if d["mae"] == 0 else f"{d['mae']:.3f}"
        lines.append(f"| {DECODERS.get(d['option'], d['option'])} |{decode} | {d['val_uint8_ms']:.3f} | {error} | "
                     f"{'identical' if d['exact'] else 'differ'} |")
    by = {d["option"]: d for d in rows}
    tv, sj = by.get("torchvision decode_jpeg (libjpeg-turbo)"), by.get("simplejpeg")
    v1, pil = by.get("PIL decode + PIL bilinear resize + crop (v1 path)"), by.get("PIL open+convert")
    text = []
    if tv and sj:
        faster = 1 - sj["decode_ms"] / tv["decode_ms"]
        text.append(f"simplejpeg decoded {abs(100 * faster):.0f}% {'faster' if faster >= 0 else 'slower'} than "
                    f"torchvision's decoder in this run ({abs(tv['decode_ms'] - sj['decode_ms']):.2f} ms per image; "
                    f"{abs(100 * (1 - sj['val_uint8_ms'] / tv['val_uint8_ms'])):.0f}% with the resize), against the "
                    f"compute limit's {n(run.stage_median('compute', 'cpu_ms_per_image'), 2)} ms of CPU per image.")
    if tv and v1 and pil:
        text.append(f"The resize, torch's uint8 antialiased kernel via v2, took about "
                    f"{tv['val_uint8_ms'] - tv['decode_ms']:.2f} ms against PIL's "
                    f"{v1['val_uint8_ms'] - pil['decode_ms']:.2f} ms for the same filter (estimates: the table's two "
                    "columns subtracted).")
    return [*lines, "", *prose(" ".join(text))] if text else lines


# The generated sections, by the name their markers give; each renders from (run, its folder, the document).
SECTIONS: dict[str, Callable[[Run, Path, str, str, bool], list[str]]] = {
    "table": lambda run, folder, relative, link, full: table(run, relative, link, full),
    "summary": lambda run, folder, relative, link, full: summary(run),
    "memory": lambda run, folder, relative, link, full: memory(run),
    "client": lambda run, folder, relative, link, full: client(run),
    "previous": lambda run, folder, relative, link, full: previous(run, folder),
    "targets": lambda run, folder, relative, link, full: targets(run),
    "gap": lambda run, folder, relative, link, full: gap(run),
    "uint8": lambda run, folder, relative, link, full: uint8(run),
    "decoders": lambda run, folder, relative, link, full: decoders(run),
}
