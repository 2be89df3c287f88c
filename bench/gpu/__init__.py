"""The training side on a GPU: ``python -m bench.gpu --out DIR`` (``--smoke`` for CI, on any machine).

One command for a GPU machine that has Python 3.12, PyTorch with CUDA and the packages
``requirements/gpu-machine.txt`` lists, but no network. The client's other packages travel as wheels
(``--wheels``, default ``.gpu-wheels/``: ``make gpu-wheels`` fetches ``requirements/gpu-check.txt`` into it),
installed with ``pip --no-index --no-deps`` into a folder of their own; the run goes on in a child with that
folder first on its path, and the machine's torch is left as it is. Every part has a time cap inside
``--budget`` (seconds), so the run ends in time even where a part is slow; a part or case left without time is
reported as cut (the headline says which), never as passed or failed.
``results.json`` and ``results.md`` are written again after each part, so a run stopped from outside
keeps what it measured.

A lent GPU machine is there for minutes, so whatever would fail the run half-way stops it at once, saying why:
wheels missing or not the pins (exit 2 before anything else), a module the run imports missing (the
``imports`` part: every third-party module of the script, the example and the collected tests, imports inside
functions included, from ``bench/imports.py``), no CUDA device (but for ``--smoke``).

Parts, in order:

1. ``tests``: ``pytest tests/client -m "not server"``, the CUDA tests included. The tests that need
   the pod's side (marked ``server`` in tests/client/conftest.py) are left out, each listed with its
   reason; a skip other than the expected ones (the CPU fallback's check, DALI not installed) fails.
2. ``prefetch``: ``CudaPrefetcher`` on the device against its CPU path on the same batches; a batch
   handed to the step is not overwritten while the step still reads it (a long kernel on the consumer
   stream while later copies land), and the same check with ``record_stream`` left out must see the
   overwrite; the overlap that ``examples/prefetch_overlap.py`` measures, uint8 and float32, which must
   reach ``MIN_OVERLAP``.
3. ``shards``: ETL'd shards written here in the pod's output format (``<key>.npy`` of (3, 224, 224)
   and ``<key>.cls``, then the end marker, by the pod's own tar writer), the same images as uint8 and
   as float32 (normalized as the pod does), ``--gigabytes`` of float32.
4. ``reference``: the pinned and pageable host-to-device bandwidth, the cost of pinning a batch (the
   DataLoader's pin thread copies every batch), and the one-copy floor
   (``bench.client_side.one_copy_batches`` on one core, delivered through ``CudaPrefetcher``).
5. ``loaders``: samples/s and GB/s delivered into device memory through ``CudaPrefetcher``:
   ``make_loader`` with 0, 4 and 8 workers and ``web_loader`` with 8 (``pin_memory`` on), then
   ``make_loader`` with 8 and ``pin_memory`` off, uint8 and float32; every batch of each case is
   checked against the images the shards hold (uint8 normalized on the device against the float32).
6. ``training``: a ResNet-50 step at batch 256 (torchvision, bf16 autocast, channels_last, SGD) alone,
   then fed by ``make_loader`` through ``CudaPrefetcher``: the prefetcher's ``wait_seconds`` over the
   steady steps says whether the step is starved.

Writes ``results.json`` and ``results.md`` into ``--out`` and prints the table; exits 1 if a check
failed. With ``--smoke`` the sizes are tiny and the parts that need CUDA are skipped on a machine
without it: it checks that the script runs, not how fast anything is.

The package's rooms: ``constants`` (what the run fixes), ``plugin`` (the tests part's pytest plugin), ``budget``
(the time budget and the parts), ``wheels`` (part 0), ``checks`` (parts 1 and 2), ``shards`` (3), ``loaders``
(4 and 5), ``training`` (6), ``run`` (the command), ``report`` (``results.md``).
"""

from __future__ import annotations

from .budget import Budget, Cut, Skip, check, run_part, verdict_of, write_results
from .checks import check_overlap, overlap, overwrite_check, prefetch_checks, run_tests, verdict
from .constants import (
    ABSENT,
    CARRIED,
    DISTINCT,
    EXPECTED_SKIPS,
    INSTALLED,
    MIN_OVERLAP,
    NEVER_CALLED,
    REPO,
    SIZE,
    WHEELS,
)
from .loaders import bandwidth, deliver, expectation, floor_and_loaders
from .report import markdown
from .run import finish, main, parse_args
from .shards import as_float32, distinct_images, make_shards, shard_folder, write_shards
from .training import training
from .wheels import carried_env, environment, import_all, install, needed_modules, run_files, wheels_problem

__all__ = ["ABSENT", "CARRIED", "DISTINCT", "EXPECTED_SKIPS", "INSTALLED", "MIN_OVERLAP", "NEVER_CALLED", "REPO",
           "SIZE", "WHEELS", "Budget", "Cut", "Skip", "as_float32", "bandwidth", "carried_env", "check",
           "check_overlap",
           "deliver", "distinct_images", "environment", "expectation", "finish", "floor_and_loaders", "import_all",
           "install", "main", "make_shards", "markdown", "needed_modules", "overlap", "overwrite_check",
           "parse_args", "prefetch_checks", "run_files", "run_part", "run_tests", "shard_folder", "training",
           "verdict", "verdict_of", "wheels_problem", "write_results", "write_shards"]
