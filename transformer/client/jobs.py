"""AIS jobs as the client handles them: the job kinds, waiting for a job, the multi-object jobs that must not take
a new list, a job's per-object errors and the ETL pods' logs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ClientError
from .etlspec import validate_name
from .registration import ais_errors

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

JOB_KIND = "etl-bck"  # the xaction of a bucket-to-bucket transform
LIST_JOB_KIND = "etl-listrange"  # ... and of a multi-object (list or template) transform


def start_list_job(client: Client, etl_name: str, source: str, destination: str, start: Callable[[], str]) -> str:
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
