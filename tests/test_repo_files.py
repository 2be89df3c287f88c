"""The files git tracks: none over 1 MB, unless listed in ``RAW`` with why it must stay raw and cited by the docs;
and no module longer than its room allows (``MODULE_LINES``): a module that outgrows it holds two concepts.

Raw traces (a soak's series, per-probe timings) are summarised or kept compressed instead
(``bench/results/soak-ais/results.json.gz``, read back by ``bench/soak_report.py``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1_000_000  # bytes

# path -> why it cannot be summarised or compressed; the docs must name the path. None today.
RAW: dict[str, str] = {}

# room -> the most lines a module of it may have (the pod's own code is read most, and kept shortest)
MODULE_LINES = {"transformer": 500, "testbed": 600, "bench": 600, "scripts": 600, "requirements": 600}


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return [name for name in listing.decode().split("\0") if name]


def test_no_tracked_file_is_over_1_mb() -> None:
    sizes = {name: (REPO_ROOT / name).stat().st_size for name in tracked_files() if (REPO_ROOT / name).is_file()}
    too_big = {name: size for name, size in sizes.items() if size > LIMIT and name not in RAW}
    assert not too_big, f"over {LIMIT:,} bytes: summarise or compress them, or list them in RAW: {too_big}"


def test_every_raw_exception_is_big_tracked_and_cited() -> None:
    tracked = set(tracked_files())
    docs = "\n".join(p.read_text() for p in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))])
    for name, why in RAW.items():
        assert why.strip(), name
        assert name in tracked and (REPO_ROOT / name).stat().st_size > LIMIT, f"{name}: no longer needs listing"
        assert name in docs, f"{name}: the docs do not say why it is kept raw"


def test_no_module_is_longer_than_its_room_allows() -> None:
    long = [f"{name}: {lines} lines (at most {MODULE_LINES[name.split('/')[0]]})"
            for name in tracked_files() if name.endswith(".py") and name.split("/")[0] in MODULE_LINES
            for lines in [len((REPO_ROOT / name).read_text().splitlines())]
            if lines > MODULE_LINES[name.split("/")[0]]]
    assert long == []
