"""Local shards through the service's engine: ``wds-transform apply`` and ``measure_seconds_per_image``.

``apply`` never leaves a truncated output under the final name; ``measure_seconds_per_image`` times
the engine on one shard, one thread, to size an ETL's object timeout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tqdm import tqdm

from .config import Settings
from .engine import ShardReport, transform_shard
from .errors import TransformerError
from .options import parse_etl_args
from .pool import TransformPool


def apply_shards(inputs: list[Path], output: Path, etl_args: str = "") -> int:
    """Transform each input into ``output`` (a folder for several); a line per shard to stdout; the exit status."""
    settings = Settings.from_env()
    options = parse_etl_args(etl_args, settings)
    several = len(inputs) > 1
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing:
        print(f"error: no such shard file: {', '.join(missing)}", file=sys.stderr)
        return 2
    names = [p.name for p in inputs]
    if several and len(set(names)) != len(names):
        print("error: several inputs share a file name; their outputs would overwrite each other", file=sys.stderr)
        return 2
    if several:
        output.mkdir(parents=True, exist_ok=True)
    pool = TransformPool(settings.workers, settings.max_inflight)
    failed = 0
    try:
        for source in inputs:
            target = output / source.name if several else output
            report = ShardReport(str(source), source.name, options.on_error)
            partial = target.with_name(target.name + ".partial")
            with open(source, "rb") as stream, open(partial, "wb") as out, tqdm(
                total=os.path.getsize(source), unit="B", unit_scale=True, desc=source.name
            ) as bar:
                counted = _CountingReader(stream, bar)
                try:
                    for chunk in transform_shard(
                        counted, options, pool, shard=str(source), object_name=source.name,
                        window=settings.window, report=report,
                    ):
                        out.write(chunk)
                except TransformerError as exc:
                    print(f"error: {exc.message}", file=sys.stderr)
                    failed += 1
                    out.close()
                    partial.unlink(missing_ok=True)
                    continue
            os.replace(partial, target)  # never leave a truncated shard under the final name
            dropped = len(report.errors)
            print(f"{target}: {report.samples_out} samples ({report.images} images) of {report.samples_in}"
                  + (f", {dropped} with errors (see __etl__/errors.json)" if dropped else ""))
    finally:
        pool.shutdown()
    return 1 if failed else 0


class _CountingReader:
    """A read-through file wrapper that advances a progress bar by the bytes read."""

    def __init__(self, stream, bar):
        self._stream, self._bar = stream, bar

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._bar.update(len(data))
        return data

    def readinto(self, buffer) -> int:
        from .shards import readinto

        count = readinto(self._stream, buffer)
        self._bar.update(count)
        return count


def measure_seconds_per_image(shard: str, etl_args: str = "", max_samples: int | None = None) -> float:
    """Seconds per image of the service's own engine on one local shard, on one thread.

    What ``apply`` runs, timed, to size an ETL's object timeout: feed the result to
    ``EtlSettings(seconds_per_image=...)``. Needs the ``server`` extra (torchvision).
    """
    import time

    options = parse_etl_args(etl_args, Settings.from_env({}))
    pool = TransformPool(workers=1, max_inflight=4)
    report = ShardReport(shard, shard, options.on_error)
    started = time.perf_counter()
    try:
        with open(shard, "rb") as stream:
            for _ in transform_shard(stream, options, pool, shard=shard, object_name=shard, window=2, report=report):
                if max_samples is not None and report.samples_in >= max_samples:
                    break
    finally:
        pool.shutdown()
    if report.images == 0:
        raise ValueError(f"measure_seconds_per_image: shard {shard!r} has no transformable image")
    return (time.perf_counter() - started) / report.images
