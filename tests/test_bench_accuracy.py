"""The kept ``bench.accuracy`` run: its report is the rendering of its figures, and they show what the docs say."""

from __future__ import annotations

import json
from pathlib import Path

from bench.accuracy import PRESETS, SETTINGS, report

KEPT = Path(__file__).resolve().parents[1] / "bench" / "results" / "accuracy"


def test_the_kept_report_is_rendered_from_the_kept_figures() -> None:
    results = json.loads((KEPT / "results.json").read_text())
    assert report(results).strip() == (KEPT / "results.md").read_text().strip()


def test_the_default_is_torchvisions_output_on_every_image_and_dct_scaling_is_not() -> None:
    rows = json.loads((KEPT / "results.json").read_text())["rows"]
    assert {(r["preset"], r["setting"]) for r in rows} == {(p, s) for p in PRESETS for s in SETTINGS}
    short_sides = [min(r["width"], r["height"]) for r in rows]
    assert min(short_sides) <= 200 and max(short_sides) >= 2000
    default = [r for r in rows if r["setting"] == "default"]
    assert all(r["max_abs"] == 0 and "scaled" not in r["paths"] for r in default)
    scaled = [r for r in rows if r["setting"] == "dct_scaling" and "scaled" in r["paths"]]
    assert scaled and max(r["mae"] for r in scaled) < 0.011  # docs/design-decoding.md: up to 0.0104
