"""How the pod's throughput grows with its cores: GIL shares, the cores ceiling, memory, and a projection.

``python -m bench.scaling`` (about 5 minutes on 2 cores) runs the pod the way an AIS target drives it
(hpush with ``etl_fqn``, 4 shards in flight, curl as the client) in two designs:

- ``threads``: every transform thread in the server process (``ETL_PROCESSES=0``, the default up to
  4 CPUs);
- ``processes``: the threads spread over worker processes (server/processes.py), the server process
  relaying bytes (the default from 5 CPUs).

For each it reports, per process at full load, the share of wall time a thread holds that process's
GIL (``py-spy record --gil``: samples holding the GIL over samples taken) and the CPU it used; the
**cores ceiling**, the cores used divided by the GIL share of the process every sample passes through
(the server process); and that process's GIL time per image against the pod's CPU time per image
(the target: at most 1/32). Then the pod's PSS (forked workers share pages) as worker processes are
added, and images/s measured at 1 and 2 workers for both designs and for the SDK peer
(``bench/peers/conventional_etl.py``, uvicorn ``--workers N``), projected to 4-64 cores: a design
delivers its per-core rate on ``min(cores, ceiling)`` cores. Writes ``scaling.json``, ``scaling.md``
and ``scaling.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from . import data
from .services import Server, curl_available, hpush, start_peer, start_service

log = logging.getLogger("bench.scaling")
REPO_ROOT = Path(__file__).resolve().parents[1]
CORES = (1, 2, 4, 8, 16, 32, 64)
TARGET_FRACTION = 1 / 32  # the server process's GIL time per image, of the pod's CPU time per image
CONCURRENCY = 4
PRESETS = {"imagenet-train": '{"preset": "imagenet-train", "dtype": "float32"}',
           "imagenet-val": '{"preset": "imagenet-val", "dtype": "float32"}'}


@dataclass
class ProcessLoad:
    role: str  # server, worker, forkserver
    pid: int
    cpu_seconds: float
    gil_share: float | None  # of wall time, None without py-spy


@dataclass
class LoadRun:
    design: str
    workers: int
    processes: int
    preset: str
    images_kind: str
    images: int
    wall: float
    pod_cpu_seconds: float
    per_process: list[ProcessLoad] = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    @property
    def images_per_second(self) -> float:
        return self.images / self.wall if self.wall else 0.0

    @property
    def cores_used(self) -> float:
        return self.pod_cpu_seconds / self.wall if self.wall else 0.0

    @property
    def cpu_ms_per_image(self) -> float:
        return 1000 * self.pod_cpu_seconds / self.images if self.images else 0.0

    def server(self) -> ProcessLoad:
        return next(p for p in self.per_process if p.role == "server")

    @property
    def server_gil_share(self) -> float | None:
        return self.server().gil_share

    @property
    def ceiling(self) -> float | None:
        """Cores the pod could use before the server process's GIL is always held."""
        share = self.server_gil_share
        return None if not share else self.cores_used / share

    @property
    def server_gil_fraction(self) -> float | None:
        """The server process's GIL time per image over the pod's CPU time per image."""
        share = self.server_gil_share
        return None if share is None or not self.pod_cpu_seconds else share * self.wall / self.pod_cpu_seconds

    def summary(self) -> dict:
        return {**asdict(self), "images_per_second": self.images_per_second, "cores_used": self.cores_used,
                "cpu_ms_per_image": self.cpu_ms_per_image, "server_gil_share": self.server_gil_share,
                "ceiling": self.ceiling, "server_gil_fraction": self.server_gil_fraction}


def pod_processes(server: Server) -> list[tuple[str, psutil.Process]]:
    """The server process, the fork server and the transform workers (uvicorn workers for the peer)."""
    main = psutil.Process(server.process.pid)
    found = [("server", main)]
    for child in main.children():
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in line:
            continue
        if "forkserver" in line:
            found.append(("forkserver", child))
            found += [("worker", worker) for worker in child.children()]
        else:
            found.append(("worker", child))  # the peer's uvicorn workers
    return found


def memory(processes: list[tuple[str, psutil.Process]]) -> dict:
    """PSS of the pod (its share of pages it shares, with other processes too) and each role's USS (its own
    pages: what one more of it costs). PSS alone would move with unrelated processes mapping torch's files."""
    found: dict = {"pss": 0, "uss": {}}
    for role, process in processes:
        with contextlib.suppress(psutil.Error):
            info = process.memory_full_info()
            found["pss"] += info.pss
            found["uss"].setdefault(role, []).append(info.uss)
    return found


def gil_share(pid: int, seconds: float, rate: int = 100) -> float | None:
    """The share of ``seconds`` during which some thread of ``pid`` held its GIL (py-spy), None without py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        start = time.monotonic()
        done = subprocess.run([spy, "record", "--pid", str(pid), "--gil", "--rate", str(rate), "--nonblocking",
                               "--duration", str(max(1, round(seconds))), "--format", "raw", "-o", out.name],
                              capture_output=True, text=True, timeout=seconds + 30)
        elapsed = time.monotonic() - start
        if done.returncode != 0:
            log.warning("py-spy on pid %d failed: %s", pid, done.stderr.strip()[-300:])
            return None
        held = sum(int(line.rsplit(" ", 1)[1]) for line in Path(out.name).read_text().splitlines() if " " in line)
    return min(1.0, held / (rate * max(1.0, min(elapsed, seconds))))


def drive(server: Server, shards: list[data.Shard], etl_args: str, seconds: float, spy: bool,
          concurrency: int = CONCURRENCY) -> tuple[int, float, dict, float]:
    """Keep ``concurrency`` shards in flight for ``seconds``; (images, wall, per-pid GIL share, pod CPU seconds)."""
    stop = threading.Event()
    images = [0]
    errors: list[str] = []
    lock = threading.Lock()
    counter = [0]

    def loop() -> None:
        while not stop.is_set():
            with lock:
                shard = shards[counter[0] % len(shards)]
                counter[0] += 1
            result = hpush(server.url, shard.object_path, shard.path, "fqn", etl_args, timeout=600)
            with lock:
                if result.ok:
                    images[0] += shard.images
                else:
                    errors.append(result.error)

    processes = pod_processes(server)
    cpu_before = server.cpu_seconds()
    start = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    shares: dict[int, float | None] = {}
    if spy:
        time.sleep(min(2.0, seconds / 4))  # past the first shards' start
        window = max(1.0, seconds - 2 * min(2.0, seconds / 4))
        spies = {pid: threading.Thread(target=lambda p=pid: shares.__setitem__(p, gil_share(p, window)))
                 for pid in [p.pid for role, p in processes if role != "forkserver"]}
        for spy_thread in spies.values():
            spy_thread.start()
        for spy_thread in spies.values():
            spy_thread.join()
    remaining = seconds - (time.monotonic() - start)
    if remaining > 0:
        time.sleep(remaining)
    stop.set()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return images[0], wall, shares, server.cpu_seconds() - cpu_before


def measure(server: Server, design: str, workers: int, processes: int, preset: str, kind: str,
            shards: list[data.Shard], seconds: float, spy: bool = True, concurrency: int = CONCURRENCY) -> LoadRun:
    hpush(server.url, shards[0].object_path, shards[0].path, "fqn", PRESETS[preset], timeout=600)  # warm
    found = pod_processes(server)
    cpu_before = {p.pid: _cpu(p) for _, p in found}
    images, wall, shares, pod_cpu = drive(server, shards, PRESETS[preset], seconds, spy, concurrency)
    run = LoadRun(design, workers, processes, preset, kind, images, wall, pod_cpu)
    for role, process in found:
        run.per_process.append(ProcessLoad(role, process.pid, _cpu(process) - cpu_before[process.pid],
                                           shares.get(process.pid)))
    run.memory = memory(found)
    log.info("%-9s w=%d p=%d %-14s %-8s %6.0f images/s  %.2f cores  %.2f CPU ms/image  server GIL %s  ceiling %s",
             design, workers, processes, preset, kind, run.images_per_second, run.cores_used, run.cpu_ms_per_image,
             _pct(run.server_gil_share), _num(run.ceiling))
    return run


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def project(rate_per_core: float, ceiling: float | None, cores: int) -> float:
    """images/s on ``cores``: the measured per-core rate on as many cores as the design can use."""
    usable = cores if ceiling is None else min(cores, ceiling)
    return rate_per_core * usable


STARTS: list[dict] = []  # every service start: seconds from the command to /health = 200


def service(work: Path, workers: int, processes: int | None, name: str) -> Server:
    """The pod with ``workers`` transform threads over ``processes`` worker processes (None: the default)."""
    extra = {} if processes is None else {"ETL_PROCESSES": str(processes)}
    start = time.monotonic()
    server = start_service(work / "logs", work, workers, extra, name=name).ready()
    STARTS.append({"name": name, "workers": workers, "processes": processes, "seconds": time.monotonic() - start})
    return server


def sweep_cores(args: argparse.Namespace, work: Path, imagenet: list[data.Shard]) -> list[dict]:
    """images/s at each worker count of ``--sweep``: both designs and the peer (a machine with that many cores)."""
    rows = []
    for workers in args.sweep:
        # Enough shards in flight to keep every worker busy: 4 would leave the processes design's 6 workers of
        # 3 threads at 16 (one shard each) and the peer's 16 uvicorn workers (one request each) partly idle.
        concurrency = max(CONCURRENCY, 2 * workers)
        for design, processes in (("threads", 0), ("processes", None)):
            server = service(work, workers, processes, f"sweep-{design}-{workers}")
            try:
                run_ = measure(server, design, workers, processes if processes is not None else -1,
                               "imagenet-train", "imagenet", imagenet, args.seconds, spy=workers == max(args.sweep),
                               concurrency=concurrency)
                rows.append({**run_.summary(), "concurrency": concurrency})
            finally:
                server.stop()
        if args.peer:
            server = start_peer(work / "logs", workers, name=f"sweep-peer-{workers}").ready()
            try:
                images, wall, _, cpu = drive(server, imagenet, "", args.seconds, spy=False, concurrency=concurrency)
                rows.append({"design": "peer", "workers": workers, "images_per_second": images / wall,
                             "cpu_ms_per_image": 1000 * cpu / images if images else 0.0,
                             "concurrency": concurrency})
            finally:
                server.stop()
    return rows


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    imagenet = data.demo_shards(work, args.shards, args.samples)
    photos = data.photo_shards(work, 2, args.photos) if args.photos else []
    seconds = args.seconds
    if args.sweep:
        rows = sweep_cores(args, work, imagenet)
        return report(args, [], [], [], [], rows)
    designs = [("threads", 2, 0), ("processes", 2, 2)]
    loads: list[LoadRun] = []
    for design, workers, processes in designs:
        server = service(work, workers, processes, f"{design}-{workers}")
        try:
            loads.append(measure(server, design, workers, processes, "imagenet-train", "imagenet", imagenet, seconds))
            if not args.smoke:
                loads.append(measure(server, design, workers, processes, "imagenet-val", "imagenet", imagenet,
                                     seconds))
                if photos:
                    loads.append(measure(server, design, workers, processes, "imagenet-train", "photos", photos,
                                         seconds))
        finally:
            server.stop()
    sweep: list[LoadRun] = [r for r in loads if r.preset == "imagenet-train" and r.images_kind == "imagenet"]
    memories: list[dict] = []
    if not args.smoke:
        for design, workers, processes in [("threads", 1, 0), ("processes", 1, 1), ("processes", 4, 4)]:
            server = service(work, workers, processes, f"{design}-{workers}")
            try:
                idle = memory(pod_processes(server))
                load = measure(server, design, workers, processes, "imagenet-train", "imagenet", imagenet,
                               seconds / 2, spy=False)
                if workers < 4:
                    sweep.append(load)
                memories.append({"design": design, "processes": processes, "idle": idle, "load": load.memory})
            finally:
                server.stop()
        for run_ in loads:
            if run_.preset == "imagenet-train" and run_.images_kind == "imagenet":
                memories.append({"design": run_.design, "processes": run_.processes, "idle": None,
                                 "load": run_.memory})
    peer: list[dict] = []
    if args.peer:
        for workers in (1, 2):
            server = start_peer(work / "logs", workers, name=f"peer-{workers}").ready()
            try:
                images, wall, _, cpu = drive(server, imagenet, "", seconds, spy=False)
                peer.append({"workers": workers, "images_per_second": images / wall,
                             "cpu_ms_per_image": 1000 * cpu / images if images else 0.0})
                log.info("peer      w=%d %6.0f images/s", workers, images / wall)
            finally:
                server.stop()
    return report(args, loads, sweep, memories, peer)


def report(args: argparse.Namespace, loads: list[LoadRun], sweep: list[LoadRun], memory: list[dict],
           peer: list[dict], cores_sweep: list[dict] | None = None) -> dict:
    projections = {}
    for design in ("threads", "processes"):
        runs = [r for r in loads if r.design == design and r.preset == "imagenet-train" and r.images_kind == "imagenet"]
        if not runs:
            continue
        train = runs[0]
        rate = 1000 / train.cpu_ms_per_image  # images/s per core of pod CPU
        projections[design] = {str(c): project(rate, train.ceiling, c) for c in CORES}
    if peer:  # one process per core, no shared GIL: its per-core rate (by CPU per image) on every core
        rate = max(1000 / p["cpu_ms_per_image"] for p in peer if p["cpu_ms_per_image"])
        projections["peer"] = {str(c): rate * c for c in CORES}
    result = {
        "command": "python -m bench.scaling " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
        "machine": {"cpus": psutil.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "load_average": list(psutil.getloadavg())},
        "target_fraction": TARGET_FRACTION,
        "loads": [r.summary() for r in loads],
        "sweep": [{"design": r.design, "workers": r.workers, "processes": r.processes,
                   "images_per_second": r.images_per_second, "cpu_ms_per_image": r.cpu_ms_per_image}
                  for r in sweep],
        "memory": memory,
        "peer": peer,
        "projection": projections,
        "starts": STARTS,
        "cores_sweep": cores_sweep or [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "scaling.md").write_text(markdown(result))
    if not args.smoke and not args.sweep:
        plot(result, out / "scaling.png")
    return result


def markdown(result: dict) -> str:
    lines = [f"# The pod on more cores\n\n`{result['command']}` at {result['commit']}, {result['date']}; "
             f"{result['machine']['cpus']} CPUs, load average at the end "
             f"{', '.join(f'{x:.1f}' for x in result['machine']['load_average'])}.\n",
             "## At full load (hpush with etl_fqn, 4 shards in flight, float32)\n",
             "| design | preset | images | images/s | cores used | pod CPU ms/image | GIL share by process "
             "(server; workers) | server GIL time per image / pod CPU per image | cores ceiling |",
             "|---|---|---|---|---|---|---|---|---|"]
    for load in result["loads"]:
        shares = [p for p in load["per_process"] if p["role"] != "forkserver"]
        text = "; ".join(_pct(p["gil_share"]) for p in shares)
        fraction = load["server_gil_fraction"]
        verdict = "" if fraction is None else (" (at most 1/32)" if fraction <= result["target_fraction"]
                                               else " (over 1/32)")
        lines.append(f"| {load['design']} ({load['processes']} processes) | {load['preset']} | "
                     f"{load['images_kind']} | {load['images_per_second']:,.0f} | {load['cores_used']:.2f} | "
                     f"{load['cpu_ms_per_image']:.2f} | {text} | {_frac(fraction)}{verdict} | "
                     f"{_num(load['ceiling'])} |")
    if result["memory"]:
        lines += ["", "## Memory (MiB; USS: a process's own pages, what one more costs; PSS: the pod's share of all it "
                  "maps, which moves with other processes mapping torch)\n",
                  "| design | worker processes | when | pod PSS | server USS | fork server USS | USS per worker |",
                  "|---|---|---|---|---|---|---|"]
        for row in sorted(result["memory"], key=lambda r: (r["design"], r["processes"], r["idle"] is None)):
            for when in ("idle", "load"):
                found = row[when]
                if not found:
                    continue
                uss = found["uss"]
                per_worker = uss.get("worker", [])
                lines.append(
                    f"| {row['design']} | {row['processes']} | {'idle' if when == 'idle' else 'full load'} | "
                    f"{found['pss'] / 2**20:,.0f} | {sum(uss.get('server', [0])) / 2**20:,.0f} | "
                    f"{sum(uss.get('forkserver', [0])) / 2**20:,.0f} | "
                    + (f"{sum(per_worker) / len(per_worker) / 2**20:,.0f} |" if per_worker else "|"))
    if result["sweep"] or result["peer"]:
        lines += ["", "## Measured images/s by workers (imagenet-train, float32)\n",
                  "| design | workers | images/s | pod CPU ms/image |", "|---|---|---|---|"]
        for row in sorted(result["sweep"], key=lambda r: (r["design"], r["workers"])):
            lines.append(f"| {row['design']} | {row['workers']} | {row['images_per_second']:,.0f} | "
                         f"{row['cpu_ms_per_image']:.2f} |")
        for row in result["peer"]:
            lines.append(f"| SDK peer (uvicorn --workers) | {row['workers']} | {row['images_per_second']:,.0f} | "
                         f"{row['cpu_ms_per_image']:.2f} |")
    if result["cores_sweep"]:
        lines += ["", "## Measured on this machine by workers (imagenet-train, float32)\n",
                  "| workers | threads | processes | SDK peer | processes / 1-worker x workers |",
                  "|---|---|---|---|---|"]
        by = {(r["design"], r["workers"]): r["images_per_second"] for r in result["cores_sweep"]}
        one = by.get(("processes", min(w for _, w in by)))
        for workers in sorted({w for _, w in by}):
            rate = by.get(("processes", workers))
            efficiency = f"{rate / (one * workers):.2f}" if rate and one else "n/a"
            lines.append(f"| {workers} | {by.get(('threads', workers), 0):,.0f} | {rate or 0:,.0f} | "
                         f"{by.get(('peer', workers), 0):,.0f} | {efficiency} |")
    if result["starts"]:
        lines += ["", "## Start (the command to /health = 200)\n", "| service | workers | processes | seconds |",
                  "|---|---|---|---|"]
        for row in result["starts"]:
            processes = "default" if row["processes"] is None else row["processes"]
            lines.append(f"| {row['name']} | {row['workers']} | {processes} | {row['seconds']:.1f} |")
    if result["projection"]:
        lines += ["", "## Projection (images/s; the per-core rate measured here on min(cores, ceiling) cores)\n",
                  "| cores | " + " | ".join(result["projection"]) + " |",
                  "|---|" + "---|" * len(result["projection"])]
        for cores in CORES:
            lines.append(f"| {cores} | " + " | ".join(f"{p[str(cores)]:,.0f}" for p in result["projection"].values())
                         + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for name, values in result["projection"].items():
        axis.plot(CORES, [values[str(c)] for c in CORES], marker="o", label=name)
    for row in result["sweep"]:
        axis.scatter([row["workers"]], [row["images_per_second"]], color="black", zorder=5, s=12)
    for row in result["peer"]:
        axis.scatter([row["workers"]], [row["images_per_second"]], color="black", zorder=5, s=12)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(CORES, [str(c) for c in CORES])
    axis.set_xlabel("cores given to the pod")
    axis.set_ylabel("images/s (imagenet-train, float32)")
    axis.set_title("Measured (dots, 1-2 cores) and projected throughput")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _frac(value: float | None) -> str:
    return "n/a" if value is None else f"1/{1 / value:,.0f}" if value > 0 else "0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "scaling"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-scaling"))
    parser.add_argument("--seconds", type=float, default=20.0, help="full-load time per case")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples", type=int, default=250)
    parser.add_argument("--photos", type=int, default=12, help="6 MP photos per photo shard (0: none)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip the SDK peer")
    parser.add_argument("--smoke", action="store_true", help="one short case per design, no peer, no plot")
    parser.add_argument("--sweep", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="only images/s at these worker counts, both designs and the peer (e.g. 1,2,4,8,16 on "
                             "a 16-core machine)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.shards, args.samples, args.photos, args.peer = min(args.seconds, 4.0), 2, 40, 0, False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not curl_available():
        print("bench.scaling needs curl (it plays the AIS target)", file=sys.stderr)
        return 2
    result = run(args)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
