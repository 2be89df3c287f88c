"""The README's example stays runnable: local service, loader, prefetcher, a few training steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.contract.harness import base_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


@pytest.mark.slow
def test_training_example_runs_locally() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--batch-size", "4", "--workers", "1",
         "--arch", "mobilenet_v3_small"],
        capture_output=True, text=True, timeout=300, env=base_env(), cwd=EXAMPLE.parents[1],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "96 samples in 6 shards" in result.stdout
    steps = re.findall(r"step (\d+): loss (\d+\.\d+), .* loader errors (\d+)", result.stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2]
    assert all(errors == "0" for _, _, errors in steps)
    assert "communication: hpull://" in result.stdout  # the runtime spec it would register on AIS
