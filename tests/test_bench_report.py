"""The benchmark report's round-by-round table: each round's ratios to that round's limit, and their spread."""

from __future__ import annotations

from bench.report import _round_by_round


def _service(round_index: int, mode: str, images_per_s: float, concurrency: int = 1,
             preset: str = "imagenet-train") -> dict:
    return {"system": "service", "preset": preset, "mode": mode, "concurrency": concurrency, "shard": "demo",
            "round": round_index, "images_per_s": images_per_s}


def _results(rounds: int) -> dict:
    limits = [1000.0, 800.0, 1250.0][:rounds]
    return {
        "compute": [{"preset": "imagenet-train", "round": i, "images_per_s": v} for i, v in enumerate(limits)],
        "http_limit": [{"preset": "imagenet-train", "round": i, "images_per_s": v * 0.8}
                       for i, v in enumerate(limits)],
        "measurements": [
            *(_service(i, "hpush-fqn", v * f) for i, (v, f) in enumerate(zip(limits, (0.75, 1.05, 0.82)))),
            # body measured in the first round only: the other rounds show a dash, the spread covers one
            _service(0, "hpush-body", 700.0),
            # another system and another shard do not count
            {**_service(1, "hpush-fqn", 1.0), "system": "conventional ETL"},
            {**_service(1, "hpush-fqn", 1.0), "shard": "big"},
        ],
    }


def test_each_round_against_its_own_limit_with_median_and_spread() -> None:
    lines = _round_by_round(_results(3))
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| round | limit images/s | each .npy sent to curl | hpush-fqn x1 | hpush-body x1 |"
    assert table[2] == "| 1 | 1,000 | 80% | 75% | 70% |"
    assert table[3] == "| 2 | 800 | 80% | 105% | – |"
    assert table[4] == "| 3 | 1,250 | 80% | 82% | – |"
    assert table[5] == "| median (min-max) | | 80% (80%-80%) | 82% (75%-105%) | 70% (70%-70%) |"
    assert not any("imagenet-val" in line for line in lines)  # no rounds of it: no table


def test_a_single_round_adds_nothing() -> None:
    assert _round_by_round(_results(1)) == []
