"""bench.scaling: the model its projection rests on, and a smoke run of both designs (so the bench cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scaling
from bench.scaling import LoadRun, ProcessLoad, project


def _load(design: str, server_share: float, cores: float = 1.6, images: int = 1600, wall: float = 2.0) -> LoadRun:
    run = LoadRun(design, 2, 0 if design == "threads" else 2, "imagenet-train", "imagenet", images, wall, cores * wall)
    run.per_process.append(ProcessLoad("server", 1, 0.0, server_share))
    return run


def test_the_ceiling_is_the_cores_used_over_the_server_gil_share() -> None:
    threads = _load("threads", 0.35)
    assert threads.ceiling == pytest.approx(1.6 / 0.35)
    assert threads.server_gil_fraction == pytest.approx(0.35 / 1.6)  # GIL s per image over CPU s per image
    assert threads.cpu_ms_per_image == pytest.approx(2.0)
    assert project(500.0, threads.ceiling, 2) == 1000.0
    assert project(500.0, threads.ceiling, 64) == pytest.approx(500.0 * 1.6 / 0.35)  # capped by the GIL
    assert project(500.0, None, 64) == 32_000.0
    assert _load("processes", 0.02).server_gil_fraction <= scaling.TARGET_FRACTION


def test_a_smoke_run_shows_the_server_process_freed_of_the_transforms(tmp_path: Path) -> None:
    assert scaling.main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    result = json.loads((tmp_path / "out" / "scaling.json").read_text())
    loads = {load["design"]: load for load in result["loads"]}
    assert set(loads) == {"threads", "processes"} and all(load["images"] > 0 for load in loads.values())
    roles = [process["role"] for process in loads["processes"]["per_process"]]
    assert roles.count("worker") == 2 and roles.count("forkserver") == 1
    threads, processes = loads["threads"]["server_gil_fraction"], loads["processes"]["server_gil_fraction"]
    assert threads is not None and processes is not None, "py-spy could not attach (it needs ptrace: root)"
    # Shards of 40 images: the server's per-shard work weighs more than in the full run (1/49 to 1/60 there).
    assert processes < threads / 2
    assert "## At full load" in (tmp_path / "out" / "scaling.md").read_text()
