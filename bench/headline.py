"""The headline benchmark, re-measured at HEAD by one command: ``make bench`` (``python -m bench.headline``).

It runs ``python -m bench.run`` at the size below (a few minutes on 2 cores) into a folder named for the
run's start and commit, ``bench/results/headline/<date>-<time>-<commit>/``, whose report records the
commit, the date, the machine's CPUs and the load average at the start and the end; then it rewrites the
headline tables of README.md and docs/performance.md from the newest such run, and removes the older runs
(one run is kept; git keeps the ones before it). tests/test_docs.py fails
when a table differs from what its run's ``results.json`` gives.

    python -m bench.headline            # measure, then rewrite the tables
    python -m bench.headline --docs     # only rewrite the tables from the newest run
    python -m bench.headline --check    # exit 1, naming the file, when a table is not its run's
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

from . import report, run
from .stats import median
from .summary import summarize

REPO = Path(__file__).resolve().parents[1]
ROOT = run.HEADLINE_ROOT
# imagenet-train only (the tables show it alone), 3 rounds: about 5 minutes on 2 quiet cores.
ARGS = ("--presets", "imagenet-train", "--rounds", "3", "--budget", "900")
README = REPO / "README.md"
PERFORMANCE = REPO / "docs" / "performance.md"
BEGIN = re.compile(r"<!-- headline table: (\S+) \(bench\.headline writes it\) -->\n")
END = "<!-- end of the headline table -->"


def _ms(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f} ms" if value < 10 else f"{value:,.0f} ms" if value < 1000 else f"{value / 1e3:.1f} s"


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e3:.2f} s" if value < 10_000 else f"{value / 1e3:.1f} s"


def _n(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _fraction(stage: list[dict], limits: dict[int, float]) -> float | None:
    """Median over rounds of a stage's images/s over the same round's compute limit."""
    return median([s["images_per_s"] / limits[s["round"]] for s in stage if s["round"] in limits])


FULL_HEADER = ("| imagenet-train, float32 | images/s | of the compute limit | TTFB p50 | latency p50 / p99 per shard "
               "| peak RSS | server CPU ms/image |", "|---|---|---|---|---|---|---|")
# The README's lines stay within 120 characters: no latency column, no variants of the limit but the send.
SHORT_HEADER = ("| imagenet-train, float32 | images/s | of the limit | TTFB p50 | peak RSS | server CPU ms/image |",
                "|---|---|---|---|---|---|")


def rows(results: dict, full: bool) -> list[str]:
    """The table's rows, imagenet-train, float32: the limit and its variants, each server case, the client.
    ``full`` False drops the latency column and the limit's variants but the send to curl."""
    preset = "imagenet-train"
    workers = results["meta"]["settings"]["workers"]
    compute = [r for r in results["compute"] if r["preset"] == preset]
    limits = {r["round"]: r["images_per_s"] for r in compute}

    def stage(name: str) -> list[dict]:
        return [r for r in results.get(name, []) if r["preset"] == preset]

    blank = " |" * (3 if full else 2)  # the empty cells between "of the limit" and the CPU column
    lines = [f"| compute limit ({workers} threads) | {_n(median([r['images_per_s'] for r in compute]))} | 100% "
             f"|{blank} {_n(median([r['cpu_ms_per_image'] for r in compute]), 2)} |"]
    variants = [("process_limit", f"the same work in {workers} processes (no GIL)"),
                ("http_limit", "the same, each `.npy` sent to curl (no tar, no server)"),
                ("engine", "engine without HTTP (`wds-transform apply`)")]
    for name, label in variants:
        found = stage(name)
        if not found or (not full and name != "http_limit"):
            continue
        cpu = _n(median([r["cpu_ms_per_image"] for r in found]), 2)
        if name == "http_limit":
            cpu += f" (+{_n(median([r['client_cpu_ms_per_image'] for r in found]), 2)} curl)"
        lines.append(f"| {label} | {_n(median([r['images_per_s'] for r in found]))} | "
                     f"{_pct(_fraction(found, limits))} |{blank} {cpu} |")
    names = {"hpush-fqn": "hpush `etl_fqn`", "hpush-body": "hpush body", "ws": "ws (`fqn`)"}
    table = [r for r in summarize(results) if r["preset"] == preset and r["shard"] == "demo"]
    order = [("hpush-fqn", 1), ("hpush-body", 1), ("hpush-fqn", results["meta"]["settings"]["concurrency"]),
             ("ws", 1)]
    for system, who in (("service", "this service"), ("peer", "conventional ETL")):
        for mode, concurrency in order:
            r = next((r for r in table if r["system"] == system and r["mode"] == mode
                      and r["concurrency"] == concurrency), None)
            if r is None:
                continue
            shards = f"{concurrency} shard{'s' if concurrency > 1 else ''}"
            failed = f" ({r['failed']} requests failed)" if r["failed"] else ""
            latency = f" {_s(r['latency_ms_p50'])} / {_s(r['latency_ms_p99'])} |" if full else ""
            lines.append(f"| {who}, {names[mode]}, {shards}{failed} | {_n(r['images_per_s'])} | "
                         f"{_pct(r['of_limit'])} | {_ms(r['ttfb_ms_p50'])} |{latency} {_n(r['peak_rss_mb'])} MB | "
                         f"{_n(r['cpu_ms_per_image'], 2)} |")
    client = next((c for c in results["client"] if c["preset"] == preset
                   and c["reader"].startswith("client-side")), None)
    if client is not None:
        lines.append(f"| client-side decoding (WebLoader, {client['workers']} workers) | "
                     f"{_n(client['samples_per_s'])} | |{blank} |")
    return lines


def loaded(machine: dict) -> bool:
    """Whether other jobs took the cores: a 1-minute load average at or above the CPUs, at the start or end."""
    start, end = machine.get("load_average_start") or [0.0], machine["load_average_end"]
    return max(start[0], end[0]) >= machine["cpus_usable"]


def block(folder: Path, doc: Path) -> str:
    """The generated part of ``doc``: where the figures come from, then the table."""
    results = json.loads((folder / "results.json").read_text())
    meta = results["meta"]
    machine = meta["machine"]
    relative = folder.relative_to(REPO).as_posix()
    link = Path("../" * len(doc.relative_to(REPO).parts[:-1])).as_posix() + "/" if doc.parent != REPO else ""
    start, end = machine.get("load_average_start") or [None], machine["load_average_end"]
    source = (f"Measured by `{meta['command']}` at commit {meta['git']} on {meta['started']}: "
              f"{machine['cpus_usable']} usable CPUs ({machine['cpu']}, GPU: {machine['gpu'] or 'none'}), load "
              f"average {start[0]} at the start and {end[0]} at the end (1 minute; other jobs shared these "
              f"cores), report [`{relative}/results.md`]({link}{relative}/results.md).")
    if loaded(machine):
        source += (" Taken under load (a load average at or above the CPUs): compare the ratios to the limit, "
                   "not the images/s.")
    full = doc != README
    marker = f"<!-- headline table: {relative}/results.json (bench.headline writes it) -->"
    return "\n".join([marker, *textwrap.wrap(source, 110, break_on_hyphens=False, break_long_words=False),
                      "", *(FULL_HEADER if full else SHORT_HEADER), *rows(results, full), END])


def current(doc: Path, text: str | None = None) -> tuple[Path, str]:
    """The run ``doc``'s table names, and the generated part as it stands in ``doc`` (or in ``text``)."""
    text = doc.read_text() if text is None else text
    found = BEGIN.search(text)
    if found is None or END not in text[found.end():]:
        raise ValueError(f"{doc.relative_to(REPO)}: no headline table between '<!-- headline table: ...' "
                         f"and '{END}'")
    stop = text.index(END, found.end()) + len(END)
    return REPO / Path(found.group(1)).parent, text[found.start():stop]


def problems(doc: Path, newest: Path, text: str | None = None) -> list[str]:
    """Why ``doc``'s table (or ``text``'s, read as that doc) is not what the run ``newest`` gives."""
    folder, generated = current(doc, text)
    name = doc.relative_to(REPO)
    if folder != newest:
        return [f"{name}: its table is from {folder.relative_to(REPO)}, the newest run is "
                f"{newest.relative_to(REPO)} (python -m bench.headline --docs)"]
    if generated != block(folder, doc):
        return [f"{name}: its table differs from {folder.relative_to(REPO)}/results.json "
                "(python -m bench.headline --docs)"]
    return []


def stale(docs: tuple[Path, ...] = (README, PERFORMANCE)) -> list[str]:
    """Each doc whose table is not what the newest run gives, and why."""
    newest = report.newest_run(ROOT)
    return [problem for doc in docs for problem in problems(doc, newest)]


def write_docs(docs: tuple[Path, ...] = (README, PERFORMANCE)) -> None:
    newest = report.newest_run(ROOT)
    for doc in docs:
        _, text = current(doc)
        doc.write_text(doc.read_text().replace(text, block(newest, doc)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true", help="only rewrite the tables from the newest run")
    parser.add_argument("--check", action="store_true", help="only check the tables against their runs")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if not args.docs:
        done = run.main(list(ARGS))
        if done != 0:
            return done
    write_docs()
    newest = report.newest_run(ROOT)
    print(f"tables rewritten from {newest.relative_to(REPO)}", file=sys.stderr)
    if not args.docs:
        for older in replace_older(ROOT, newest):
            print(f"{older.relative_to(REPO)} removed: one run is kept, git keeps the older ones", file=sys.stderr)
    return 0


def replace_older(root: Path, newest: Path) -> list[Path]:
    """Remove every run under ``root`` but ``newest`` (bench/results keeps one run of an experiment); the removed."""
    removed = [run_dir for run_dir in sorted(root.iterdir()) if run_dir.is_dir() and run_dir != newest]
    for run_dir in removed:
        shutil.rmtree(run_dir)
    return removed


if __name__ == "__main__":
    sys.exit(main())
