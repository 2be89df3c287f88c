"""Start a service under test in a subprocess and build requests exactly as an AIS target does.

``Service`` runs a command (our ``python -m transformer serve`` or the SDK reference under uvicorn)
with a chosen environment, waits for ``GET /health`` = 200 within a bounded time, and keeps its log
for the failure message. The helpers encode ``etl_fqn`` and unames the way AIS does (Go's
``url.PathEscape``, then the query encoded again: AIS's ext/etl/communicator.go).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlencode

import httpx

from .fake_ais import go_path_escape

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fqn_query(fqn: str, etl_args: str | None = None) -> str:
    """``etl_fqn`` as AIS sends it over HTTP: PathEscape(fqn), then URL-encoded again (double-encoded)."""
    params = {"etl_fqn": go_path_escape(fqn)}
    if etl_args:
        params["etl_args"] = etl_args
    return urlencode(params)


def args_query(etl_args: str) -> str:
    return urlencode({"etl_args": etl_args})


def uname(bucket: str, name: str, provider: str = "ais") -> str:
    """``<provider>/@#/<bucket>/<name>``: AIS's global-namespace uname (cmn/bck.go)."""
    return f"{provider}/@#/{bucket}/{name}"


def escaped_uname(bucket: str, name: str) -> str:
    """The one path segment AIS uses for hpull and direct put: ``PathEscape(uname)``."""
    return go_path_escape(uname(bucket, name))


class Service:
    """A server process on 127.0.0.1:<port>; ``stop()`` ends exactly the process it started.

    Each keeps its own log file (``<name>.log``, then ``<name>-2.log``, ...: a later one never overwrites
    an earlier one's), and ``Service.started`` lists every one made, stopped ones too, for checks at the end.
    """

    started: ClassVar[list[Service]] = []

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path, port: int):
        self.name = name
        self.port = port
        self.env = env
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        copies = 1
        while self.log_path.exists():
            copies += 1
            self.log_path = log_dir / f"{name}-{copies}.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.process = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        Service.started.append(self)

    def wait_healthy(self, timeout: float) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:  # stopped: already flushed (a start that timed out reports its log after stop)
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()


def base_env(**overrides: str) -> dict[str, str]:
    """The test process's environment without any ETL_* setting of the developer's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETL_") and k not in ("AIS_TARGET_URL",)}
    env.update(overrides)
    return env


def start_transformer(name: str, log_dir: Path, env: dict[str, str], timeout: float = 90.0) -> Service:
    port = free_port()
    command = [sys.executable, "-m", "transformer", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return Service(name, command, env, log_dir, port).wait_healthy(timeout)


def start_reference(log_dir: Path, env: dict[str, str], timeout: float = 60.0) -> Service:
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.contract.reference_server:app", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    return Service("reference", command, env, log_dir, port).wait_healthy(timeout)
