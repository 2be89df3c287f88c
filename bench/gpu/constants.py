"""What the GPU check fixes before it runs: sizes, the images' statistics, the skips it expects, the wheels
it carries, the modules it never calls, and the overlap the prefetcher must reach."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALLED = "BENCH_GPU_INSTALLED"  # set for the run on the carried wheels: the parent's results so far (JSON)
SIZE = 224
CLASSES = 1000
DISTINCT = 16  # distinct images in the shards: sample i shows image i % DISTINCT (and has label i)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# Skips that the GPU run expects; any other skip there fails the tests part.
EXPECTED_SKIPS = ("checks the fallback of a machine without CUDA", "DALI (the dali extra) is not installed")
WHEELS = REPO / ".gpu-wheels"
CARRIED = REPO / "requirements" / "gpu-check.txt"  # the wheels' pins: make gpu-wheels fetches exactly these
# The pod's side, which the run never calls (the client tests that need it are marked server and left out): an
# import of it inside a function is not followed when the run's imports are listed (bench/imports.py).
NEVER_CALLED = ("transformer.cli", "transformer.serve", "transformer.server", "transformer.apply", "transformer.engine",
                "transformer.spec", "transformer.samples", "transformer.preview", "transformer.demo",
                "transformer.cropdecode", "testbed.service")
# Modules the run's code imports that the machine lacks on purpose, each with the skip (EXPECTED_SKIPS) that
# keeps the run from needing it.
ABSENT = {"nvidia": "DALI (the dali extra) is not installed"}
# The prefetcher must hide at least half of a batch's copy behind the step (examples/prefetch_overlap.py:
# 1.0 = all of it): a copy on the step's stream, or one from pageable memory, gives about 0.
MIN_OVERLAP = 0.5
