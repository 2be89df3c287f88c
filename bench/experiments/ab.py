"""Two versions of the service side by side: ``python -m bench.experiments.ab --base REV`` (or ``--a``/``--b`` trees).

Each round sends the same shards (hpush with ``etl_fqn``, one at a time, as AIS sends an inline read)
to version A, then to version B, alternating which goes first, so both see the same load on a shared
machine. Per version and round: images/s, server CPU ms per image, and the server's peak RSS; the
report gives medians with min-max over rounds and B/A round by round, whose spread is the noise a
difference must exceed.

``--base REV`` checks REV out in a temporary git worktree as A and uses this checkout as B;
``--a . --b-env ETL_CROP_DECODE=false`` compares one version with itself under two settings, and ``--a . --b-plant
loop-send`` under two designs that are no setting of the pod (``testbed/planted.py``: every chunk sent by the
event loop, not by the shard's thread).

Decided: the end marker costs nothing measurable (``bench/results/ab-end-marker/``, docs/design.md
"The end marker"), and the output path keeps direct send and the finishing transform thread writing
(``bench/results/ab-output-owner/``, docs/design.md "Who writes the output").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench import data, services
from bench.report import finish
from bench.stamp import stamp, stamp_line
from bench.stats import median
from testbed.planted import PLANTS, planted

log = logging.getLogger("bench")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="git revision to measure as A (checked out in a temporary worktree)")
    parser.add_argument("--a", type=Path, help="source tree of version A (instead of --base)")
    parser.add_argument("--b", type=Path, default=services.REPO_ROOT, help="source tree of version B (default: here)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200, help="samples per demo shard")
    parser.add_argument("--preset", default="imagenet-train")
    parser.add_argument("--workers", type=int, default=None, help="service threads (default: usable CPUs)")
    parser.add_argument("--work", type=Path, help="folder for shards and logs (default: temporary)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for version A only (repeatable), e.g. ETL_CROP_DECODE=false")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for version B only (repeatable)")
    for version in ("a", "b"):
        parser.add_argument(f"--{version}-plant", choices=PLANTS, help=f"code planted in version {version.upper()}'s "
                            "processes (testbed/planted.py), e.g. loop-send")
    args = parser.parse_args(argv)
    if (args.base is None) == (args.a is None):
        parser.error("give exactly one of --base and --a")
    for option in (*args.a_env, *args.b_env):
        if "=" not in option:
            parser.error(f"{option!r}: expected NAME=VALUE")
    return args


@contextlib.contextmanager
def worktree(revision: str):
    folder = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), revision], cwd=services.REPO_ROOT,
                   check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=services.REPO_ROOT,
                       capture_output=True)


def measure(server: services.Server, shards: list[data.Shard], etl_args: str) -> dict:
    server.rss.reset()
    cpu = server.cpu_seconds()
    start = time.monotonic()
    for shard in shards:
        result = services.hpush(server.url, shard.object_path, shard.path, "fqn", etl_args, timeout=600)
        if not result.ok:
            raise RuntimeError(f"{server.name}: {result.error}\n{server.log_tail()}")
    wall = time.monotonic() - start
    images = sum(s.images for s in shards)
    return {"images_per_s": images / wall, "cpu_ms_per_image": (server.cpu_seconds() - cpu) * 1000 / images,
            "peak_rss_mb": server.rss.peak() / 2**20}


def run(a: Path, b: Path, args: argparse.Namespace, work: Path) -> dict:
    from transformer.config import available_cpus

    started = stamp()
    workers = args.workers or available_cpus()
    shards = data.demo_shards(work, args.shards, args.samples)
    etl_args = json.dumps({"preset": args.preset})
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    versions = {"A": a, "B": b}
    envs = {"A": dict(o.split("=", 1) for o in args.a_env), "B": dict(o.split("=", 1) for o in args.b_env)}
    for name, plant in (("A", args.a_plant), ("B", args.b_plant)):
        if plant:  # the plant's folder first, then the version's tree (start_service's PYTHONPATH)
            envs[name].update(planted(work / f"plant-{name}", plant))
            envs[name]["PYTHONPATH"] = os.pathsep.join([str(work / f"plant-{name}"), str(versions[name])])
    servers = {name: services.start_service(logs, work / "mp", workers, extra_env=envs[name], name=f"service-{name}",
                                            source=tree)
               for name, tree in versions.items()}
    rounds: list[dict] = []
    try:
        for server in servers.values():
            server.ready()
        for server in servers.values():  # warm-up: torch's first calls, the page cache
            measure(server, shards[:1], etl_args)
        for number in range(args.rounds):
            order = ["A", "B"] if number % 2 == 0 else ["B", "A"]
            figures = {name: measure(servers[name], shards, etl_args) for name in order}
            rounds.append(figures)
            log.info("round %d: A %.0f images/s, B %.0f images/s (B/A %.3f)", number + 1,
                     figures["A"]["images_per_s"], figures["B"]["images_per_s"],
                     figures["B"]["images_per_s"] / figures["A"]["images_per_s"])
    finally:
        for server in servers.values():
            server.stop()
    return {"meta": started, "a": " ".join([str(a), *args.a_env, *[f"plant:{args.a_plant}"] * bool(args.a_plant)]),
            "b": " ".join([str(b), *args.b_env, *[f"plant:{args.b_plant}"] * bool(args.b_plant)]),
            "preset": args.preset,
            "workers": workers,
            "images_per_round": sum(s.images for s in shards), "rounds": rounds}


def report(results: dict) -> str:
    rounds = results["rounds"]
    lines = [stamp_line(results.get("meta", {})) + " (the commit of this checkout, which B names unless --b says "
             "otherwise)", f"A = {results['a']}", f"B = {results['b']}",
             f"{len(rounds)} rounds of {results['images_per_round']} images ({results['preset']}, hpush etl_fqn, "
             f"{results['workers']} workers), A and B alternating first", "",
             "| figure | A median (min-max) | B median (min-max) | B/A median (min-max over rounds) |",
             "|---|---|---|---|"]
    for figure, unit in (("images_per_s", "images/s"), ("cpu_ms_per_image", "CPU ms/image"),
                         ("peak_rss_mb", "peak RSS MB")):
        cells = []
        for name in ("A", "B"):
            values = [r[name][figure] for r in rounds]
            cells.append(f"{median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        ratios = [r["B"][figure] / r["A"][figure] for r in rounds]
        lines.append(f"| {unit} | {cells[0]} | {cells[1]} | {median(ratios):.3f} ({min(ratios):.3f}-"
                     f"{max(ratios):.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s", datefmt="%H:%M:%S")
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ab-work-")))
        a = args.a or stack.enter_context(worktree(args.base))
        results = run(a.resolve(), args.b.resolve(), args, work)
    return finish(results, args.json, report(results))


if __name__ == "__main__":
    raise SystemExit(main())
