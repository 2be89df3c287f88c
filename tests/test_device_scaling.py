"""bench/device_scaling.sh's summary table, run on a sweep whose rows come from bench.scaling's own sweep_row():
every column it prints is one the sweep records (the PSS column once read a key nothing wrote)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.scaling import Case, ProcessLoad, sweep_row

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_scaling.sh"


def summary_program() -> str:
    """The script's last here-document: the Python that prints summary.md from the runs' scaling.json."""
    programs = re.findall(r"<<'EOF'[^\n]*\n(.*?)\nEOF\n", SCRIPT.read_text(), re.S)
    assert programs and "PSS MiB" in programs[-1], "device_scaling.sh: the summary is its last Python program"
    return programs[-1]


def row(workers: int, inflight: int, pss: int | None) -> dict:
    case = Case("processes", workers, max(1, workers // 3), "fqn", inflight, 1200 * workers, 1.0, 1.5 * workers,
                1.6 * workers, per_process=[ProcessLoad("server", 1, 0.2, 0.05), ProcessLoad("worker", 2, 1.3, 0.2)])
    return sweep_row(case, {"pss": pss, "uss": {}} if pss is not None else None)


def test_the_summary_prints_each_runs_pss_efficiency_and_cores(tmp_path: Path) -> None:
    result = {"machine": {"cpus": 16}, "date": "2026-11-28 10:00 UTC", "commit": "abc1234",
              "sweep": [row(1, 4, 900 * 2**20), row(16, 32, 3 * 2**30), row(16, 1, None)]}
    (tmp_path / "scaling").mkdir()
    (tmp_path / "scaling" / "scaling.json").write_text(json.dumps(result))
    done = subprocess.run([sys.executable, "-", str(tmp_path)], input=summary_program(), capture_output=True,
                          text=True, timeout=60, check=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| processes |")]
    assert len(rows) == 3, done.stdout
    header = next(line for line in done.stdout.splitlines() if line.startswith("| design |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")))) for line in rows]
    assert [c["PSS MiB"] for c in cells] == ["900", "3,072", ""]
    assert [c["/ (1-worker rate x workers)"] for c in cells[:2]] == ["1.00", "1.00"]
    assert [c["pod cores used"] for c in cells] == ["1.50", "24.00", "24.00"]
    assert [c["shards in flight"] for c in cells] == ["4", "32", "1"]
    assert "## scaling: 16 CPUs, 2026-11-28 10:00 UTC, commit abc1234" in done.stdout
