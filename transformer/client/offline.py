"""Offline transforms: an ETL'd copy of a bucket made once (e.g. the validation set), its errors, the pod's logs.

AIS passes no ``etl_args`` to an offline job: a bucket-to-bucket (or multi-object) transform carries
only the ETL's name and pipeline (``apc.Transform``). The pod then transforms with its own defaults,
the environment the ETL was registered with (``EtlSettings``: ``ETL_PRESET``, ``ETL_DTYPE``, ...).
So a copy made with other options than the training ETL's needs an ETL of its own, registered with
those options as its settings, e.g. ``register(client, "wds-etl-val", EtlSettings(image=...,
preset="imagenet-val", dtype="uint8"))``.

``transform_bucket`` takes the options the copy must be made with, as ``etl_args`` would give them
(``preset`` or ``transforms`` required), checks them against what the registered ETL will actually
use, and refuses to start on any difference (``OfflineOptionsMismatch``, naming each one and the
fix). It then starts the job, waits for it, and reports AIS's per-object errors. Before returning it
proves the copy whole (``transformer.client.whole_copy``): every object asked for is among those errors
or stored with its end marker, else ``IncompleteCopy``. With ``incremental=True`` it transforms only
the source objects whose copy is missing or stale (``transformer.client.incremental``). The options check is
``copy_options.py``; AIS's jobs (waiting, a job's per-object errors, the pods' logs) are ``jobs.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..wire import INPUT_CHECKSUM
from .copy_options import check_offline_options, checked_options, registered_options, writes_end_marker
from .errors import IncompleteCopy, OrphanDeleteRefused
from .etlspec import validate_name
from .incremental import (
    Changes,
    Check,
    check_destination,
    delete_orphan_copies,
    etl_identity,
    known_from,
    leftovers,
    listing_prefix,
    map_names,
    new_ledger,
)
from .jobs import JOB_KIND, LIST_JOB_KIND, etl_logs, object_errors, start_list_job, wait_job
from .ledger import Known, input_key, save_ledger
from .listing import list_bucket
from .registration import ais_errors
from .urls import expand_template
from .whole_copy import CopyCheck, Progress, check_copy, destination_name

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

# This module's own names, and those it offered before their concepts got modules of their own (the options
# check: copy_options; AIS jobs: jobs), kept importable from here.
__all__ = ["JOB_KIND", "LIST_JOB_KIND", "OfflineJob", "check_offline_options", "etl_logs", "object_errors",
           "registered_options", "transform_bucket", "wait_job", "wait_transform"]


@dataclass(frozen=True)
class OfflineJob:
    """A bucket-to-bucket transform: its id, and once waited for, how it ended, the objects that failed
    and how many were proven whole in the destination.

    ``objects`` are the source objects it was asked for (listed when it started), ``ext`` maps their
    names to the destination's, ``end_marker`` says whether its last stage ends each shard with one.
    """

    etl_name: str
    job_id: str
    source: str
    destination: str
    finished: bool = False
    success: bool | None = None
    error: str | None = None
    object_errors: list[tuple[str, str]] = field(default_factory=list)  # (object name, AIS's message)
    verified: int = 0  # objects found whole (present, where end_marker is false) in the destination
    kind: str = JOB_KIND
    objects: tuple[str, ...] = field(default=(), repr=False)
    ext: Mapping[str, str] | None = field(default=None, repr=False)
    end_marker: bool = True
    changes: Changes | None = None  # an incremental transform's classes (job_id "" where nothing was stale)
    check: CopyCheck | None = field(default=None, repr=False)  # the destination's check after the job


def transform_bucket(
    client: Client,
    etl_name: str,
    source: str,
    destination: str,
    *,
    options: Mapping[str, Any],
    prefix: str = "",
    ext: Mapping[str, str] | None = None,
    continue_on_error: bool = True,
    num_workers: int = 0,
    pipeline: tuple[str, ...] | list[str] = (),
    names: Sequence[str] | None = None,
    template: str | None = None,
    timeout: int = 3600,
    wait: bool = True,
    incremental: bool = False,
    delete_orphans: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> OfflineJob:
    """Transform bucket ``source`` into ``destination`` with the ETL ``etl_name``, once, and prove the copy whole.

    The whole bucket (or the objects under ``prefix``), or only the objects ``names`` lists or a brace
    ``template`` such as ``val-{0000..0049}.tar`` expands to (a multi-object transform; names it
    expands to that are not in ``source`` are skipped, as AIS skips them).

    ``options`` are the ``etl_args`` the copy must be made with; they are checked against the ETL's
    settings first (``check_offline_options``), because AIS does not pass them to offline jobs. With
    ``continue_on_error`` a failed object is recorded and the job goes on; the job's per-object errors
    are returned. ``ext`` maps source extensions to the destination's (``{"tar": "npy.tar"}``), as
    AIS does. ``pipeline`` names ETLs that transform this one's output in turn (each stage uses its
    own settings: no stage gets ``etl_args``). ``timeout`` bounds the wait, in seconds;
    ``wait=False`` returns after starting, and ``wait_transform`` waits and checks later.

    Once the job ends, the destination is checked (``transformer.client.whole_copy``): every object
    asked for must be among the job's errors or stored whole, its end marker verified from its last
    2 KiB (only its presence where the pipeline's last stage is another ETL, which writes no marker).
    Raises ``IncompleteCopy`` naming the others, even when AIS reports the job as succeeded.

    ``incremental=True`` compares each source object with its copy first (``find_changes``: two
    listings, the copy ledger, a 2 KiB range GET of each copy the ledger does not know) and transforms
    only the new, changed, restyled and cut ones: in one multi-object job, or in a bucket-to-bucket
    job where every source under the prefix is stale. Each copy the job wrote is then proven whole and
    up to date from its own tail; ``job.changes`` holds every class. Orphans (copies this transformer
    made, by their end marker, whose name maps back through ``ext`` to a source under the prefix that
    is gone) are found after the job, and deleted only with ``delete_orphans=True``, by one AIS
    multi-object delete (refused with ``OrphanDeleteRefused`` where a listing was taken during a
    rebalance); any other object under the prefix is reported in ``changes.others`` and never deleted.
    ``dry_run=True`` classifies and reports, and writes, transforms and deletes nothing. It needs a
    destination the ETL itself writes: no ``pipeline``, no ``names`` or ``template`` (the prefix
    selects). ``progress`` makes progress bars for the long steps (tail reads, the job).
    """
    if incremental:
        return _incremental(client, etl_name, source, destination, options=options, prefix=prefix, ext=ext,
                            continue_on_error=continue_on_error, num_workers=num_workers, pipeline=pipeline,
                            names=names, template=template, timeout=timeout, wait=wait,
                            delete_orphans=delete_orphans, dry_run=dry_run, progress=progress)
    if delete_orphans or dry_run:
        raise ValueError(f"transform_bucket: {'delete_orphans' if delete_orphans else 'dry_run'} applies to an "
                         "incremental transform (incremental=True)")
    if names is not None and template is not None:
        raise ValueError("transform_bucket: give names or template, not both")
    if (names is not None or template is not None) and prefix:
        raise ValueError("transform_bucket: prefix applies to a whole-bucket transform, not to names or template")
    if template is not None and "{" not in template and ("@" in template or "%" in template):
        raise ValueError(f"transform_bucket: template {template!r}: give the range in braces, e.g. "
                         "val-{0000..0049}.tar; the copy is checked against the names it expands to")
    _, message = checked_options(client, etl_name, options)
    stages = [validate_name(name) for name in pipeline] or None
    end_marker = writes_end_marker(client, message, stages[-1]) if stages else True
    with ais_errors(etl_name, "offline transform"):
        objects = _asked_for(client, source, prefix, names, template)
        if names is None and template is None:
            job_id = client.bucket(source).transform(
                etl_name, to_bck=client.bucket(destination), prefix_filter=prefix, ext=dict(ext) if ext else None,
                cont_on_err=continue_on_error, num_workers=num_workers, etl_pipeline=stages,
            )
        else:
            group = client.bucket(source).objects(obj_names=list(names) if names is not None else None,
                                                  obj_template=template)
            job_id = start_list_job(client, etl_name, source, destination, lambda: group.transform(
                to_bck=client.bucket(destination), etl_name=etl_name, ext=dict(ext) if ext else None,
                continue_on_error=continue_on_error, num_workers=num_workers or None, etl_pipeline=stages,
            ))
    log.info("offline transform %s: ais://%s -> ais://%s with ETL %s", job_id, source, destination, etl_name)
    kind = JOB_KIND if names is None and template is None else LIST_JOB_KIND
    job = OfflineJob(etl_name, job_id, source, destination, kind=kind, objects=objects,
                     ext=dict(ext) if ext else None, end_marker=end_marker)
    if not wait:
        return job
    return wait_transform(client, job, timeout, progress=progress)


def _incremental(client: Client, etl_name: str, source: str, destination: str, *, options: Mapping[str, Any],
                 prefix: str, ext: Mapping[str, str] | None, continue_on_error: bool, num_workers: int,
                 pipeline: tuple[str, ...] | list[str], names: Sequence[str] | None, template: str | None,
                 timeout: int, wait: bool, delete_orphans: bool, dry_run: bool,
                 progress: Progress | None) -> OfflineJob:
    """``transform_bucket(..., incremental=True)``: the stale objects only, the ledger kept, then the orphans."""
    if pipeline:
        raise ValueError("incremental transform: a pipeline's end markers record its last stage's input, not the "
                         "source object, so no copy can be compared with its source; transform in full")
    if names is not None or template is not None:
        raise ValueError("incremental transform: select the objects with prefix, not names or template (orphans "
                         "are found against the whole selection)")
    if delete_orphans and not wait:
        raise ValueError("incremental transform: delete_orphans needs wait=True (orphans are found after the job)")
    checked_options(client, etl_name, options)
    check = check_destination(client, etl_name, source, destination, prefix=prefix, ext=ext, dry_run=dry_run,
                              progress=progress)
    changes = check.changes
    ext = dict(ext) if ext else None
    nothing = OfflineJob(etl_name, "", source, destination, finished=True, success=True, kind=LIST_JOB_KIND, ext=ext)
    if dry_run:
        return replace(nothing, changes=changes)
    after, written = check, {}
    if changes.stale:
        everything = len(changes.stale) == len(check.sources)
        kwargs = {"options": options, "ext": ext, "continue_on_error": continue_on_error,
                  "num_workers": num_workers, "timeout": timeout, "wait": False}
        if everything:  # one bucket-to-bucket job: no list of names to send, AIS walks the prefix
            job = transform_bucket(client, etl_name, source, destination, prefix=prefix, **kwargs)
        else:
            with ais_errors(etl_name, "offline transform"):  # a multi-object job needs its destination to exist
                client.bucket(destination).create(exist_ok=True)
            job = transform_bucket(client, etl_name, source, destination, names=changes.stale, **kwargs)
        if not wait:
            return replace(job, changes=changes)
        job = wait_transform(client, job, timeout, listing_from=listing_prefix(prefix, ext), progress=progress)
        with ais_errors(etl_name, "offline copy check"):
            written = _prove_fresh(client, job, check, prefix)
            after = _after_job(client, check, job, prefix, ext)
    else:
        job = nothing
    with ais_errors(etl_name, "orphan check"):
        orphans, others = leftovers(client, after, prefix, ext, progress=progress)
        changes = replace(changes, orphans=orphans, others=others)
        after.changes = changes
        _keep_ledger(client, etl_name, check, after, written)
        if delete_orphans and orphans:
            try:
                deleted, left = delete_orphan_copies(client, after, timeout)
            except OrphanDeleteRefused as exc:
                exc.job = replace(job, changes=changes)
                raise
            changes = replace(changes, deleted=deleted, not_deleted=left)
    return replace(job, changes=changes)


def _after_job(client: Client, check: Check, job: OfflineJob, prefix: str, ext: Mapping[str, str] | None) -> Check:
    """The check's findings brought to after the job: the destination as its proof listed it, the source listed
    again, the markers known still (those of copies whose listed identity did not change)."""
    stored = job.check.listing if job.check is not None and job.check.listing is not None else \
        list_bucket(client, job.destination, listing_prefix(prefix, ext))
    sources = list_bucket(client, check.sources.bucket, prefix)
    tails = {name: tail for name, tail in {**check.tails, **(job.check.tails if job.check else {})}.items()
             if name in stored and (stored.entries[name].size, stored.entries[name].checksum)
             == (tail.size, tail.checksum)}
    return Check(check.changes, sources, stored, map_names(sources, ext), known=dict(check.known), tails=tails,
                 ledger=check.ledger, etl_id=check.etl_id)


def _keep_ledger(client: Client, etl_name: str, check: Check, after: Check,
                 written: Mapping[tuple[int, str], Known]) -> None:
    """Store the ledger of the destination as it is after the run (a failure to store it costs the next run
    reads, never a wrong class: logged, not raised)."""
    from aistore.sdk.errors import AISError

    ledger = new_ledger(after, after.stored, written)
    if check.changes.settings == "" and written:
        # no copy was there to compare, so the pod was not asked: the job's own copies say what it writes now
        styles = {(known.settings, known.version) for known in written.values()}
        if len(styles) == 1 and check.etl_id and etl_identity(client, etl_name) == check.etl_id:
            settings, version = styles.pop()
            ledger.etl = {"id": check.etl_id, "settings": settings, "version": version}
    try:
        if save_ledger(client, after.stored.bucket, ledger):
            log.info("ais://%s/%s: copy ledger stored (%d copies)", after.stored.bucket, ledger.name,
                     len(ledger.records))
    except (AISError, OSError) as exc:
        log.warning("ais://%s/%s: the copy ledger could not be stored (%s); the next check reads every copy's tail",
                    after.stored.bucket, ledger.name, exc)


def _prove_fresh(client: Client, job: OfflineJob, check: Check, prefix: str) -> dict[tuple[int, str], Known]:
    """Raise ``IncompleteCopy`` for each stale object the job recorded no error for, yet whose copy is still not up
    to date (whole, but made from other bytes or settings: the job did not rewrite it), from the tails the copy
    check read of what the job wrote (nothing else is read). Returns the markers those tails hold, by copy
    identity, for the ledger."""
    changes = check.changes
    failed = {_errored_object(name) for name, _ in job.object_errors}
    tails = job.check.tails if job.check is not None else {}
    written: dict[tuple[int, str], Known] = {}
    left: dict[str, str] = {}
    other_input: list[tuple[str, str, Known]] = []
    for name in changes.stale:
        target = destination_name(name, job.ext)
        tail = tails.get(target)
        if name in failed or tail is None or tail.marker is None:
            continue  # recorded as failed, or already named missing or cut by the copy check
        known = known_from(tail)
        if known is None:
            left[target] = "not rewritten by the job: still restyled (an end marker from before its fields)"
            continue
        if tail.checksum:
            written[tail.size, tail.checksum] = known
        if changes.settings and (known.settings, known.version) != (changes.settings, changes.version):
            left[target] = "not rewritten by the job: still restyled"
            continue
        entry = check.sources.entries[name]
        if check.changes.identity == INPUT_CHECKSUM and \
                known.input != input_key(entry.size, INPUT_CHECKSUM, entry.checksum):
            other_input.append((name, target, known))
    if other_input:  # made from other bytes than listed before the job: the source may have been rewritten since
        now = list_bucket(client, check.sources.bucket, prefix).entries
        for name, target, known in other_input:
            entry = now.get(name)
            if entry is None or known.input != input_key(entry.size, INPUT_CHECKSUM, entry.checksum):
                left[target] = "not rewritten by the job: still changed"
    if left:
        raise IncompleteCopy(job.job_id, f"ais://{job.source}", job.destination, [], left,
                             expected=len(changes.stale), ais_status="it reports the job as succeeded" if job.success
                             else f"it reports the job as failed: {job.error}",
                             sources={destination_name(name, job.ext): name for name in changes.stale}, job=job)
    return written


def wait_transform(client: Client, job: OfflineJob, timeout: float = 3600, *, listing_from: str | None = None,
                   progress: Progress | None = None) -> OfflineJob:
    """Wait for a job ``transform_bucket(..., wait=False)`` started, then prove its copy whole.

    Returns the finished job (AIS's status and per-object errors, ``verified``: the objects found
    whole, ``check``: what the check found and read; an incremental transform that found nothing stale
    has no job: returned as it is); raises ``IncompleteCopy`` when an object asked for is neither among
    the errors nor stored whole, whatever AIS reports. ``listing_from``: list the destination under this
    prefix for the check (the caller's scope) rather than under the expected names' common prefix.
    """
    if not job.job_id and job.finished:
        return job
    with ais_errors(job.etl_name, "offline transform"):
        result = wait_job(client.job(job.job_id, job_kind=job.kind), timeout,
                          _job_progress(client, job, progress) if progress else None)
    errors = object_errors(client, job.etl_name, job.job_id)
    done = replace(job, finished=True, success=bool(result.success), error=result.error or None,
                   object_errors=errors)
    sources = {destination_name(name, job.ext): name for name in job.objects}
    failed = {destination_name(_errored_object(name), job.ext) for name, _ in errors}
    with ais_errors(job.etl_name, "offline copy check"):
        listing = list_bucket(client, job.destination, listing_from) if listing_from is not None else None
        check = check_copy(client, job.destination, sources, failed, end_marker=job.end_marker, listing=listing,
                           progress=progress)
    done = replace(done, verified=check.whole, check=check)
    if not check.complete:
        status = "it reports the job as succeeded" if done.success else f"it reports the job as failed: {done.error}"
        raise IncompleteCopy(job.job_id, f"ais://{job.source}", job.destination, check.missing, dict(check.cut),
                             expected=check.expected, ais_status=status, sources=sources, job=done)
    return done


def _job_progress(client: Client, job: OfflineJob, progress: Progress) -> Callable[[bool], None]:
    """A poll callback that shows the job's objects done so far (summed over the targets' snapshots) on a bar."""
    bar = progress(len(job.objects), f"job {job.job_id}")

    def poll(last: bool) -> None:
        if last:
            bar.close()
            return
        snaps = client.job(job.job_id, job_kind=job.kind).get_details().list_snapshots()
        # each target counts the objects it stored itself and those its pod sent on by direct put (AIS's
        # xact/xs/coi.go); the receiving target's "in" count would count the latter twice
        done = sum(snap.stats.objects + snap.stats.out_objects for snap in snaps if snap.stats is not None)
        bar.update(max(0, min(done, len(job.objects)) - getattr(bar, "n", 0)))

    return poll


def _asked_for(client: Client, source: str, prefix: str, names: Sequence[str] | None,
               template: str | None) -> tuple[str, ...]:
    """The source objects a job is asked to transform, as AIS will pick them: the names given; a
    template's names that exist; or every object under the prefix (a template without a range is one)."""
    if names is not None:
        return tuple(dict.fromkeys(names))
    if template is not None and "{" in template:
        expanded = expand_template(template)
        existing = set(_listed(client, source, template[:template.index("{")]))
        return tuple(name for name in dict.fromkeys(expanded) if name in existing)
    return tuple(_listed(client, source, prefix if template is None else template.rstrip("*")))


def _listed(client: Client, bucket: str, prefix: str) -> list[str]:
    return [entry.name for entry in client.bucket(bucket).list_objects_iter(prefix=prefix, props="name")]


def _errored_object(name: str) -> str:
    """An object's name in the job's errors, which AIS gives as ``ais://<bucket>/<name>``."""
    return name.split("/", 3)[3] if name.startswith("ais://") and name.count("/") >= 3 else name


