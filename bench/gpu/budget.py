"""The run's time budget and its parts: each part capped, its outcome (passed, failed, skipped, cut) and
checks recorded, the results written after each."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .report import markdown

# ---- budget and parts ---------------------------------------------------------------------------------------


class Budget:
    """The run's deadline; ``cap(s)`` is a part's limit: ``s`` or what is left, whichever is less."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cap(self, seconds: float) -> float:
        return max(0.0, min(seconds, self.left()))


class Skip(Exception):
    """A part that cannot run here (no CUDA): reported as skipped with its reason."""


class Cut(Exception):
    """A part left without time: reported as cut, which fails nothing and passes nothing."""


def run_part(results: dict, name: str, function: Callable[[], dict], budget: Budget, minimum: float,
             out: Path | None = None) -> None:
    started = time.monotonic()
    entry: dict[str, Any] = {"status": "passed"}
    try:
        if budget.left() < minimum:
            raise Cut(f"out of time: {budget.left():.0f} s left, the part needs at least {minimum:.0f} s")
        entry.update(function())
    except Skip as skip:
        entry = {"status": "skipped", "reason": str(skip)}
    except Cut as cut:
        entry = {"status": "cut", "reason": str(cut)}
    except Exception as exc:  # one part's failure must not lose the others' figures
        import traceback

        entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                 "traceback": traceback.format_exc()[-4000:]}
    entry["seconds"] = round(time.monotonic() - started, 1)
    results["parts"][name] = entry
    print(f"bench.gpu: {name}: {entry['status']} in {entry['seconds']} s"
          + (f" ({entry['reason'][:300]})" if entry.get("reason") else ""), flush=True)
    if out is not None:
        write_results(results, out)


def verdict_of(results: dict, smoke: bool) -> None:
    """``ok``: no part failed, and (but for a smoke run) none was skipped; ``cut``: the parts out of time."""
    parts = results["parts"].items()
    failed = [name for name, part in parts if part["status"] == "failed"]
    skipped = [name for name, part in parts if part["status"] == "skipped"]
    results["ok"] = not failed and (smoke or not skipped)
    results["cut"] = [name for name, part in parts if part["status"] == "cut"]


def write_results(results: dict, out: Path, finished: bool = False) -> None:
    """results.json and results.md as they stand: after each part, and at the end (``finished``)."""
    out.mkdir(parents=True, exist_ok=True)
    results.setdefault("meta", {})["finished"] = finished
    verdict_of(results, results["meta"].get("smoke", False))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))


def check(entry: dict, name: str, ok: bool, detail: str) -> None:
    """One named check of a part: the part fails when any of its checks does."""
    entry.setdefault("checks", []).append({"check": name, "ok": bool(ok), "detail": detail})
    if not ok:
        entry["status"] = "failed"
        entry["reason"] = "; ".join(c["check"] for c in entry["checks"] if not c["ok"])
