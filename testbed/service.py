"""A server under test in a subprocess (this service, or any server with ``GET /health``), waited for until healthy.

``Service`` runs a command with a chosen environment on 127.0.0.1:<port>, waits for ``GET /health`` = 200
within a bounded time, and keeps its log for the failure message; ``stop()`` ends exactly the process it
started. ``start_transformer`` runs ``python -m transformer serve`` as the pod does.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import httpx

from .ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


class Service:
    """A server process on 127.0.0.1:<port>; ``stop()`` ends exactly the process it started.

    Each keeps its own log file (``<name>.log``, then ``<name>-2.log``, ...: a later one never overwrites
    an earlier one's), and ``Service.started`` lists every one made, stopped ones too, for checks at the end.
    """

    started: ClassVar[list[Service]] = []

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path, port: int,
                 cwd: Path = REPO_ROOT):
        self.name = name
        self.port = port
        self.env = env
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        copies = 1
        while self.log_path.exists():
            copies += 1
            self.log_path = log_dir / f"{name}-{copies}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)
        Service.started.append(self)

    def wait_healthy(self, timeout: float, verify: ssl.SSLContext | bool = True) -> Service:
        """Wait for ``GET /health`` = 200; stopped (and its log tail raised) if it exits or is not healthy in time.

        ``verify`` checks an https server's certificate (a context that trusts its CA).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", verify=verify, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:  # stopped: already flushed (a start that timed out reports its log after stop)
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace: float = 10.0) -> float:
        """SIGTERM, up to ``grace`` seconds for the exit, then SIGKILL; returns the seconds it took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return time.monotonic() - started


def base_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any ETL_* setting of the caller's shell, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETL_") and k != "AIS_TARGET_URL"}
    env.update(overrides)
    return env


def serve_command(port: int) -> list[str]:
    """This service as the pod runs it, on 127.0.0.1:``port``."""
    return [sys.executable, "-m", "transformer", "serve", "--host", "127.0.0.1", "--port", str(port)]


def start_transformer(name: str, log_dir: Path, env: dict[str, str], timeout: float = 90.0) -> Service:
    """``python -m transformer serve`` on a free port, once healthy."""
    port = free_port()
    return Service(name, serve_command(port), env, log_dir, port).wait_healthy(timeout)
