"""bench.scaling: the model its projection rests on, and a smoke run of both designs (so the bench cannot rot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scaling
from bench.scaling import Case, ProcessLoad


def _case(design: str, server_share: float | None, cores: float = 1.6, images: int = 1600, wall: float = 2.0,
          inflight: int = 4, comm: str = "fqn", spread: float | None = None) -> Case:
    case = Case(design, 2, 0 if design == "threads" else 2, comm, inflight, images, wall, cores * wall, 1.9 * wall)
    case.per_process.append(ProcessLoad("server", 1, 0.0, server_share))
    if spread is not None:
        case.per_process += [ProcessLoad("worker", pid, 0.0, 0.3, spread / 2) for pid in (2, 3)]
    return case


def test_the_ceiling_is_the_cores_used_over_the_server_gil_share() -> None:
    threads = _case("threads", 0.32)
    assert threads.ceiling == pytest.approx(1.6 / 0.32)
    assert threads.cpu_ms_per_image == pytest.approx(2.0)
    assert threads.images_per_second == 800 and threads.machine_cores == pytest.approx(1.9)
    assert _case("processes", 0.0).ceiling == float("inf")
    assert _case("processes", None).ceiling is None
    one = _case("processes", 0.01, inflight=1, spread=0.1)  # 10% of 2 s over 1600 images
    assert one.spread_gil_ms_per_image == pytest.approx(1000 * 0.1 * 2.0 / 1600)


def test_the_model_takes_the_least_of_the_bounds() -> None:
    inflight = [_case("threads", None), _case("processes", None, cores=1.7)]
    comms = [_case("threads", 0.32), _case("processes", 0.01, cores=1.7), _case("processes", 0.02, cores=1.7,
                                                                                comm="body")]
    one = _case("processes", 0.01, inflight=1, spread=0.1)
    found = scaling.model(inflight, comms, one, [], bandwidth={"core": 10e9, "node": 200e9}, image_bytes=100_000)
    threads, processes = found["bounds"]["threads"], found["bounds"]["processes"]
    assert threads["per_core"] == pytest.approx(500.0)  # 2 ms of pod CPU per image
    assert threads["server"] == pytest.approx(1.6 / 0.32 * 500.0)  # 5 cores' worth
    assert processes["server"] == pytest.approx(1.7 / 0.02 * processes["per_core"])  # the worst comm type
    assert processes["one_shard"] == pytest.approx(1000 / one.spread_gil_ms_per_image)
    traffic = scaling._bytes_moved(100_000)
    assert processes["memory"] == pytest.approx(200e9 / traffic)  # at 64 cores, the node's bandwidth
    projection = found["projection"]
    assert projection["threads"]["2"] == pytest.approx(1000.0) and projection["threads"]["64"] == pytest.approx(2500.0)
    for cores in scaling.CORES:
        memory = min(cores * 10e9, 200e9) / traffic  # each core's bandwidth, up to the node's
        expected = min(cores * processes["per_core"], processes["server"], memory)
        assert projection["processes"][str(cores)] == pytest.approx(expected)
        assert projection["processes, one shard"][str(cores)] == pytest.approx(min(expected, processes["one_shard"]))


def test_a_smoke_run_shows_the_server_process_freed_of_the_transforms(tmp_path: Path) -> None:
    assert scaling.main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                         "--comms", "fqn,body"]) == 0
    result = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert {(c["design"], c["inflight"]) for c in result["inflight"]} == {
        (design, count) for design in ("threads", "processes") for count in (1, 2)}
    assert all(case["images"] > 0 for case in result["inflight"]) and "1" in result["ratios"]
    comms = {(case["design"], case["comm"]): case for case in result["comms"]}
    assert set(comms) == {(design, comm) for design in ("threads", "processes") for comm in ("fqn", "body")}
    roles = [process["role"] for process in comms["processes", "fqn"]["per_process"]]
    assert roles.count("worker") == 2 and roles.count("forkserver") == 1
    for comm in ("fqn", "body"):
        threads, processes = comms["threads", comm]["server_gil_share"], comms["processes", comm]["server_gil_share"]
        assert threads is not None and processes is not None, "py-spy could not attach (it needs ptrace: root)"
        # Shards of 40 images: the server's per-shard work weighs more than with 1,000 (the full run).
        assert processes < threads / 2, (comm, processes, threads)
    assert result["one_shard"]["spread_gil_ms_per_image"] is not None
    assert set(result["model"]["projection"]) == {"threads", "processes", "processes, one shard"}
    text = (tmp_path / "out" / "scaling.md").read_text()
    assert "## The server process's GIL by comm type" in text and "## The model" in text
