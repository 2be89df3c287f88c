"""bench/device_scaling.sh's summary table, run on a sweep whose rows come from bench.scaling's own LoadRun.summary():
every column it prints is one the sweep records (the PSS column once read a key nothing wrote)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.scaling import LoadRun, ProcessLoad

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_scaling.sh"


def summary_program() -> str:
    """The script's last here-document: the Python that prints summary.md from the runs' scaling.json."""
    programs = re.findall(r"<<'EOF'[^\n]*\n(.*?)\nEOF\n", SCRIPT.read_text(), re.S)
    assert programs and "PSS MiB" in programs[-1], "device_scaling.sh: the summary is its last Python program"
    return programs[-1]


def sweep_row(workers: int, pss: int) -> dict:
    run = LoadRun(design="processes", workers=workers, processes=-1, preset="imagenet-train", images_kind="imagenet",
                  images=1200 * workers, wall=1.0, pod_cpu_seconds=1.5 * workers,
                  per_process=[ProcessLoad("server", 1, 0.2, 0.05), ProcessLoad("worker", 2, 1.3, 0.2)],
                  memory={"pss": pss, "uss": {"server": [400 * 2**20]}})
    return {**run.summary(), "concurrency": 2 * workers}


def test_the_summary_prints_each_runs_pss(tmp_path: Path) -> None:
    result = {"machine": {"cpus": 16}, "date": "2026-11-28 10:00 UTC", "commit": "abc1234",
              "cores_sweep": [sweep_row(1, 900 * 2**20), sweep_row(16, 3 * 2**30)]}
    (tmp_path / "scaling").mkdir()
    (tmp_path / "scaling" / "scaling.json").write_text(json.dumps(result))
    done = subprocess.run([sys.executable, "-", str(tmp_path)], input=summary_program(), capture_output=True,
                          text=True, timeout=60, check=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| processes |")]
    assert len(rows) == 2, done.stdout
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| design |"))
    pss = [cell.strip() for cell in header.strip("|").split("|")].index("PSS MiB")
    assert [row[pss] for row in cells] == ["900", "3,072"]
    assert [row[3] for row in cells] == ["1.00", "1.00"]  # images/s over the 1-worker rate times the workers
    assert "## scaling: 16 CPUs, 2026-11-28 10:00 UTC, commit abc1234" in done.stdout
