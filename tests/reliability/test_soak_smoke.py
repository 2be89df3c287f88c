"""A 10-second smoke of the soak script (bench/soak.py): 16 concurrent shards, mixed good and corrupt.

The full run (``python -m bench.soak --duration 600``) is not part of CI; its figures are in
docs/reliability.md. Here every answer must still be right, nothing may be lost and no thread or
fd may leak; the /health bound is loosened to 1 s because CI machines are shared (the kubelet's
readiness timeout is 5 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_soak_smoke_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "bench.soak", "--duration", "10", "--concurrency", "16", "--samples", "4",
               "--health-p99-ms", "1000", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["lost"] == 0 and requests["wrong"] == 0, report["examples"]
    assert requests["answered"] == requests["sent"] >= 16
    assert set(requests["by_kind"]) == set(report["kinds"]), "every kind of shard was exercised"
    assert report["threads"]["after"] <= report["threads"]["before"]
    assert report["fds"]["after"] <= report["fds"]["before"]
    assert report["health"]["probes"] > 0 and report["health"]["failures"] == 0
    assert result.returncode == 0, json.dumps(report["criteria"])
