"""How the pod uses its cores: shards in flight, the server process's GIL by comm type, CPU and memory per
image, and a model of more cores.

``python -m bench.scaling`` (about 10 minutes on 2 cores) runs the pod as AIS targets drive it (curl and
a ws client play the target; a sendfile server plays the target hpull fetches from), on the demo's
ImageNet-size shards (1,000 samples, about 100 MB each), imagenet-train, float32, ``ETL_WORKERS=2``, in
two designs:

- ``threads``: every transform thread in the server process (``ETL_PROCESSES=0``);
- ``processes``: two worker processes (``ETL_PROCESSES=2``): each shard led by one, its samples spread
  over both, the output written to the caller by the leader (server/spread.py, server/worker.py).

It measures, both pods up and taken in turns round after round (so both see the same machine):

1. **shards in flight**: 1, 2 and 4 shards in flight (hpush ``etl_fqn``): images/s, the cores the pod
   used, the cores the whole machine used (the pod and its callers), the pod's CPU ms per image; and per
   round the processes design's CPU per image over the threads design's;
2. **comm types**: at 4 shards in flight, hpush ``etl_fqn``, hpush with the shard as the body, hpull
   (the pod fetches the shard) and ws (``fqn``): the share of wall time a thread of each pod process holds
   its GIL (``py-spy record --gil``), and the **cores ceiling**: the cores used over the server process's
   share (every request reaches it, so its GIL saturating is where adding cores stops helping);
3. **one shard's own ceiling** (processes): one shard in flight, the GIL time the worker processes spend
   outside the transforms (leading the shard: reading it, sending samples, writing the output), per image;
4. **memory**: the pod's PSS idle and under load, and each process's USS;
5. **the machine**: its memory bandwidth (numpy copies);

then a **model** of more cores, each design's images/s as the least of: its CPU per image on all cores,
its server process's serial work (the ceiling), one shard's serial work (one shard in flight), and the
memory bandwidth over the bytes an image moves (an estimate). ``--sweep 1,2,4,...`` (a machine with that
many cores) measures images/s per worker count instead: both designs and the SDK peer, and one shard
in flight. Writes ``scaling.json``, ``scaling.md`` and ``scaling.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from bench.stamp import git_state, machine

from . import data
from .scaling_report import _num, _pct, markdown, plot
from .services import FileTarget, Result, Server, curl_available, hpull, hpush, start_peer, start_service, ws_request

log = logging.getLogger("bench.scaling")
REPO_ROOT = Path(__file__).resolve().parents[1]
CORES = (2, 4, 8, 16, 32, 64)
TARGET_CEILING = 64  # the server process's GIL may be held for at most 1/64 of the pod's CPU time
ETL_ARGS = '{"preset": "imagenet-train", "dtype": "float32"}'
DESIGNS = {"threads": 0, "processes": 2}  # ETL_PROCESSES at ETL_WORKERS=2
COMMS = ("fqn", "body", "hpull", "ws")
FLOAT32_OUT = 3 * 224 * 224 * 4  # an imagenet-train float32 array's bytes


@dataclass
class ProcessLoad:
    role: str  # server, worker, forkserver
    pid: int
    cpu_seconds: float
    gil_share: float | None = None  # of wall time, None without py-spy
    spread_gil_share: float | None = None  # the same, outside the transform threads (a worker's leading work)


@dataclass
class Case:
    """One design driven for a while: what it delivered and what it cost."""

    design: str
    workers: int
    processes: int
    comm: str
    inflight: int
    images: int
    wall: float
    pod_cpu: float
    machine_cpu: float
    round: int = 0
    per_process: list[ProcessLoad] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        return self.images / self.wall if self.wall else 0.0

    @property
    def cores_used(self) -> float:
        return self.pod_cpu / self.wall if self.wall else 0.0

    @property
    def machine_cores(self) -> float:
        return self.machine_cpu / self.wall if self.wall else 0.0

    @property
    def cpu_ms_per_image(self) -> float:
        return 1000 * self.pod_cpu / self.images if self.images else 0.0

    @property
    def server_gil_share(self) -> float | None:
        return next((p.gil_share for p in self.per_process if p.role == "server"), None)

    @property
    def ceiling(self) -> float | None:
        """Cores the pod could use before the server process's GIL is always held."""
        share = self.server_gil_share
        return None if share is None else (self.cores_used / share if share else float("inf"))

    @property
    def spread_gil_ms_per_image(self) -> float | None:
        """The worker processes' GIL time outside their transform threads, per image (leading the shards)."""
        shares = [p.spread_gil_share for p in self.per_process if p.role == "worker"]
        if not shares or any(s is None for s in shares) or not self.images:
            return None
        return 1000 * sum(shares) * self.wall / self.images  # type: ignore[arg-type]

    def summary(self) -> dict:
        return {**asdict(self), "images_per_second": self.images_per_second, "cores_used": self.cores_used,
                "machine_cores": self.machine_cores, "cpu_ms_per_image": self.cpu_ms_per_image,
                "server_gil_share": self.server_gil_share, "ceiling": self.ceiling,
                "spread_gil_ms_per_image": self.spread_gil_ms_per_image}


# ----------------------------------------------------------------------------------------------- the pod


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


def _py_spy() -> str | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return spy if Path(spy).exists() else None


def gil_shares(pid: int, seconds: float, rate: int = 100) -> tuple[float, float] | None:
    """(share of ``seconds`` during which some thread of ``pid`` held its GIL, the same outside threads named
    ``transform_*``), from ``py-spy record --gil``; None without py-spy (it needs ptrace: root)."""
    spy = _py_spy()
    if spy is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        start = time.monotonic()
        done = subprocess.run([spy, "record", "--pid", str(pid), "--gil", "--threads", "--rate", str(rate),
                               "--nonblocking", "--duration", str(max(1, round(seconds))), "--format", "raw",
                               "-o", out.name], capture_output=True, text=True, timeout=seconds + 30)
        elapsed = time.monotonic() - start
        if done.returncode != 0:
            log.warning("py-spy on pid %d failed: %s", pid, done.stderr.strip()[-300:])
            return None
        held = spread = 0
        for line in Path(out.name).read_text().splitlines():
            if " " not in line:
                continue
            stack, count = line.rsplit(" ", 1)
            held += int(count)
            thread = stack.split(";", 1)[0]
            if "transform_" not in thread:
                spread += int(count)
    window = rate * max(1.0, min(elapsed, seconds))
    return min(1.0, held / window), min(1.0, spread / window)


def request(server: Server, shard: data.Shard, comm: str) -> Result:
    """One shard as an AIS target sends it by ``comm``."""
    if comm == "ws":
        return ws_request(server.url, shard.path, ETL_ARGS, timeout=600)
    if comm == "hpull":
        return hpull(server.url, shard.path, ETL_ARGS, timeout=600)
    return hpush(server.url, shard.object_path, shard.path, comm, ETL_ARGS, timeout=600)


def drive(server: Server, design: str, workers: int, processes: int, shards: list[data.Shard], comm: str,
          inflight: int, seconds: float, spy: bool = False, rnd: int = 0,
          call: Callable[[Server, data.Shard, str], Result] = request) -> Case:
    """Keep ``inflight`` shards in flight for ``seconds`` (each request that started is counted whole)."""
    stop = threading.Event()
    images, errors, counter = [0], [], [0]
    lock = threading.Lock()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                shard = shards[counter[0] % len(shards)]
                counter[0] += 1
            result = call(server, shard, comm)
            with lock:
                if result.ok:
                    images[0] += shard.images
                else:
                    errors.append(result.error)

    found = pod_processes(server)
    before = {p.pid: _cpu(p) for _, p in found}
    machine_before = _machine_cpu()
    pod_before = server.cpu_seconds()
    start = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(inflight)]
    for thread in threads:
        thread.start()
    shares: dict[int, tuple[float, float] | None] = {}
    if spy:
        settle = min(2.0, seconds / 4)
        time.sleep(settle)
        window = max(1.0, seconds - 2 * settle)
        spies = [threading.Thread(target=lambda p=p: shares.__setitem__(p, gil_shares(p, window)))
                 for p in [p.pid for role, p in found if role != "forkserver"]]
        for spy_thread in spies:
            spy_thread.start()
        for spy_thread in spies:
            spy_thread.join()
    remaining = seconds - (time.monotonic() - start)
    if remaining > 0:
        time.sleep(remaining)
    stop.set()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    if errors:
        raise RuntimeError(f"{design} {comm}: {len(errors)} requests failed, first: {errors[0]}")
    case = Case(design, workers, processes, comm, inflight, images[0], wall, server.cpu_seconds() - pod_before,
                _machine_cpu() - machine_before, rnd)
    for role, process in found:
        share = shares.get(process.pid)
        case.per_process.append(ProcessLoad(role, process.pid, _cpu(process) - before[process.pid],
                                            share[0] if share else None, share[1] if share else None))
    log.info("%-9s %-5s %d in flight: %6.0f images/s  pod %.2f cores, machine %.2f  %.2f CPU ms/image%s", design,
             comm, inflight, case.images_per_second, case.cores_used, case.machine_cores, case.cpu_ms_per_image,
             f"  server GIL {_pct(case.server_gil_share)} ceiling {_num(case.ceiling)}" if spy else "")
    return case


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def _machine_cpu() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "steal", 0.0)


STARTS: list[dict] = []  # every service start: seconds from the command to /health = 200


def service(work: Path, workers: int, processes: int | None, name: str, target: FileTarget | None = None) -> Server:
    """The pod with ``workers`` transform threads over ``processes`` worker processes (None: the default)."""
    extra = {} if processes is None else {"ETL_PROCESSES": str(processes)}
    if target is not None:
        extra["AIS_TARGET_URL"] = target.url  # as in a cluster: hpull fetches there, etl_fqn checks sizes there
    start = time.monotonic()
    server = start_service(work / "logs", work, workers, extra, name=name).ready()
    STARTS.append({"name": name, "workers": workers, "processes": processes, "seconds": time.monotonic() - start})
    return server


def bandwidth(threads: int = 1, megabytes: int = 256, passes: int = 3) -> float:
    """Bytes per second that ``threads`` threads copying large arrays at once move (best of ``passes``): the
    memory bandwidth one core gets, or all of them (numpy copies without holding the GIL)."""
    import numpy as np

    pairs = [(np.ones(megabytes << 20, np.uint8), np.zeros(megabytes << 20, np.uint8)) for _ in range(threads)]
    best = 0.0
    for _ in range(passes + 1):
        workers = [threading.Thread(target=np.copyto, args=(target, source)) for source, target in pairs]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, threads * (megabytes << 20) / (time.perf_counter() - start))
    return best


# ------------------------------------------------------------------------------------------------ the runs


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    shards = data.demo_shards(work, args.shards, args.samples)
    target = FileTarget(data.object_dir(work))
    try:
        if args.sweep:
            return report(args, sweep=sweep_cores(args, work, shards, target))
        servers = {design: service(work, 2, processes, design, target) for design, processes in DESIGNS.items()}
        try:
            for server in servers.values():  # warm: the first shard pays for lazy imports and first pages
                request(server, shards[0], "fqn")
            idle = {design: memory(pod_processes(server)) for design, server in servers.items()}
            inflight: list[Case] = []
            for rnd in range(args.rounds):
                order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
                for count in args.inflight:
                    for design in order:
                        inflight.append(drive(servers[design], design, 2, DESIGNS[design], shards, "fqn", count,
                                              args.seconds, rnd=rnd))
            comms: list[Case] = []
            loaded: dict[str, dict] = {}
            for design, server in servers.items():
                for comm in args.comms:
                    comms.append(drive(server, design, 2, DESIGNS[design], shards, comm, max(args.inflight),
                                       args.seconds, spy=True))
                loaded[design] = memory(pod_processes(server))
            one = drive(servers["processes"], "processes", 2, 2, shards, "fqn", 1, args.seconds, spy=True)
        finally:
            for server in servers.values():
                server.stop()
        spec = None
        if args.spec_workers:
            spec = spec_memory(args, work, shards, target)
        peer = []
        if args.peer:
            for workers in (1, 2):
                server = start_peer(work / "logs", workers, name=f"peer-{workers}").ready()
                try:
                    peer.append(drive(server, "peer", workers, 0, shards, "fqn", max(args.inflight), args.seconds))
                finally:
                    server.stop()
        return report(args, inflight=inflight, comms=comms, one=one, peer=peer,
                      memory={"idle": idle, "load": loaded, "spec": spec},
                      bandwidth={"core": bandwidth(1), "machine": bandwidth(psutil.cpu_count() or 1),
                                 "node": args.node_bandwidth * 1e9})
    finally:
        target.stop()


def spec_memory(args: argparse.Namespace, work: Path, shards: list[data.Shard], target: FileTarget) -> dict:
    """The pod as the shipped runtime spec sizes it (``ETL_WORKERS=--spec-workers``, its default processes): its
    PSS idle and with as many shards in flight as workers (here on fewer cores: memory, not speed)."""
    server = service(work, args.spec_workers, None, f"spec-{args.spec_workers}", target)
    try:
        request(server, shards[0], "fqn")
        idle = memory(pod_processes(server))
        case = drive(server, "spec", args.spec_workers, -1, shards, "fqn", args.spec_workers, args.seconds)
        return {"workers": args.spec_workers, "processes": len(pod_processes(server)) - 2, "idle": idle,
                "load": memory(pod_processes(server)), "images": case.images}
    finally:
        server.stop()


def sweep_row(case: Case, found: dict | None = None) -> dict:
    """One case of ``--sweep`` as ``scaling.json`` keeps it (bench/device_scaling.sh's summary reads these keys):
    the case's summary, and the pod's PSS under that load (``memory``) when taken."""
    return {**case.summary(), "pss_bytes": found["pss"] if found else None}


def sweep_cores(args: argparse.Namespace, work: Path, shards: list[data.Shard], target: FileTarget) -> list[dict]:
    """images/s at each worker count of ``--sweep``: both designs (2 shards per worker in flight), one shard in
    flight (the processes design), and the peer; the server's GIL at the largest count."""
    rows = []
    largest = max(args.sweep)
    for workers in args.sweep:
        inflight = max(4, 2 * workers)
        # The many-core design at every count (one process per 3 threads, at least one), beside the threads.
        for design, processes in (("threads", 0), ("processes", max(1, math.ceil(workers / 3)))):
            server = service(work, workers, processes, f"sweep-{design}-{workers}", target)
            try:
                request(server, shards[0], "fqn")
                case = drive(server, design, workers, processes, shards, "fqn", inflight, args.seconds,
                             spy=workers == largest)
                rows.append(sweep_row(case, memory(pod_processes(server))))
                if design == "processes":
                    rows.append(sweep_row(drive(server, design, workers, processes, shards, "fqn", 1, args.seconds,
                                                spy=workers == largest)))
            finally:
                server.stop()
        if args.peer:
            server = start_peer(work / "logs", workers, name=f"sweep-peer-{workers}").ready()
            try:
                rows.append(sweep_row(drive(server, "peer", workers, 0, shards, "fqn", inflight, args.seconds),
                                      memory(pod_processes(server))))
            finally:
                server.stop()
    return rows


# ---------------------------------------------------------------------------------------------- the model


def model(inflight: list[Case], comms: list[Case], one: Case | None, peer: list[Case], bandwidth: dict,
          image_bytes: float) -> dict:
    """Each design's images/s on more cores: the least of its bounds, with what each bound rests on.

    * cores: the pod's CPU per image at full load, on every core (measured per core here);
    * the server process: images/s when its GIL is always held (the lowest over the comm types);
    * one shard: images/s when the leading worker's work outside the transforms is always holding its GIL;
    * memory: the bandwidth ``cores`` cores get (one core's, measured, times the cores, up to the node's,
      ``bandwidth["node"]``, an assumption) over the bytes an image moves through memory (an estimate).
    """
    result: dict = {"bounds": {}, "projection": {}}
    traffic = _bytes_moved(image_bytes)

    def memory_bound(cores: int) -> float | None:
        if not bandwidth.get("core"):
            return None
        return min(cores * bandwidth["core"], bandwidth.get("node") or float("inf")) / traffic
    for design in DESIGNS:
        full = [c for c in inflight if c.design == design and c.inflight == max(x.inflight for x in inflight)]
        if not full:
            continue
        rate = 1000 / statistics.median(c.cpu_ms_per_image for c in full)  # images/s per core of pod CPU
        ceilings = [c.ceiling for c in comms if c.design == design and c.ceiling is not None]
        server = min(ceilings) * rate if ceilings else None
        shard = None
        if design == "processes" and one is not None and one.spread_gil_ms_per_image:
            shard = 1000 / one.spread_gil_ms_per_image
        result["bounds"][design] = {"per_core": rate, "server": server, "one_shard": shard,
                                    "memory": memory_bound(max(CORES))}
        all_shards, one_shard = {}, {}
        for cores in CORES:
            bounds = [cores * rate] + [b for b in (server, memory_bound(cores)) if b]
            all_shards[str(cores)] = min(bounds)
            one_shard[str(cores)] = min(bounds + ([shard] if shard else []))
        result["projection"][design] = all_shards
        if design == "processes":
            result["projection"]["processes, one shard"] = one_shard
    if peer:  # one process per core, no shared GIL: its per-core rate on every core
        rate = max(1000 / c.cpu_ms_per_image for c in peer if c.cpu_ms_per_image)
        result["bounds"]["peer"] = {"per_core": rate, "server": None, "one_shard": None,
                                    "memory": memory_bound(max(CORES))}
        result["projection"]["peer"] = {str(c): min([c * rate] + [b for b in (memory_bound(c),) if b]) for c in CORES}
    result["memory"] = {"bandwidth": bandwidth, "bytes_per_image": traffic}
    return result


def _bytes_moved(image_bytes: float) -> float:
    """Bytes one float32 image moves through memory, an estimate: the input read into a buffer (written and
    read), the decoded pixels (about 4x the JPEG's bytes, written and read), the output array written, read by
    the socket copy into the kernel's buffers and written there, and read once more when it leaves."""
    return 2 * image_bytes + 2 * 4 * image_bytes + 4 * FLOAT32_OUT


# ---------------------------------------------------------------------------------------------- the report


def report(args: argparse.Namespace, inflight: list[Case] | None = None, comms: list[Case] | None = None,
           one: Case | None = None, peer: list[Case] | None = None, memory: dict | None = None,
           bandwidth: dict | None = None, sweep: list[dict] | None = None) -> dict:
    inflight, comms, peer = inflight or [], comms or [], peer or []
    image_bytes = 0.0
    if not args.sweep:
        shards = data.demo_shards(Path(args.work), args.shards, args.samples)
        image_bytes = sum(s.size for s in shards) / max(1, sum(s.images for s in shards))
    result = {
        "command": "python -m bench.scaling " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_state()["git"],
        "machine": machine(),
        "shards": {"count": args.shards, "samples": args.samples, "image_bytes": image_bytes},
        "target_ceiling": TARGET_CEILING,
        "inflight": [c.summary() for c in inflight],
        "ratios": _ratios(inflight),
        "comms": [c.summary() for c in comms],
        "one_shard": one.summary() if one is not None else None,
        "peer": [c.summary() for c in peer],
        "memory": memory or {},
        "starts": STARTS,
        "sweep": sweep or [],
    }
    if inflight:
        result["model"] = model(inflight, comms, one, peer, bandwidth or {}, image_bytes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "scaling.md").write_text(markdown(result))
    if inflight and not args.smoke:
        plot(result, out / "scaling.png")
    return result


def _ratios(inflight: list[Case]) -> dict:
    """Per shards-in-flight count: the processes design's CPU per image over the threads design's, per round."""
    found: dict = {}
    for count in sorted({c.inflight for c in inflight}):
        pairs, totals = [], {}
        for rnd in sorted({c.round for c in inflight}):
            by = {c.design: c for c in inflight if c.inflight == count and c.round == rnd}
            if "threads" in by and "processes" in by and by["threads"].cpu_ms_per_image:
                pairs.append(by["processes"].cpu_ms_per_image / by["threads"].cpu_ms_per_image)
                for design in ("threads", "processes"):
                    cpu, images = totals.get(design, (0.0, 0))
                    totals[design] = (cpu + by[design].pod_cpu, images + by[design].images)
        if pairs:
            # pooled: all rounds' pod CPU over all their images, per design (a slow round weighs by its images)
            pooled = (totals["processes"][0] / totals["processes"][1]) / (totals["threads"][0] / totals["threads"][1])
            found[str(count)] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs),
                                 "pooled": pooled, "rounds": pairs}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "scaling"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-scaling"))
    parser.add_argument("--seconds", type=float, default=15.0, help="time per case")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the shards-in-flight cases")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--inflight", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2, 4])
    parser.add_argument("--comms", type=lambda text: text.split(","), default=list(COMMS))
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip the SDK peer")
    parser.add_argument("--node-bandwidth", type=float, default=200.0, help="a storage node's memory bandwidth in "
                        "GB/s, for the model (default: one socket of 8 DDR4-3200 channels, 204.8 GB/s)")
    parser.add_argument("--spec-workers", type=int, default=8, help="the memory of the pod the shipped runtime "
                        "spec sizes (k8s/etl-spec.yaml: its CPUs); 0: skip")
    parser.add_argument("--smoke", action="store_true", help="short cases, one round, no peer, no plot")
    parser.add_argument("--sweep", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="only images/s at these worker counts, both designs and the peer (e.g. 1,2,4,8,16 on "
                             "a 16-core machine)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds, args.shards, args.samples, args.peer = min(args.seconds, 2.0), 1, 2, 40, False
        args.inflight, args.spec_workers = [1, 2], 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not curl_available():
        print("bench.scaling needs curl (it plays the AIS target)", file=sys.stderr)
        return 2
    result = run(args)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
