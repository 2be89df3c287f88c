"""The pytest plugin of the tests part (``-p bench.gpu.plugin``): each test's outcome, and the tests left out,
written as JSON lines to ``BENCH_GPU_RECORD``."""

from __future__ import annotations

import json
import os
from typing import Any

# ---- the pytest plugin (-p bench.gpu.plugin): each test's outcome, and the tests left out, as JSON lines --------


def _record(entry: dict) -> None:
    path = os.environ.get("BENCH_GPU_RECORD")
    if path:
        with open(path, "a") as stream:
            stream.write(json.dumps(entry) + "\n")


def pytest_deselected(items: list) -> None:
    for item in items:
        marker = item.get_closest_marker("server")
        reason = marker.kwargs.get("reason", "needs the pod's side") if marker else "deselected"
        _record({"test": item.nodeid, "outcome": "left out", "reason": reason})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _record({"test": report.nodeid, "outcome": "error", "when": "collect", "reason": str(report.longrepr)[-1500:]})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            reason = str(report.longrepr)[-1500:]
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        _record({"test": report.nodeid, "outcome": outcome, "when": report.when, "reason": reason,
                 "seconds": round(report.duration, 3)})
