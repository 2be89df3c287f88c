"""A kept run's stamp, the one way every benchmark takes it: the commit whose code it measured, when it started,
and the machine it ran on. ``tests/test_kept_runs.py`` reads the commit and date back from each report."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*command: str) -> str:
    with contextlib.suppress(OSError):
        return subprocess.run(["git", *command], capture_output=True, text=True, cwd=REPO, timeout=30).stdout.strip()
    return ""


def git_state() -> dict[str, str]:
    """The checked-out commit, short (with " (dirty)" when transformer/ or bench/ differs from it; new files do not
    count) and full. Taken when a run starts: the checkout may move on while it measures."""
    dirty = " (dirty)" if _git("status", "--porcelain", "--untracked-files=no", "--", "transformer", "bench") else ""
    return {"git": (_git("rev-parse", "--short", "HEAD") or "unknown") + dirty, "commit": _git("rev-parse", "HEAD")}


def stamp() -> dict[str, str]:
    """The commit (``git_state``'s short form) and the date and time now: what every kept run's report states near its
    top. Taken when a run starts."""
    return {"git": git_state()["git"], "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def stamp_line(meta: dict) -> str:
    """The report's line naming the commit whose code the run measured, and its date."""
    return f"Commit: {meta.get('git') or meta.get('commit') or 'unknown'}, date: {meta.get('started', 'unknown')}."


def short_commit() -> str:
    """The checked-out commit's short hash alone (a run folder's name)."""
    return _git("rev-parse", "--short", "HEAD")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine a run measured: its CPU, CPUs online, platform, Python and load average now."""
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()]}
