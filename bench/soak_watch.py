"""What the through-AIS soak watches while it runs: AIS's ETL stages, the pods' ``/health``, and the RSS,
threads and open files of every aisnode and every pod (``bench/soak_ais.py``).

* ``StageWatch`` polls the proxy's ETL list (``GET /v1/etl``) twice a second and keeps every change of
  stage of the soak's ETLs (``Initializing``, ``Running``, ``Aborted``, or gone);
* ``HealthProber`` runs in a process of its own, as the kubelet does (probing from a thread of the
  soak would measure the soak's own GIL contention): ``GET /health`` on a fresh connection to every
  pod the soak says is up, every 100 ms, each probe written with its start and end time;
* ``ProcessSampler`` reads ``/proc/<pid>`` of each aisnode and each running pod every two seconds
  (``Node.process.pid``, ``Pod.pid``: the host pid, for process and container pods alike).

Times are ``time.monotonic()`` seconds, the same clock in the prober's process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def proc_status(pid: int) -> dict[str, int]:
    """RSS (bytes), threads, open file descriptors and how many of them are sockets, from ``/proc``."""
    text = Path(f"/proc/{pid}/status").read_text()
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return {
        "rss": int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024,
        "threads": int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1)),
        "fds": len(fds),
        "sockets": sockets,
    }


def etl_stages(client, names: set[str]) -> dict[str, str]:
    """The stage AIS reports for each of ``names`` ('' for one it does not list)."""
    found = {info.id: info.stage for info in client.cluster().list_etls(stages=["Initializing", "Running", "Aborted"])}
    return {name: found.get(name, "") for name in names}


@dataclass
class StageWatch:
    """Every change of stage of ``names`` as the proxy lists them: ``(time, etl, old, new)``."""

    client: object
    names: set[str]
    interval: float = 0.5
    transitions: list[tuple[float, str, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    current: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _polling: threading.Lock = field(default_factory=threading.Lock)
    _paused: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.current = etl_stages(self.client, self.names)
        self._thread = threading.Thread(target=self._run, name="soak-stages", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """No polls until ``resume`` (while the processes are read idle); a poll under way ends first."""
        with self._polling:
            self._paused = True

    def resume(self) -> None:
        self._paused = False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._polling:
                if not self._paused:
                    self._poll()

    def _poll(self) -> None:
        try:
            stages = etl_stages(self.client, self.names)
        except Exception as exc:  # noqa: BLE001 - a failed poll is a figure of the run, not its end
            self.errors.append(f"{time.monotonic():.1f}: {exc.__class__.__name__}: {exc}")
            return
        for name, stage in stages.items():
            self.observe(name, stage)

    def observe(self, name: str, stage: str) -> None:
        """A stage seen now, by this poll or by another caller of the same list (a stage shorter than the
        poll's interval, such as Aborted before an operator's start, is seen by the one who waited for it)."""
        with self._lock:
            if stage != self.current.get(name):
                self.transitions.append((time.monotonic(), name, self.current.get(name, ""), stage))
                self.current[name] = stage

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


# One line per probe: "<start> <end> <pod> ok|fail <why>". The list of pods is a JSON file the soak
# rewrites (atomically) whenever an ETL goes down or comes back; the prober ends when it is removed.
_PROBER = r"""
import json, socket, sys, time
path, interval = sys.argv[1], float(sys.argv[2])
while True:
    try:
        with open(path) as f:
            pods = json.load(f)
    except FileNotFoundError:
        break
    except ValueError:
        pods = []
    for name, host, port in pods:
        started = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.settimeout(5)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            result = "ok" if answer[:5] == b"HTTP/" and answer[8:13] == b" 200 " else "fail " + repr(answer[:40])
        except OSError as exc:
            result = "fail " + exc.__class__.__name__
        print(f"{started:.6f} {time.monotonic():.6f} {name} {result}", flush=True)
    time.sleep(interval)
"""


@dataclass(frozen=True)
class Probe:
    start: float
    end: float
    pod: str
    ok: bool
    why: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class HealthProber:
    """Probes ``GET /health`` of the pods it is told are up (``set_pods``), from a process of its own."""

    def __init__(self, folder: Path, interval: float = 0.1):
        self._pods_file = folder / "health-pods.json"
        self._output = folder / "health-probes.txt"
        self._pods: dict[str, list[tuple[str, str, int]]] = {}  # ETL -> [(pod, host, port)]
        self._lock = threading.Lock()
        self._write()
        with open(self._output, "wb") as sink:
            self._process = subprocess.Popen([sys.executable, "-c", _PROBER, str(self._pods_file), str(interval)],
                                             stdout=sink, stderr=subprocess.STDOUT)

    def set_pods(self, etl: str, pods: list) -> None:
        """Probe these pods of ``etl`` from now on (none: the ETL is down)."""
        with self._lock:
            self._pods[etl] = [(pod.name, pod.host, pod.port) for pod in pods]
            self._write()

    def _write(self) -> None:
        entries = [entry for pods in self._pods.values() for entry in pods]
        partial = self._pods_file.with_suffix(".tmp")
        partial.write_text(json.dumps(entries))
        os.replace(partial, self._pods_file)

    def stop(self) -> list[Probe]:
        """End the prober; every probe it made."""
        with contextlib.suppress(FileNotFoundError):
            self._pods_file.unlink()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        probes = []
        for line in self._output.read_text(errors="replace").splitlines():
            parts = line.split(" ", 4)
            if len(parts) >= 4 and parts[3] in ("ok", "fail"):
                probes.append(Probe(float(parts[0]), float(parts[1]), parts[2], parts[3] == "ok",
                                    parts[4] if len(parts) > 4 else ""))
        return probes


@dataclass
class ProcessSampler:
    """RSS, threads and fds of the cluster's aisnode processes and of every running pod, every ``interval``.

    ``processes()`` names what to sample now: an id (``target1``, ``<pod>@<pid>``) -> pid. Each sample is
    ``{"t", "id", "rss", "threads", "fds"}``; the machine's load average is sampled with them.
    """

    processes: object  # Callable[[], dict[str, int]]
    interval: float = 2.0
    samples: list[dict] = field(default_factory=list)
    load: list[tuple[float, float, float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict[str, dict[str, int]]:
        """One reading of every process now (a process gone meanwhile is left out)."""
        now = time.monotonic()
        readings = {}
        try:
            processes = self.processes()
        except Exception as exc:  # noqa: BLE001 - the next sample tries again
            self.errors.append(f"{now:.1f}: {exc.__class__.__name__}: {exc}")
            return readings
        for ident, pid in processes.items():
            try:
                readings[ident] = proc_status(pid)
            except (OSError, AttributeError):
                continue
            self.samples.append({"t": now, "id": ident, **readings[ident]})
        self.load.append((now, *os.getloadavg()))
        return readings

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-proc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
