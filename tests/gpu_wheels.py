"""The wheels ``make gpu-wheels`` fetches, for the tests that need them: the checkout's ``.gpu-wheels/`` when it holds
exactly the pins, else fetched once by the same make target into ``~/.cache/ais-wds-transformer/gpu-wheels-<hash of
requirements/gpu-check.txt>`` (``$XDG_CACHE_HOME`` honoured) and renamed into place whole."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import gpu

REPO = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ais-wds-transformer"


def fetched() -> Path:
    """A folder holding exactly the wheels of requirements/gpu-check.txt (network needed the first time)."""
    if gpu.wheels_problem(gpu.WHEELS) is None:
        return gpu.WHEELS
    folder = cache_root() / f"gpu-wheels-{hashlib.sha256(gpu.CARRIED.read_bytes()).hexdigest()[:12]}"
    if gpu.wheels_problem(folder) is None:
        return folder
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    # The Makefile's own recipe, with this interpreter's pip (-o: the venv is not made again for it).
    done = subprocess.run(["make", "-s", "-o", ".venv/.installed", "gpu-wheels", f"GPU_WHEELS={partial}",
                           f"PY={sys.executable}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"make gpu-wheels failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
