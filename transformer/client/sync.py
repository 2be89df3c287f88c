"""``wds-transform sync``'s work: an ETL'd copy of a bucket brought up to date, and its report printed.

``transform_bucket(..., incremental=True)`` with the ETL's own settings (``registered_options``): what
was stale (incremental.py) is transformed again, orphans are deleted when asked; ``--dry-run`` only
classifies. The report gives each class with its names, the job's outcome, the orphans and the other
objects under the prefix (kept, with why); an exit code says how it went (0 done, 1 a copy left
incomplete, 2 a request refused, the deletion of orphans included).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .copy_options import registered_options
from .errors import IncompleteCopy, OrphanDeleteRefused
from .offline import OfflineJob, transform_bucket
from .whole_copy import ProgressBar

SHOWN = 10  # names printed per class; the rest are counted


def sync(endpoint: str, etl_name: str, source: str, destination: str, *, prefix: str = "",
         ext: Sequence[str] = (), delete_orphans: bool = False, dry_run: bool = False, timeout: float = 3600) -> int:
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
                               prefix=prefix, ext=renames or None, timeout=int(timeout), incremental=True,
                               delete_orphans=delete_orphans, dry_run=dry_run, progress=progress_bar)
    except IncompleteCopy as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except OrphanDeleteRefused as exc:
        if isinstance(exc.job, OfflineJob):
            for line in sync_report(exc.job, source, destination):
                print(line)
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in sync_report(job, source, destination, dry_run=dry_run, delete_orphans=delete_orphans):
        print(line)
    return 0


def progress_bar(total: int, what: str) -> ProgressBar:
    """A tqdm bar on stderr, shown on a terminal only."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="obj", file=sys.stderr, leave=False, disable=None)


def parse_ext(items: Sequence[str]) -> dict[str, str]:
    """``FROM=TO`` items -> the extension renames ``transform_bucket`` takes; ValueError names a bad one."""
    ext = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise ValueError(f"--ext {item!r}: give FROM=TO, e.g. tar=npy.tar")
        ext[old.lstrip(".")] = new
    return ext


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def sync_report(job: OfflineJob, source: str, destination: str, *, dry_run: bool = False,
                delete_orphans: bool = False) -> list[str]:
    """An incremental job's report: the classes and their names, the job's outcome, orphans, the other objects."""
    changes = job.changes
    how = {"asked": ", the ETL asked", "remembered": ", the ETL's settings from the ledger",
           "read": ", a source read through the ETL"}.get(changes.probe, "")
    lines = [f"ais://{source} -> ais://{destination}: "
             + ", ".join(f"{n} {key.replace('_', ' ')}" for key, n in changes.counts.items())
             + f" ({changes.ledger_hits} from the ledger, {changes.tail_reads} tail reads{how}, "
               f"{changes.seconds:.1f} s)"]
    for kind in ("new", "changed", "restyled"):
        if getattr(changes, kind):
            lines.append(f"  {kind}: {_names(getattr(changes, kind))}")
    if changes.cut:
        lines.append(f"  cut: {_names([f'{name} ({why})' for name, why in changes.cut])}")
    stale = len(changes.stale)
    if dry_run:
        lines.append(f"dry run: would transform {stale} object{'s' if stale != 1 else ''}" if stale
                     else "dry run: nothing to transform")
    elif job.job_id:
        lines.append(f"job {job.job_id}: {stale} transformed, {job.verified} proven whole, "
                     f"{len(job.object_errors)} failed")
        lines += [f"  {name}: {message}" for name, message in job.object_errors]
    else:
        lines.append("nothing to transform")
    if changes.deleted:
        lines.append(f"deleted {len(changes.deleted)} orphan{'s' if len(changes.deleted) > 1 else ''}: "
                     + _names(changes.deleted))
    if changes.not_deleted:
        lines.append(f"not deleted: {_names([f'{name} ({why})' for name, why in changes.not_deleted])}")
    if changes.orphans and not changes.deleted and not changes.not_deleted:
        if dry_run and delete_orphans and changes.rebalancing:
            lines.append(f"dry run: would refuse to delete {len(changes.orphans)} orphan(s): {_names(changes.orphans)}")
        elif dry_run and delete_orphans:
            lines.append(f"dry run: would delete {len(changes.orphans)} orphan(s): {_names(changes.orphans)}")
        else:
            lines.append(f"{len(changes.orphans)} orphan(s) kept (--delete-orphans removes them): "
                         + _names(changes.orphans))
    if changes.rebalancing:
        lines.append("AIS flagged a listing as taken during a rebalance: objects that exist may be missing from it, "
                     "so no orphan is deleted until the rebalance has ended")
    if changes.others:
        lines.append(f"{len(changes.others)} other object(s) under the prefix, never deleted: "
                     + _names([f"{name} ({why})" for name, why in changes.others]))
    return lines
