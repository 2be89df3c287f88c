"""Servers under test (this service, the conventional peer) and the clients that drive them like AIS does.

HTTP requests are made with ``curl``: a C client like the Go AIS target, which sends the body and reads
the response at the same time (a streaming server needs that) and costs little CPU on a 2-core box,
so the client does not eat the cores being measured. ``curl`` reports time to first byte and total
time per request itself. WebSocket requests are framed as the target frames them (Binary JSON control
message, reply = one Binary message), with ``wsproto`` over a socket and the reply counted as it
streams in (``read_ws_message``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import psutil
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request

from testbed.aisnames import go_path_escape
from testbed.ports import free_port
from testbed.service import REPO_ROOT, Service, base_env, serve_command


class RssSampler:
    """Peak resident memory of a process tree (the server and its workers), sampled every ``interval``.

    RSS is summed over the processes, so pages shared by forked workers count once per worker: that is
    what each worker costs a node once its pages are touched, and what ``ps``/cAdvisor report. Listing
    children scans all of /proc (about 2 ms), so the tree is re-listed only every ``relist`` seconds;
    reading one process's RSS costs about 10 us. The sampler must not eat the CPU it measures.
    """

    def __init__(self, pid: int, interval: float = 0.02, relist: float = 1.0):
        self._root = psutil.Process(pid)
        self._interval, self._relist = interval, relist
        self._tree: list[psutil.Process] = [self._root]
        self._listed = 0.0
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss {pid}", daemon=True)
        self._thread.start()

    def current(self) -> int:
        now = time.monotonic()
        if now - self._listed > self._relist:
            with contextlib.suppress(psutil.Error):
                self._tree = [self._root, *self._root.children(recursive=True)]
            self._listed = now
        total = 0
        for process in self._tree:
            with contextlib.suppress(psutil.Error):  # a worker exiting between listing and reading
                total += process.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            value = self.current()
            with self._lock:
                self._peak = max(self._peak, value)

    def reset(self) -> None:
        with self._lock:
            self._peak = self.current()

    def peak(self) -> int:
        with self._lock:
            return max(self._peak, self.current())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Server(Service):
    """A server subprocess on 127.0.0.1 (``testbed.service.Service``), its memory sampled once it is ready."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path, port: int,
                 cwd: Path = REPO_ROOT):
        super().__init__(name, command, env, log_dir, port, cwd=cwd)
        self.rss: RssSampler | None = None
        self.idle_rss = 0

    def ready(self, timeout: float = 180.0) -> Server:
        """Wait for ``GET /health`` = 200 (bounded), then start sampling memory. Servers may start in parallel."""
        self.wait_healthy(timeout)
        self.rss = RssSampler(self.process.pid)
        self.idle_rss = self.rss.current()
        return self

    def cpu_seconds(self) -> float:
        """User + system CPU of the whole tree so far (for CPU per image)."""
        total = 0.0
        try:
            processes = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.Error:
            return 0.0
        for process in processes:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def stop(self, grace: float = 15.0) -> float:
        """The sampler, then the process tree (uvicorn's supervisor forwards SIGTERM to its workers)."""
        if self.rss is not None:
            self.rss.stop()
        return super().stop(grace)


def start_service(log_dir: Path, fqn_root: Path, workers: int, extra_env: dict[str, str] | None = None,
                  name: str = "service", source: Path = REPO_ROOT) -> Server:
    """This service as the pod runs it (``python -m transformer serve``); call ``ready()`` before use.

    ``source``: the source tree whose ``transformer`` package runs (another checkout, for an A/B).
    """
    port = free_port()
    env = base_env(ETL_WORKERS=str(workers), ETL_FQN_ROOTS=str(fqn_root), ETL_LOG_LEVEL="warning",
                   ETL_OBJ_TIMEOUT="900s", PYTHONPATH=str(source), **(extra_env or {}))
    return Server(name, serve_command(port), env, log_dir, port, cwd=source)


def start_peer(log_dir: Path, workers: int, name: str = "peer") -> Server:
    """The conventional ETL: uvicorn, one worker process per core, one torch thread per worker."""
    port = free_port()
    # The SDK base class requires AIS_TARGET_URL; nothing here calls it (body and FQN inputs only).
    env = base_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", AIS_TARGET_URL="http://127.0.0.1:9")
    command = [sys.executable, "-m", "uvicorn", "bench.peers.conventional_etl:fastapi_app", "--host", "127.0.0.1",
               "--port", str(port), "--workers", str(workers), "--no-access-log", "--log-level", "warning",
               "--ws-max-size", str(16 * 2**30), "--ws-ping-interval", "0", "--ws-ping-timeout", "86400"]
    return Server(name, command, env, log_dir, port)


# ------------------------------------------------------------------------------------------ clients


@dataclass
class Result:
    """One shard request."""

    ok: bool
    status: int
    ttfb: float  # seconds from the request's start to the first response byte
    seconds: float
    bytes_in: int
    bytes_out: int
    error: str = ""


def curl_available() -> bool:
    return shutil.which("curl") is not None


def hpush(url: str, object_path: str, shard: Path, mode: str, etl_args: str, timeout: float) -> Result:
    """One hpush PUT as an AIS target sends it: ``body`` (the shard as the body) or ``fqn`` (empty body)."""
    query = {"etl_args": etl_args} if etl_args else {}
    command = ["curl", "-sS", "-o", "/dev/null", "--max-time", f"{timeout:.0f}", "-H", "Expect:",
               "-w", "%{http_code} %{time_starttransfer} %{time_total} %{size_upload} %{size_download}"]
    if mode == "body":
        command += ["-T", str(shard)]
    else:
        query = {"etl_fqn": go_path_escape(str(shard)), **query}  # urlencode escapes it once more: double
        command += ["-X", "PUT"]
    command.append(f"{url}/{object_path}" + (f"?{urlencode(query)}" if query else ""))
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 10)
    seconds = time.monotonic() - start
    try:
        status_text, ttfb, total, up, down = done.stdout.split()
        status = int(status_text)
    except ValueError:
        return Result(False, 0, 0.0, seconds, 0, 0, (done.stderr or done.stdout).strip()[:300])
    bytes_in = int(float(up)) if mode == "body" else shard.stat().st_size
    ok = done.returncode == 0 and status == 200
    return Result(ok, status, float(ttfb), float(total), bytes_in, int(float(down)),
                  "" if ok else f"curl rc {done.returncode}, HTTP {status}: {done.stderr.strip()[:300]}")


def hpull(url: str, shard: Path, etl_args: str, timeout: float) -> Result:
    """One hpull GET as an AIS target sends it without ``etl_fqn``: ``GET /<PathEscape(uname)>``; the pod fetches
    the object from its ``AIS_TARGET_URL`` (a ``FileTarget`` here)."""
    query = {"etl_args": etl_args} if etl_args else {}
    uname = go_path_escape(f"ais/@#/{shard.parent.parent.name}/{shard.name}")
    command = ["curl", "-sS", "-o", "/dev/null", "--max-time", f"{timeout:.0f}",
               "-w", "%{http_code} %{time_starttransfer} %{time_total} %{size_download}",
               f"{url}/{uname}" + (f"?{urlencode(query)}" if query else "")]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 10)
    seconds = time.monotonic() - start
    try:
        status_text, ttfb, total, down = done.stdout.split()
        status = int(status_text)
    except ValueError:
        return Result(False, 0, 0.0, seconds, 0, 0, (done.stderr or done.stdout).strip()[:300])
    ok = done.returncode == 0 and status == 200
    return Result(ok, status, float(ttfb), float(total), shard.stat().st_size, int(float(down)),
                  "" if ok else f"curl rc {done.returncode}, HTTP {status}: {done.stderr.strip()[:300]}")


class FileTarget:
    """What the pod fetches from in hpull (and asks an object's size, HEAD, for ``etl_fqn``): the AIS target's
    ETL object endpoint, serving a folder's files by the last name in the escaped uname.

    ``http.server`` with ``socket.sendfile``: the file goes from the page cache to the socket without this
    process copying it, so the target costs the measured cores little, as a Go target would.
    """

    def __init__(self, folder: Path):
        import http.server
        from urllib.parse import unquote

        files = folder

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _file(self) -> Path | None:
                name = unquote(self.path.split("?", 1)[0]).rsplit("/", 1)[-1]
                path = files / name
                return path if name and path.is_file() else None

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                path = self._file()
                self.send_response(200 if path else 404)
                self.send_header("Content-Length", str(path.stat().st_size if path else 0))
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                path = self._file()
                if path is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                self.wfile.flush()
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    self.connection.sendfile(f)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="file target", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ws_request(url: str, shard: Path, etl_args: str, timeout: float) -> Result:
    """One ws:// request with ``fqn`` (the target's default): Binary control message, one Binary reply.

    ``wsproto`` does the handshake and frames the control message; the reply is counted by
    ``read_ws_message``, which skips the payload as it streams in, like ``curl -o /dev/null``: the
    ``websockets`` client assembles the whole reply (one message per shard, 600 MB for 1,000 float32
    images) and spent 1.2-2.6 ms of CPU per image doing it, on the same two cores as the server it was
    measuring; wsproto, which copies every byte into its buffer and out again, about 0.2 ms.
    """
    host, port = url.removeprefix("http://").split(":")
    control = {"path": shard.name, "fqn": go_path_escape(str(shard))}  # single-encoded inside the JSON
    if etl_args:
        control["etl_args"] = etl_args
    start = time.monotonic()
    deadline = start + timeout
    connection = WSConnection(ConnectionType.CLIENT)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(connection.send(Request(host=f"{host}:{port}", target="/ws")))
            accepted = False
            while not accepted:  # the server sends nothing after its handshake until it has a request
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                connection.receive_data(data)
                for event in connection.events():
                    if isinstance(event, AcceptConnection):
                        accepted = True
                    else:
                        raise ConnectionError(f"unexpected {event!r}"[:300])
            sock.sendall(connection.send(BytesMessage(data=json.dumps(control).encode())))
            received, first = read_ws_message(sock, deadline)
            sock.sendall(connection.send(CloseConnection(code=1000)))
    except Exception as exc:  # a failed request is a result (reported), not a crash of the benchmark
        return Result(False, 0, 0.0, time.monotonic() - start, 0, 0, f"{exc.__class__.__name__}: {exc}"[:300])
    seconds = time.monotonic() - start
    # One message per object, which this service sends frame by frame as the shard is transformed
    # (a server that sends it whole has its first byte come with the last: ttfb close to the total).
    return Result(True, 200, first - start, seconds, shard.stat().st_size, received)


def read_ws_message(sock: socket.socket, deadline: float, sink: bytearray | None = None) -> tuple[int, float]:
    """Read one Binary message from a server (unmasked frames, RFC 6455 5.2) and count its payload.

    Returns the payload bytes and the ``time.monotonic()`` of the first byte; ``sink``, when given,
    receives the payload (for tests). Written by hand because no Python WebSocket client reads a
    message without copying it (see ``ws_request``): this reads into one buffer and skips the payload.
    Any other frame (Text, Close, a control frame) is an error: the benchmark expects a reply.
    """
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    start = end = 0  # unparsed bytes: buffer[start:end]
    left, received, first, fin, frames = 0, 0, 0.0, False, 0
    sock.settimeout(max(0.1, deadline - time.monotonic()))  # for each read (a stalled server), not in all
    while True:
        if left and end > start:  # payload
            take = min(left, end - start)
            if sink is not None:
                sink += view[start:start + take]
            left, received, start = left - take, received + take, start + take
            if not left and fin:
                return received, first
            continue
        if not left and end - start >= 2:  # a frame header
            b0, b1 = buffer[start], buffer[start + 1]
            size = b1 & 0x7F
            header = 2 + {126: 2, 127: 8}.get(size, 0)
            if end - start >= header:
                if size >= 126:
                    size = int.from_bytes(view[start + 2:start + header], "big")
                opcode, fin = b0 & 0x0F, bool(b0 & 0x80)
                if b1 & 0x80 or opcode != (0x2 if frames == 0 else 0x0):
                    raise ConnectionError(f"unexpected frame: opcode {opcode}, first byte {b0:#x}, after "
                                          f"{received} bytes of the reply")
                frames += 1
                start += header
                left = size
                if not left and fin:
                    return received, first
                continue
        if start == end:
            start = end = 0
        elif end == len(buffer):  # a header split across reads: move it to the front
            buffer[:end - start] = bytes(view[start:end])
            start, end = 0, end - start
        count = sock.recv_into(view[end:])
        if count == 0:
            raise ConnectionError("the server closed the connection before the reply ended")
        first = first or time.monotonic()
        end += count


def run_requests(call, shards: list[Path], concurrency: int) -> tuple[list[Result], float]:
    """Send every shard in ``shards`` with ``concurrency`` requests in flight; (results, wall seconds)."""
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(call, shards))
    return results, time.monotonic() - start


class CurlSink:
    """curl downloading one chunked HTTP/1.1 response from a socket this process writes: the bench's client.

    ``send(pieces)`` writes one chunked frame with ``sendmsg`` from the caller's buffers (no copy in
    Python), as the service's direct send does; ``close()`` ends the body, waits for curl and returns its
    CPU seconds. What moving the output to a client costs, without tar, compute or event loop.
    """

    def __init__(self):
        import resource

        from transformer.server.ipc import drop_sent

        self._resource, self._drop_sent = resource, drop_sent
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self._before = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._curl = subprocess.Popen(["curl", "-sS", "-o", "/dev/null", "-w", "%{size_download}",
                                       f"http://127.0.0.1:{port}/"], stdout=subprocess.PIPE, text=True)
        self.sent = 0  # body bytes (frame payloads), checked against what curl received
        try:
            self._listener.settimeout(30)
            self._connection, _ = self._listener.accept()
            self._connection.recv(65536)
            self._connection.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        except BaseException:
            self.abort()
            raise

    def send(self, pieces: list) -> None:
        size = sum(len(p) for p in pieces)
        self.sent += size
        parts = [b"%x\r\n" % size, *pieces, b"\r\n"]
        while parts:
            self._drop_sent(parts, self._connection.sendmsg(parts))

    def close(self) -> float:
        """End the body, wait for curl (which must succeed and have received every byte); curl's CPU seconds."""
        self._connection.sendall(b"0\r\n\r\n")
        self._connection.close()
        self._listener.close()
        received, _ = self._curl.communicate(timeout=120)
        if self._curl.returncode != 0 or received.strip() != str(self.sent):
            raise RuntimeError(f"curl exited with {self._curl.returncode} after {received.strip()} of "
                               f"{self.sent} bytes")
        after = self._resource.getrusage(self._resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (self._before.ru_utime + self._before.ru_stime)

    def abort(self) -> None:
        """Stop curl and close the sockets (after a failure: no body end, no checks)."""
        self._curl.kill()
        self._curl.communicate()
        for closable in (getattr(self, "_connection", None), self._listener):
            if closable is not None:
                closable.close()


def http_floor(frame_bytes: int, frames: int) -> dict:
    """The least CPU that moving ``frames`` output images to the caller costs on this machine.

    ``frames`` chunked frames of ``frame_bytes`` from one preallocated buffer to curl (``CurlSink``):
    no tar, no compute, no event loop. This thread's CPU (kernel send) and curl's (kernel receive) are a
    floor under the service's overhead.
    """
    payload = os.urandom(frame_bytes)
    sink = CurlSink()
    wall, start = time.perf_counter(), time.thread_time()
    try:
        for _ in range(frames):
            sink.send([payload])
    except BaseException:
        sink.abort()
        raise
    server = time.thread_time() - start
    client = sink.close()
    wall = time.perf_counter() - wall
    return {"frame_bytes": frame_bytes, "frames": frames, "gb_per_s": frame_bytes * frames / wall / 1e9,
            "server_cpu_ms_per_image": server / frames * 1e3, "client_cpu_ms_per_image": client / frames * 1e3}
