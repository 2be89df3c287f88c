"""``wds-transform sync``'s work: an ETL'd copy of a bucket brought up to date, and its report printed.

``transform_bucket(..., incremental=True)`` with the ETL's own settings (``registered_options``): what
was stale (incremental.py) is transformed again, orphans are deleted when asked. The report is the
source's classes, the job's outcome and the orphans; an exit code says how it went (0 done, 1 a copy
left incomplete, 2 a request refused).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .errors import IncompleteCopy
from .offline import OfflineJob, registered_options, transform_bucket


def sync(endpoint: str, etl_name: str, source: str, destination: str, *, prefix: str = "",
         ext: Sequence[str] = (), delete_orphans: bool = False, timeout: float = 3600) -> int:
    """Bring ``destination`` up to date with ``source`` through the ETL; the report on stdout, the exit code."""
    if not endpoint:
        print("error: give the AIS proxy URL (--endpoint or AIS_ENDPOINT)", file=sys.stderr)
        return 2
    try:
        renames = parse_ext(ext)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from aistore.sdk import Client

    client = Client(endpoint)
    source, destination = (name.removeprefix("ais://").strip("/") for name in (source, destination))
    try:
        job = transform_bucket(client, etl_name, source, destination, options=registered_options(client, etl_name),
                               prefix=prefix, ext=renames or None, timeout=timeout, incremental=True,
                               delete_orphans=delete_orphans)
    except IncompleteCopy as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in sync_report(job, source, destination):
        print(line)
    return 0


def parse_ext(items: Sequence[str]) -> dict[str, str]:
    """``FROM=TO`` items -> the extension renames ``transform_bucket`` takes; ValueError names a bad one."""
    ext = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise ValueError(f"--ext {item!r}: give FROM=TO, e.g. tar=npy.tar")
        ext[old.lstrip(".")] = new
    return ext


def sync_report(job: OfflineJob, source: str, destination: str) -> list[str]:
    """An incremental job's report: the source's classes, the job's outcome, the orphans."""
    changes = job.changes
    lines = [f"ais://{source} -> ais://{destination}: "
             + ", ".join(f"{n} {key.replace('_', ' ')}" for key, n in changes.counts.items())
             + f" ({changes.tail_reads} tail reads in {changes.seconds:.1f} s)"]
    if job.job_id:
        lines.append(f"job {job.job_id}: {len(changes.stale)} transformed, {job.verified} proven whole, "
                     f"{len(job.object_errors)} failed")
        lines += [f"  {name}: {message}" for name, message in job.object_errors]
    else:
        lines.append("nothing to transform")
    if changes.deleted:
        lines.append(f"deleted {len(changes.deleted)} orphan{'s' if len(changes.deleted) > 1 else ''}: "
                     + ", ".join(changes.deleted))
    elif changes.orphans:
        lines.append(f"{len(changes.orphans)} orphan(s) kept (--delete-orphans removes them): "
                     + ", ".join(changes.orphans[:10]) + (" ..." if len(changes.orphans) > 10 else ""))
    return lines
