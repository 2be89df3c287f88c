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
the source objects whose copy is missing or stale (``transformer.client.incremental``).
``object_errors`` and ``etl_logs`` surface a job's errors and the pod's logs on their own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..config import VARIABLES
from ..wire import ETL_ARG_FIELDS, INPUT_CHECKSUM
from .errors import ClientError, IncompleteCopy, OfflineOptionsMismatch, OrphanDeleteRefused
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
from .ledger import Known, input_key, save_ledger
from .listing import list_bucket
from .registration import ais_errors, registered_message
from .urls import etl_args, expand_template
from .whole_copy import CopyCheck, Progress, check_copy, destination_name

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

JOB_KIND = "etl-bck"  # the xaction of a bucket-to-bucket transform
LIST_JOB_KIND = "etl-listrange"  # ... and of a multi-object (list or template) transform
_ENV = {"preset": "ETL_PRESET", "transforms": "ETL_TRANSFORMS", "dtype": "ETL_DTYPE", "layout": "ETL_LAYOUT",
        "seed": "ETL_SEED", "on_error": "ETL_ON_ERROR"}
_DETERMINISTIC_PRESETS = ("imagenet-val",)



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


def effective_options(environment: Mapping[str, str]) -> dict[str, Any]:
    """What the pod transforms with when a request carries no ``etl_args``: its environment, else the defaults."""

    def get(name: str) -> str:
        value = environment.get(name)
        return value if value not in (None, "") else VARIABLES[name][0]

    options: dict[str, Any] = {}
    transforms = get("ETL_TRANSFORMS")
    if transforms:  # ETL_TRANSFORMS overrides ETL_PRESET
        try:
            options["transforms"] = json.loads(transforms)
        except ValueError:
            options["transforms"] = transforms  # YAML: compared as text
    else:
        options["preset"] = get("ETL_PRESET")
    options["dtype"], options["layout"], options["on_error"] = get("ETL_DTYPE"), get("ETL_LAYOUT"), get("ETL_ON_ERROR")
    seed = get("ETL_SEED")
    options["seed"] = int(seed) if seed.lstrip("-").isdigit() else (seed or None)
    return options


def check_offline_options(client: Client, etl_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Raise unless the registered ETL ``etl_name`` transforms, without ``etl_args``, with ``options``.

    ``options`` are ``etl_args`` fields; ``preset`` or ``transforms`` is required (the copy's pipeline must be
    stated, not inherited by accident) and ``epoch`` is refused (offline jobs have none). Returns the options
    the ETL uses.
    """
    return _checked_options(client, etl_name, options)[0]


def _checked_options(client: Client, etl_name: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
    """``check_offline_options``'s work: the options the ETL uses, and its init message as AIS holds it."""
    unknown = sorted(set(options) - set(ETL_ARG_FIELDS))
    if unknown:
        raise ValueError(f"offline options: unknown field {unknown[0]!r}; known fields are {', '.join(ETL_ARG_FIELDS)}")
    if "epoch" in options:
        raise ValueError("offline options: an offline copy has no epoch (AIS passes no etl_args to offline jobs); "
                         "give a seed for a reproducible copy")
    if "preset" not in options and "transforms" not in options:
        raise ValueError("offline options: say which pipeline the copy is made with (preset or transforms)")
    etl_args(**dict(options))  # the same value checks as for etl_args
    with ais_errors(etl_name, "offline transform"):
        message = registered_message(client.etl(validate_name(etl_name)))
    if message is None:
        raise ClientError(f"ETL '{etl_name}' is not registered; register it with the copy's options as its settings")
    runtime = message.get("runtime")
    runtime = runtime if isinstance(runtime, dict) else {}
    environment = {e["name"]: e["value"] for e in (runtime.get("env") or []) + (message.get("env") or [])}
    used = effective_options(environment)
    differences: dict[str, tuple[object, object]] = {}
    wanted_pipeline = (("transforms", _spec(options["transforms"])) if "transforms" in options
                       else ("preset", options["preset"]))
    used_pipeline = ("transforms", used["transforms"]) if "transforms" in used else ("preset", used["preset"])
    if wanted_pipeline != used_pipeline:
        differences["pipeline"] = (" ".join(map(repr, used_pipeline)), " ".join(map(repr, wanted_pipeline)))
    for key in ("dtype", "layout", "on_error", "seed"):
        if key in options and options[key] != used[key]:
            differences[key] = (used[key], options[key])
    if differences:
        raise OfflineOptionsMismatch(etl_name, differences)
    random = ("Random" in json.dumps(used["transforms"]) if "transforms" in used
              else used["preset"] not in _DETERMINISTIC_PRESETS)
    if random and used.get("seed") is None:
        log.warning("ETL %s transforms with random augmentations and no seed: the offline copy is one random draw, "
                    "and cannot be made again identically", etl_name)
    return used, message


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
    _, message = _checked_options(client, etl_name, options)
    stages = [validate_name(name) for name in pipeline] or None
    end_marker = _writes_end_marker(client, message, stages[-1]) if stages else True
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
            job_id = _start_list_job(client, etl_name, source, destination, lambda: group.transform(
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
    _checked_options(client, etl_name, options)
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


def _start_list_job(client: Client, etl_name: str, source: str, destination: str, start: Callable[[], str]) -> str:
    """Start a multi-object job with ``start`` once no job from before the ETL's current start can take its list.

    AIS hands a list to a running multi-object job between the same buckets, and such a job keeps calling the
    pods it started with, gone once the ETL was re-registered. One that idles is waited out: AIS ends it by
    itself (115 s after its last list, measured). Aborting it instead lets AIS 5.0 hand the list to the job it
    is winding down (the same id comes back, already ended, while its targets may still write), and a job sent
    right after may never report idle; so a busy one is aborted only after ``STALE_JOB_WAIT``, and a list that
    comes back with an aborted job's id is sent again once that job is gone.
    """
    aborted = _end_stale_list_jobs(client, etl_name, source, destination)
    for _ in range(_JOIN_TRIES):
        job_id = start()
        if job_id not in aborted:
            return job_id
        log.warning("offline transform: AIS gave the list to job %s, aborted as it started before ETL %s; waiting "
                    "until it is gone, then sending the list again", job_id, etl_name)
        _wait_gone(client, job_id)
    raise ClientError(f"offline transform: AIS gave the list to job {job_id}, aborted because it started before ETL "
                      f"'{etl_name}' was last started, {_JOIN_TRIES} times; wait until `ais show job` no longer "
                      f"lists it running, then transform again")


_JOIN_TRIES = 4
STALE_JOB_WAIT = 300.0  # seconds a job from before the ETL's start is left to end by itself before it is aborted


def _end_stale_list_jobs(client: Client, etl_name: str, source: str, destination: str,
                         patience: float = STALE_JOB_WAIT) -> set[str]:
    """Wait until no multi-object job of ais://``source`` -> ais://``destination`` from before the ETL's current
    start runs (each ends by itself once idle); abort one still running after ``patience`` seconds, and wait until
    it has ended on every target. Returns the ids aborted."""
    stale = _stale_list_jobs(client, etl_name, source, destination)
    if stale:
        log.warning("offline transform: waiting for job(s) %s (ais://%s -> ais://%s) to end: started before ETL %s "
                    "was last started, they would call its old pods, and AIS would hand them the new list (an idle "
                    "one ends by itself within about two minutes)", ", ".join(sorted(stale)), source, destination,
                    etl_name)
    deadline = time.monotonic() + patience
    while stale and time.monotonic() < deadline:
        time.sleep(2.0)
        stale = _stale_list_jobs(client, etl_name, source, destination)
    aborted = set()
    for job_id in stale:
        log.warning("offline transform: aborting job %s (ais://%s -> ais://%s): still running %.0f s on, and it "
                    "would call the old pods of ETL %s", job_id, source, destination, patience, etl_name)
        client.job(job_id, job_kind=LIST_JOB_KIND).abort()
        _wait_gone(client, job_id)
        aborted.add(job_id)
    return aborted


def _stale_list_jobs(client: Client, etl_name: str, source: str, destination: str) -> set[str]:
    """The running multi-object jobs of ais://``source`` -> ais://``destination`` that started before the ETL's
    current start."""
    running = client.cluster().list_running_jobs(job_kind=LIST_JOB_KIND)
    if not running:
        return set()
    current = [etl.xaction_id for etl in client.cluster().list_etls() if etl.id == etl_name and etl.xaction_id]
    if not current:
        return set()
    etl_started = _started(client.job(current[0]).get_details().list_snapshots())
    stale = set()
    for entry in running:
        job_id = entry[entry.find("[") + 1:].rstrip("]")
        snaps = [snap for snap in client.job(job_id, job_kind=LIST_JOB_KIND).get_details().list_snapshots()
                 if not snap.aborted and not _ended(snap.end_time) and snap.source_bck and snap.destination_bck
                 and snap.source_bck.name == source and snap.destination_bck.name == destination]
        started = _started(snaps)
        if etl_started is not None and started is not None and started < etl_started:
            stale.add(job_id)
    return stale


def _wait_gone(client: Client, job_id: str, timeout: float = 120.0) -> None:
    """Until an aborted job has ended on every target and AIS no longer lists it running: a list sent while it
    still winds down joins it."""
    deadline = time.monotonic() + timeout
    while True:
        snaps = client.job(job_id, job_kind=LIST_JOB_KIND).get_details().list_snapshots()
        running = client.cluster().list_running_jobs(job_kind=LIST_JOB_KIND) or []
        if all(_ended(snap.end_time) for snap in snaps) and not any(job_id in entry for entry in running):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"offline transform: job {job_id}, aborted, still runs after {timeout:.0f} s; "
                               "start the transform again once `ais show job` shows it ended")
        time.sleep(0.5)


def _ended(end_time: str | None) -> bool:
    return bool(end_time) and not str(end_time).startswith("0001-01-01")  # Go's zero time: not ended


def _started(snaps: Sequence[Any]) -> float | None:
    """The earliest start time among AIS job snapshots (RFC 3339 with nanoseconds), in seconds since the epoch."""
    import datetime as dt

    times = []
    for snap in snaps:
        text = (snap.start_time or "").replace("Z", "+00:00")
        whole, dot, rest = text.partition(".")
        if dot:  # Python's parser takes microseconds: cut the nanoseconds, keep the zone
            digits = len(rest) - len(rest.lstrip("0123456789"))
            text = f"{whole}.{rest[:min(digits, 6)]}{rest[digits:]}"
        try:
            times.append(dt.datetime.fromisoformat(text).timestamp())
        except ValueError:
            continue
    return min(times) if times else None


def registered_options(client: Client, etl_name: str) -> dict[str, Any]:
    """The ETL's settings as ``transform_bucket``'s ``options``: what it transforms offline jobs with."""
    with ais_errors(etl_name, "offline transform"):
        message = registered_message(client.etl(validate_name(etl_name)))
    if message is None:
        raise ClientError(f"ETL '{etl_name}' is not registered")
    runtime = message.get("runtime")
    runtime = runtime if isinstance(runtime, dict) else {}
    used = effective_options({e["name"]: e["value"] for e in (runtime.get("env") or []) + (message.get("env") or [])})
    return {key: value for key, value in used.items() if value is not None}


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


def _writes_end_marker(client: Client, first: dict, stage: str) -> bool:
    """Whether the pipeline's last ``stage`` is this transformer, which ends each shard with its end marker:
    registered with the service's settings (``register`` writes ``ETL_PRESET``) or the first stage's image."""
    with ais_errors(stage, "offline transform"):
        message = registered_message(client.etl(stage))
    if not message:
        return False

    def runtime(spec: dict) -> dict:
        value = spec.get("runtime")
        return value if isinstance(value, dict) else {}

    env = {e.get("name") for e in (runtime(message).get("env") or []) + (message.get("env") or [])}
    image = runtime(message).get("image")
    if {"ETL_PRESET", "ETL_TRANSFORMS"} & env or (image and image == runtime(first).get("image")):
        return True
    log.info("offline transform: the pipeline's last stage, ETL %s, is not this transformer; the copy is checked "
             "for the presence of each object, not for its end marker", stage)
    return False


def wait_job(job, timeout: float, poll: Callable[[bool], None] | None = None):
    """``job.wait`` within ``timeout`` seconds, polling about once a second; ``poll(False)`` between waits (every
    5 s), ``poll(True)`` once it ends.

    The SDK polls every ``timeout``/64 seconds (AIS's probing frequency): 56 s for an hour, so a job of
    a few seconds would be reported up to a minute late. Waiting in slices of 30 s keeps its poll at 1 s.
    """
    from aistore.sdk.errors import Timeout

    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                return job.wait(timeout=max(1, min(5 if poll else 30, int(left))), verbose=False)
            except Timeout:
                if deadline - time.monotonic() <= 0:
                    raise
                if poll is not None:
                    poll(False)
    finally:
        if poll is not None:
            poll(True)


def object_errors(client: Client, etl_name: str, job_id: str) -> list[tuple[str, str]]:
    """The objects a job of this ETL failed on, with AIS's message for each (``GET /v1/etl/<name>?uuid=``)."""
    with ais_errors(etl_name, "job errors"):
        details = client.etl(validate_name(etl_name)).view(job_id=job_id)
    return [(error.obj_name, error.msg) for error in details.obj_errors or []]


def etl_logs(client: Client, etl_name: str, target_id: str = "") -> dict[str, str]:
    """The pod's logs, per target (``GET /v1/etl/<name>/logs[/<target>]``)."""
    with ais_errors(etl_name, "logs"):
        entries = client.etl(validate_name(etl_name)).logs(target_id=target_id)
    return {entry.target_id: entry.logs for entry in entries}  # the SDK decodes AIS's base64


def _spec(value: Any) -> Any:
    """A transforms spec as the pod's environment holds it (compact JSON), read back; YAML text stays text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return json.loads(json.dumps(value))
