"""The README's example stays runnable: local service, loader, prefetcher, a few training steps; a run
stopped at a checkpoint and resumed trains on the batches the uninterrupted run had."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server(reason="runs the example, which starts the service (python -m transformer serve)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEP = re.compile(r"step (\d+): loss (\d+\.\d+), .* loader errors (\d+), batch ([0-9a-f]{12})")


def run(*args: str, cwd: Path = EXAMPLE.parents[1]) -> subprocess.CompletedProcess:
    from testbed.service import base_env

    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--batch-size", "4", "--workers", "1", "--arch", "mobilenet_v3_small",
         "--log-batches", *args],
        capture_output=True, text=True, timeout=300, env=base_env(), cwd=cwd,
    )


def train(*args: str, cwd: Path = EXAMPLE.parents[1]) -> str:
    result = run(*args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
def test_training_example_runs_locally_and_resumes_mid_epoch(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ck.pt"  # given relative to the working folder, as a user types it
    first = train("--steps", "3", "--checkpoint", "ck.pt", "--checkpoint-every", "2", cwd=tmp_path)
    assert "96 samples in 6 shards" in first
    steps = STEP.findall(first)
    assert [int(s) for s, _, _, _ in steps] == [1, 2, 3]
    assert all(errors == "0" for _, _, errors, _ in steps)
    assert "communication: hpull://" in first  # the runtime spec it would register on AIS
    assert "checkpoint" in first and checkpoint.is_file() and (tmp_path / "ck.pt.work" / "mountpath").is_dir()

    resumed = train("--steps", "4", "--checkpoint", str(checkpoint), "--checkpoint-every", "2", "--resume")
    assert "at step 2: epoch 0, after batch 2 of it" in resumed
    after = STEP.findall(resumed)
    assert [int(s) for s, _, _, _ in after] == [3, 4]
    assert after[0][3] == steps[2][3]  # step 3 trains on the batch the first run had at step 3


@pytest.mark.slow
def test_an_epoch_in_which_every_sample_fails_stops_the_run(tmp_path: Path) -> None:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    cut = buffer.getvalue()[:len(buffer.getvalue()) // 2]  # its header passes convert's check, its data is cut
    for label in ("a", "b"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "data" / label / f"{i}.jpg").write_bytes(cut)
    result = run("--steps", "3", "--data", str(tmp_path / "data"), "--workdir", str(tmp_path / "work"))
    assert result.returncode != 0 and "step 1:" not in result.stdout
    assert "error: epoch 0 gave no batch" in result.stderr, result.stderr[-2000:]
