"""make demo's steps (scripts/demo.sh) with this interpreter: shards, the service, one shard through it, the
summary and the preview, within a time limit."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo.sh"


def test_make_demo_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    env = {**os.environ, "PY": sys.executable, "OUT": str(out)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parents[1], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    steps = [line for line in text.splitlines() if line.startswith("== ")]
    assert [step[:5] for step in steps] == ["== 1.", "== 2.", "== 3.", "== 4."], text
    assert "Running" in text  # /health
    assert "HTTP 200:" in text
    assert 'etl_samples_total{outcome="ok"} 100.0' in text, text[-2000:]
    with tarfile.open(out / "demo-000000.transformed.tar") as archive:
        names = archive.getnames()
    assert sum(name.endswith(".npy") for name in names) == 100
    assert (out / "preview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["demo-000000.tar", "demo-000001.tar"]
