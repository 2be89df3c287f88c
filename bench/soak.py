"""Bounded load and soak test of the service over loopback: ``python -m bench.soak --duration 600``.

Starts ``python -m transformer serve`` on 127.0.0.1, then keeps ``--concurrency`` shard requests in
flight for ``--duration`` seconds, mixing good and corrupt shards (hpush body, hpush ``etl_fqn`` and
ws with an ``fqn`` control message, one connection per request):

* every answer is checked: a 200 must be byte-identical to the reference answer for that shard
  (imagenet-val is deterministic), an error must have its expected status and message; a request
  without an answer is "lost";
* ``GET /health`` is probed on a fresh connection every 100 ms (as the kubelet does): p50/p99/max;
* the service's RSS, threads and open file descriptors are sampled from ``/proc`` every second;
  threads and fds are compared idle-before vs idle-after, RSS after warm-up vs at the end.

``--through-ais`` runs the soak through a real AIS instead, pods killed as it runs (``bench/soak_ais.py``;
``python -m bench.soak --through-ais --help`` lists its options).

Exit status 0 only when every criterion holds (no lost or wrong answer, health p99 < 100 ms, RSS
growth after warm-up under the bound, no leaked threads or fds). The report (``--out``, JSON) holds
every figure; the CI runs a 10-second smoke of this (tests/reliability/test_soak_smoke.py).
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import httpx

from testbed.aisnames import go_path_escape
from testbed.ports import free_port
from testbed.service import Service, base_env, serve_command
from testbed.shardgen import jpeg_bytes, make_tar

HEALTH_P99_LIMIT_MS = 100.0
RSS_GROWTH_LIMIT = 64 * 2**20  # bytes of RSS growth allowed after warm-up (allocator noise)


# ------------------------------------------------------------------------------------- workload


@dataclass
class Kind:
    """One kind of request in the mix and what its answer must be."""

    name: str
    weight: int
    body: bytes  # request body (empty for FQN requests)
    fqn: str = ""
    etl_args: str = ""
    status: int = 200
    message: str = ""  # expected substring of an error body
    reference: bytes | None = None  # the 200 answer every later answer must equal
    abort_ok: bool = False  # a broken transfer (never a clean short answer) is also correct
    ws: bool = False  # sent as a ws control message (fqn), answered by one Binary message

    def url(self, base: str, index: int) -> str:
        params = {}
        if self.fqn:
            params["etl_fqn"] = go_path_escape(self.fqn)  # urlencode encodes again, as AIS does
        if self.etl_args:
            params["etl_args"] = self.etl_args
        query = f"?{urlencode(params)}" if params else ""
        return f"{base}/soak/{self.name}.tar{query}"


def _members(samples: int, start: int) -> list[tuple[str, bytes]]:
    members = []
    for i in range(start, start + samples):
        members.append((f"s{i:05d}.jpg", jpeg_bytes(i, (320, 240))))
        members.append((f"s{i:05d}.cls", str(i % 4).encode()))
    return members


def workload(root: Path, samples: int) -> list[Kind]:
    good = make_tar(_members(samples, 0))
    corrupt_sample = _members(samples, 100)
    corrupt_sample[2] = (corrupt_sample[2][0], corrupt_sample[2][1][:300])  # sample 101: a truncated JPEG
    fqn = root / "mp1" / "@ais" / "soak" / "%ob" / "good-fqn.tar"
    fqn.parent.mkdir(parents=True, exist_ok=True)
    fqn.write_bytes(good)
    bad_first = make_tar([("s09999.jpg", b"\xff\xd8\xff\xe0 not really a jpeg")] + _members(1, 200))
    late = _members(samples, 100) + [("s00150.jpg", b"\xff\xd8\xff\xe0 not really a jpeg")]
    late_fail = fqn.parent / "late-fail.tar"
    late_fail.write_bytes(make_tar(late))
    return [
        Kind("good-body", 6, good),
        Kind("good-fqn", 4, b"", fqn=str(fqn)),
        Kind("bad-sample", 3, make_tar(corrupt_sample)),
        # Cut inside the first image: nothing can be sent before the reader fails, always a 422.
        Kind("truncated", 1, good[:3000], status=422, message="truncated inside member 's00000.jpg'"),
        # Cut after a few samples: a 422 if the reader fails first, else a broken transfer (output had
        # started); never a complete 200.
        Kind("truncated-late", 1, good[: len(good) // 2], status=422, message="truncated", abort_ok=True),
        Kind("not-a-tar", 1, b"definitely not a tar\n" * 50, status=422, message="not a tar archive"),
        Kind("fail-policy", 1, bad_first, etl_args='{"on_error": "fail"}', status=422,
             message="sample 's09999' (member 's09999.jpg')"),
        Kind("bad-args", 1, good, etl_args='{"preset": "nope"}', status=400, message="unknown preset"),
        Kind("good-ws", 2, b"", fqn=str(fqn), ws=True),
        # A sample failing under on_error=fail well after the reply began: the message ends with the
        # error JSON after the tar so far, never as a complete tar; the connection stays open.
        Kind("ws-late-fail", 1, b"", fqn=str(late_fail), etl_args='{"on_error": "fail"}', ws=True, status=422,
             message="sample 's00150'"),
    ]


# ----------------------------------------------------------------------------------- the service


def proc_status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        text = f.read()
    return {
        "rss": int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024,
        "threads": int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1)),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


class ServiceProcess(Service):
    """This service on a free port, as the soak drives it (``testbed.service.Service``), with its in-flight gauge."""

    def __init__(self, root: Path, workers: str, log_path: Path):
        port = free_port()
        env = base_env(ETL_PRESET="imagenet-val", ETL_FQN_ROOTS=str(root), ETL_OBJ_TIMEOUT="60s",
                       ETL_LOG_LEVEL="warning")
        if workers:
            env["ETL_WORKERS"] = workers
        super().__init__(log_path.stem, serve_command(port), env, log_path.parent, port)

    def inflight(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        found = re.search(r"^etl_inflight_shards ([0-9.]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def stop(self, grace: float = 30) -> float:
        """SIGTERM, wait for the graceful exit; returns the seconds it took."""
        return super().stop(grace)


# ---------------------------------------------------------------------------------------- the run


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    bytes_out: int = 0
    aborted: int = 0  # broken transfers where the kind allows them


def check(kind: Kind, response: httpx.Response) -> str | None:
    """Why the answer is wrong, or None."""
    if response.status_code != kind.status:
        return f"{kind.name}: status {response.status_code}, expected {kind.status}: {response.text[:200]}"
    if kind.status == 200:
        if response.content != kind.reference:
            return f"{kind.name}: 200 body differs from the reference ({len(response.content)} bytes)"
    elif kind.message not in response.text:
        return f"{kind.name}: error body {response.text[:200]!r} lacks {kind.message!r}"
    return None


def ws_request(service: ServiceProcess, kind: Kind, index: int) -> tuple[int, bytes | str]:
    """One ws request on a new connection: (1000, the reply) or (close code, reason) if the socket closed."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    control = {"path": f"soak/{kind.name}-{index}.tar", "fqn": go_path_escape(kind.fqn)}
    if kind.etl_args:
        control["etl_args"] = kind.etl_args
    with connect(f"ws://127.0.0.1:{service.port}/ws", max_size=None, compression=None, open_timeout=10,
                 close_timeout=5) as ws:
        ws.send(json.dumps(control).encode())
        try:
            reply = ws.recv(timeout=120)
        except ConnectionClosed as closed:
            return (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (1006, "no close frame")
    if isinstance(reply, str):
        return 1000, "a Text reply: " + reply[:200]
    return 1000, reply


def check_ws(kind: Kind, code: int, reply: bytes | str) -> str | None:
    if kind.status == 200:
        if code != 1000 or not isinstance(reply, bytes):
            return f"{kind.name}: closed with {code} {reply!r:.200}, expected a Binary reply"
        if reply != kind.reference:
            return f"{kind.name}: reply differs from the reference ({len(reply)} bytes)"
        return None
    if code != 1000 or not isinstance(reply, bytes):
        return f"{kind.name}: closed with {code} {reply!r:.200}, expected a Binary reply ending with the error"
    at = reply.rfind(b'{"message": ')
    try:
        error = json.loads(reply[at:]) if at >= 0 else {}
    except ValueError:
        error = {}
    if error.get("status") != kind.status or kind.message not in str(error.get("message")):
        return f"{kind.name}: reply ends with {reply[-200:]!r}, expected a {kind.status} error naming {kind.message!r}"
    if reply[:at].endswith(b"\0" * 1024):
        return f"{kind.name}: the tar before the error is complete (end-of-archive marker)"
    return None


def build_references(service: ServiceProcess, kinds: list[Kind]) -> None:
    """The first 200 answer of each kind is its reference, after a structural check."""
    import io
    import tarfile

    with httpx.Client(timeout=120) as client:
        for kind in kinds:
            if kind.ws:
                code, reply = ws_request(service, kind, 0)
                if kind.status == 200 and code == 1000 and isinstance(reply, bytes):
                    kind.reference = reply
                problem = check_ws(kind, code, reply)
                if problem:
                    raise RuntimeError(f"warm-up: {problem}")
                continue
            response = client.put(kind.url(service.url, 0), content=kind.body)
            if kind.status != 200:
                problem = check(kind, response)
                if problem:
                    raise RuntimeError(f"warm-up: {problem}")
                continue
            if response.status_code != 200:
                raise RuntimeError(f"warm-up: {kind.name} answered {response.status_code}: {response.text[:300]}")
            with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
                names = [m.name for m in archive.getmembers()]
            npys = [n for n in names if n.endswith(".npy")]
            has_manifest = "__etl__/errors.json" in names
            if not npys or has_manifest != (kind.name == "bad-sample"):
                raise RuntimeError(f"warm-up: {kind.name} gave an unexpected shard: {names}")
            kind.reference = response.content
    by_name = {kind.name: kind for kind in kinds}
    if "good-ws" in by_name and "good-fqn" in by_name and by_name["good-ws"].reference != by_name["good-fqn"].reference:
        raise RuntimeError("warm-up: the ws reply differs from the hpush reply for the same shard")


def load(service: ServiceProcess, kinds: list[Kind], concurrency: int, deadline: float, tally: Tally) -> None:
    schedule = [kind for kind in kinds for _ in range(kind.weight)]

    def worker(number: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            index = number
            while time.monotonic() < deadline:
                kind = schedule[index % len(schedule)]
                index += concurrency
                with tally.lock:
                    tally.sent[kind.name] = tally.sent.get(kind.name, 0) + 1
                started = time.monotonic()
                if kind.ws:
                    try:
                        code, reply = ws_request(service, kind, index)
                    except Exception as exc:  # noqa: BLE001 - no answer at all: lost
                        with tally.lock:
                            tally.lost.append(f"{kind.name}: {exc.__class__.__name__}: {exc}")
                        continue
                    problem = check_ws(kind, code, reply)
                    with tally.lock:
                        tally.answered[kind.name] = tally.answered.get(kind.name, 0) + 1
                        tally.latencies.append(time.monotonic() - started)
                        tally.bytes_out += len(reply) if isinstance(reply, bytes) else 0
                        if problem:
                            tally.wrong.append(problem)
                    continue
                try:
                    response = client.put(kind.url(service.url, index), content=kind.body)
                except httpx.RemoteProtocolError as exc:
                    with tally.lock:  # the service cut the transfer on purpose (or lost the request)
                        if kind.abort_ok:
                            tally.answered[kind.name] = tally.answered.get(kind.name, 0) + 1
                            tally.aborted += 1
                        else:
                            tally.lost.append(f"{kind.name}: {exc.__class__.__name__}: {exc}")
                    continue
                except httpx.HTTPError as exc:
                    with tally.lock:
                        tally.lost.append(f"{kind.name}: {exc.__class__.__name__}: {exc}")
                    continue
                problem = check(kind, response)
                with tally.lock:
                    tally.answered[kind.name] = tally.answered.get(kind.name, 0) + 1
                    tally.latencies.append(time.monotonic() - started)
                    tally.bytes_out += len(response.content)
                    if problem:
                        tally.wrong.append(problem)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(1.0, deadline - time.monotonic()) + 180)


# The /health prober runs in a process of its own (as the kubelet does): probing from a thread of
# this load generator would measure its own GIL contention (16 client threads) instead of the pod.
_PROBER = r"""
import socket, sys, time
port, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
while time.monotonic() < until:
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        ok = answer.startswith(b"HTTP/1.1 200")
        print(f"{time.monotonic() - started:.6f}" if ok else "fail " + answer[:40].decode("latin-1"), flush=True)
    except OSError as exc:
        print(f"fail {exc.__class__.__name__}", flush=True)
    time.sleep(0.1)
"""


def start_health_prober(port: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PROBER, str(port), str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def collect_health(prober: subprocess.Popen) -> tuple[list[float], list[str]]:
    try:
        output, _ = prober.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        prober.kill()
        output, _ = prober.communicate(timeout=10)
    latencies = [float(line) for line in output.split() if re.fullmatch(r"[0-9.]+", line)]
    failures = [line for line in output.splitlines() if line.startswith("fail")]
    return latencies, failures


def sample_process(pid: int, stop: threading.Event, samples: list[dict], started: float) -> None:
    while not stop.is_set():
        try:
            samples.append({"t": round(time.monotonic() - started, 2), **proc_status(pid)})
        except (OSError, AttributeError):
            return
        stop.wait(1.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def slope_mb_per_min(points: list[tuple[float, int]]) -> float:
    if len(points) < 3:
        return 0.0
    slope = statistics.linear_regression([t for t, _ in points], [r for _, r in points]).slope
    return slope * 60 / 2**20


def wait_idle(service: ServiceProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and service.inflight() > 0:
        time.sleep(0.2)
    time.sleep(2.0)  # let finished driver threads exit


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    log_path = root / "service.log"
    kinds = workload(root, args.samples)
    service = ServiceProcess(root, args.workers, log_path)
    report: dict = {"duration_s": args.duration, "concurrency": args.concurrency, "samples_per_shard": args.samples,
                    "client_nice": args.client_nice, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                    "kinds": {k.name: {"weight": k.weight, "expected_status": k.status} for k in kinds}}
    try:
        service.wait_healthy(120)
        build_references(service, kinds)
        wait_idle(service)
        before = proc_status(service.process.pid)

        tally, samples = Tally(), []
        stop = threading.Event()
        started = time.monotonic()
        prober = start_health_prober(service.port, args.duration)
        if args.client_nice:
            # The load generator stands in for remote AIS targets: lower its priority so that its
            # 16 client threads do not take the CPU the pod and the prober would have on a real node.
            os.nice(args.client_nice)
        sampler = threading.Thread(target=sample_process, args=(service.process.pid, stop, samples, started),
                                   daemon=True)
        sampler.start()
        load(service, kinds, args.concurrency, started + args.duration, tally)
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join(timeout=10)
        health, health_failures = collect_health(prober)
        wait_idle(service)
        after = proc_status(service.process.pid)
        stop_seconds = service.stop()
    finally:
        if service.process.poll() is None:
            service.stop()

    warm_up = min(max(5.0, args.duration * 0.1), 60.0)
    settled = [(s["t"], s["rss"]) for s in samples if s["t"] >= warm_up]
    rss_at_warm_up = settled[0][1] if settled else before["rss"]
    rss_end = settled[-1][1] if settled else after["rss"]
    answered = sum(tally.answered.values())
    report.update({
        "elapsed_s": round(elapsed, 1),
        "requests": {"sent": sum(tally.sent.values()), "answered": answered, "lost": len(tally.lost),
                     "wrong": len(tally.wrong), "aborted_as_allowed": tally.aborted, "by_kind": tally.answered},
        "shards_per_s": round(answered / elapsed, 2),
        "mb_out_per_s": round(tally.bytes_out / elapsed / 2**20, 2),
        "request_latency_s": {"p50": round(percentile(tally.latencies, 50), 3),
                              "p99": round(percentile(tally.latencies, 99), 3)},
        "health": {"probes": len(health), "failures": len(health_failures),
                   "p50_ms": round(percentile(health, 50) * 1000, 1), "p99_ms": round(percentile(health, 99) * 1000, 1),
                   "max_ms": round(max(health, default=float("nan")) * 1000, 1)},
        "rss_mb": {"idle_before": round(before["rss"] / 2**20, 1), "after_warm_up": round(rss_at_warm_up / 2**20, 1),
                   "peak": round(max((s["rss"] for s in samples), default=0) / 2**20, 1),
                   "end_of_load": round(rss_end / 2**20, 1), "idle_after": round(after["rss"] / 2**20, 1),
                   "growth_after_warm_up": round((rss_end - rss_at_warm_up) / 2**20, 1),
                   "slope_mb_per_min": round(slope_mb_per_min(settled), 2), "warm_up_s": warm_up},
        "threads": {"before": before["threads"], "after": after["threads"],
                    "peak": max((s["threads"] for s in samples), default=0)},
        "fds": {"before": before["fds"], "after": after["fds"], "peak": max((s["fds"] for s in samples), default=0)},
        "sigterm_exit_s": round(stop_seconds, 2),
        "loadavg_end": os.getloadavg(),
        "examples": {"wrong": tally.wrong[:5], "lost": tally.lost[:5], "health_failures": health_failures[:5]},
        "samples": samples,
        "service_log": str(service.log_path),
    })
    report["criteria"] = {
        "no_lost_or_wrong_answers": not tally.lost and not tally.wrong and answered > 0,
        f"health_p99_under_{args.health_p99_ms:g}ms": (bool(health) and not health_failures
                                                      and percentile(health, 99) * 1000 < args.health_p99_ms),
        "rss_flat_after_warm_up": rss_end - rss_at_warm_up < RSS_GROWTH_LIMIT,
        "no_thread_leak": after["threads"] <= before["threads"],
        "no_fd_leak": after["fds"] <= before["fds"],
    }
    report["passed"] = all(report["criteria"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--through-ais" in argv:
        from bench.soak_ais import main as through_ais

        return through_ais([arg for arg in argv if arg != "--through-ais"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--through-ais", action="store_true",
                        help="soak through a real AIS, pods killed as it runs (bench/soak_ais.py: "
                             "--through-ais --help lists its options)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=16, help="shard requests in flight (default 16)")
    parser.add_argument("--samples", type=int, default=8, help="samples per good shard (default 8)")
    parser.add_argument("--workers", default="", help="ETL_WORKERS of the service (default: its own default)")
    parser.add_argument("--health-p99-ms", type=float, default=HEALTH_P99_LIMIT_MS,
                        help="pass criterion for the /health p99 (default 100 ms)")
    parser.add_argument("--client-nice", type=int, default=10,
                        help="niceness added to this load generator once the service and prober run (default 10)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args)
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
