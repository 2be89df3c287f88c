"""Incremental offline transforms: what of a destination is stale, told from listings and the end markers.

Every shard the pod writes ends with its end marker, which records what it was made from: the input's
size and XXH64 digest (``input``, the value AIS lists as an ``xxhash2`` object checksum), a digest of
the effective transform settings (``settings``) and the package version (``version``). One listing of
each bucket, the copy ledger (``transformer.client.ledger``: the markers already read, keyed by each
copy's listed size and checksum) and a 2 KiB tail read of each copy the ledger does not know classify
every source object:

* **new**: no destination object;
* **cut**: the destination has no valid end marker;
* **changed**: the source's size or checksum differs from the marker's ``input`` (or cannot be
  compared: the source bucket's checksum type is not ``xxhash2``, or AIS lists no checksum);
* **restyled**: the marker's ``settings`` or ``version`` differs from what the ETL writes now, or the
  marker predates these fields;
* **up to date**: none of these.

Every other object under the destination's listing prefix is an **orphan** or an **other**. An orphan
is a copy this transformer made of a source that is gone: it ends with a valid end marker, and its
name maps back through ``ext`` to a source name under the prefix that the source listing does not
hold. Only orphans are ever deleted (``delete_orphans``); the others (no end marker, or a name no
source under the prefix maps to) are reported with the reason, and kept. Objects under ``__etl__/``
(probes, ledgers) are this tool's own and are neither.

What the ETL writes now is asked of the pod itself: a 1 KiB empty tar, the probe, is put into the
destination, read once through the ETL (the same defaults an offline job gets: no ``etl_args``), and
deleted, whether the read worked or not; its marker carries the pod's settings digest and version.
The answer is kept in the ledger with the ETL's identity (name, current run, registration), and asked
again only when that changes. A probe's name is unique (its time and a random part), so concurrent
checks of one bucket never share one; one older than ``PROBE_LIFETIME`` (left by a check that was
killed, or whose delete failed) is deleted by the next check that probes that bucket. A dry run puts
nothing: where it must ask the pod, it reads the smallest source object through the ETL instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ShardError
from ..integrity import marker_from_tail
from ..wire import END_OF_ARCHIVE, INPUT_CHECKSUM
from .errors import ClientError, OrphanDeleteRefused
from .etlspec import validate_name
from .jobs import wait_job
from .ledger import Known, Ledger, LedgerBuilder, digest, input_key, ledger_name, load_ledger
from .listing import Listing, list_bucket
from .registration import ais_errors, registered_message
from .whole_copy import TAIL_READERS, Progress, Tail, destination_name, read_tails, source_names

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

OWN_PREFIX = "__etl__/"  # this tool's objects in a destination: probes, ledgers; never classified, never orphans
PROBE_PREFIX = "__etl__/probe-"  # + "<unix seconds>-<random hex>.tar": put into the destination, read, deleted
PROBE_LIFETIME = 3600  # seconds; a probe older than this is a leftover: no live check holds one that long
CLASSES = ("new", "changed", "restyled", "cut", "up_to_date", "orphan", "other")
DELETE_JOB_KIND = "delete-listrange"  # AIS's multi-object delete


@dataclass(frozen=True)
class Changes:
    """How each source object of an incremental transform compares with its destination.

    Names are source names, except ``orphans``, ``others``, ``deleted`` and ``not_deleted`` (destination
    names). ``identity`` says how inputs were compared: ``"xxhash2"``, or why they could not be (every one
    then counts as changed). ``ledger_hits`` copies were classified from the ledger, ``tail_reads`` range
    GETs read the others; ``probe`` says how the ETL's settings were learnt: ``"asked"`` (the probe),
    ``"remembered"`` (the ledger, same ETL run), ``"read"`` (a dry run's read of a source through the
    ETL) or ``""`` (no copy to compare). ``rebalancing``: a listing (of either bucket) was flagged as
    taken during a rebalance, so no orphan can be deleted.
    """

    new: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    restyled: tuple[str, ...] = ()
    cut: tuple[tuple[str, str], ...] = ()  # (source name, why its destination is not whole)
    up_to_date: tuple[str, ...] = ()
    orphans: tuple[str, ...] = ()  # this transformer's copies of sources that are gone: the only deletable objects
    others: tuple[tuple[str, str], ...] = ()  # (name, why it is not an orphan): reported, never deleted
    deleted: tuple[str, ...] = ()  # the orphans AIS deleted (delete_orphans=True), as a listing after it shows
    not_deleted: tuple[tuple[str, str], ...] = ()  # (orphan, why it is still there) after the delete
    identity: str = INPUT_CHECKSUM
    tail_reads: int = 0
    ledger_hits: int = 0
    probe: str = ""
    rebalancing: bool = False
    seconds: float = 0.0  # the check's time: listings, ledger, probe, tail reads
    settings: str = field(default="", repr=False)  # what the ETL writes now: settings digest
    version: str = field(default="", repr=False)  # ... and package version

    @property
    def stale(self) -> tuple[str, ...]:
        """The source objects to transform again: new, changed, restyled and cut."""
        return self.new + self.changed + self.restyled + tuple(name for name, _ in self.cut)

    @property
    def counts(self) -> dict[str, int]:
        return {"new": len(self.new), "changed": len(self.changed), "restyled": len(self.restyled),
                "cut": len(self.cut), "up_to_date": len(self.up_to_date), "orphan": len(self.orphans),
                "other": len(self.others)}


@dataclass
class Check:
    """One incremental check's findings, with what a run needs after its job: the listings, the markers known
    (copy identity -> ``Known``), the ledger as loaded and the ETL identity its probe belongs to."""

    changes: Changes
    sources: Listing
    stored: Listing
    mapped: dict[str, str]  # destination name -> source name
    known: dict[tuple[int, str], Known] = field(default_factory=dict)
    tails: dict[str, Tail] = field(default_factory=dict)  # destination name -> its tail, read by this check
    ledger: Ledger = field(default_factory=lambda: Ledger(""))
    etl_id: str = ""


def find_changes(client: Client, etl_name: str, source: str, destination: str, *, prefix: str = "",
                 ext: Mapping[str, str] | None = None, readers: int = TAIL_READERS, dry_run: bool = False,
                 progress: Progress | None = None) -> Changes:
    """Classify the objects of ais://``source`` under ``prefix`` against ais://``destination``; nothing is written
    but the probe, when the ETL must be asked (put, read through the ETL, deleted; with ``dry_run``, nothing at
    all). Raises ``ValueError`` where ``ext`` maps two sources to one destination name (no comparison is
    possible)."""
    return check_destination(client, etl_name, source, destination, prefix=prefix, ext=ext, readers=readers,
                             dry_run=dry_run, progress=progress).changes


def check_destination(client: Client, etl_name: str, source: str, destination: str, *, prefix: str = "",
                      ext: Mapping[str, str] | None = None, readers: int = TAIL_READERS, dry_run: bool = False,
                      progress: Progress | None = None) -> Check:
    """``find_changes``'s work, keeping what a run needs after its job (``Check``)."""
    started = time.monotonic()
    validate_name(etl_name)
    if source == destination:
        raise ValueError(f"incremental transform: source and destination are both ais://{source}")
    with ais_errors(etl_name, "incremental check"):
        identity = _identity(client, source)
        sources = list_bucket(client, source, prefix)
        mapped = map_names(sources, ext)
        stored = list_bucket(client, destination, listing_prefix(prefix, ext))
        name = ledger_name(source, prefix, ext)
        ledger = load_ledger(client, destination, name) if stored.exists else Ledger(name)
        present = [target for target in mapped if target in stored]
        check = Check(Changes(), sources, stored, mapped, ledger=ledger, etl_id=etl_identity(client, etl_name))
        settings = version = how = ""
        if present:
            settings, version, how = _etl_writes(client, etl_name, check, dry_run)
        for target in present:
            entry = stored.entries[target]
            hit = ledger.known(entry.size, entry.checksum)
            if hit is not None:
                check.known[entry.size, entry.checksum] = hit
        unread = {target: stored.entries[target].size for target in present
                  if (stored.entries[target].size, stored.entries[target].checksum) not in check.known}
        tails = read_tails(client, destination, unread, readers, progress, "incremental check")
        for target, tail in zip(unread, tails):
            check.tails[target] = tail
            _learn(check.known, tail)
        orphans, others = leftovers(client, check, prefix, ext, readers, progress)
    classes: dict[str, list] = {name: [] for name in ("new", "changed", "restyled", "cut", "up_to_date")}
    hits = 0
    for target, name in mapped.items():
        if target not in stored:
            classes["new"].append(name)
            continue
        kind, why, from_ledger = _classify(check, target, sources.entries[name], identity, settings, version)
        hits += from_ledger
        classes[kind].append((name, why) if kind == "cut" else name)
    check.changes = Changes(**{key: tuple(value) for key, value in classes.items()}, orphans=orphans, others=others,
                            identity=identity, tail_reads=sum(tail.reads for tail in check.tails.values()),
                            ledger_hits=hits, probe=how, rebalancing=stored.rebalancing or sources.rebalancing,
                            seconds=time.monotonic() - started, settings=settings, version=version)
    log.info("ais://%s -> ais://%s: %s (%d from the ledger, %d range reads, in %.2f s)", source, destination,
             ", ".join(f"{count} {key.replace('_', ' ')}" for key, count in check.changes.counts.items()), hits,
             check.changes.tail_reads, check.changes.seconds)
    return check


def map_names(sources: Listing, ext: Mapping[str, str] | None) -> dict[str, str]:
    """Destination name -> source name for every listed source; ``ValueError`` where two share a destination."""
    mapped: dict[str, str] = {}
    for name in sources.entries:
        target = destination_name(name, ext)
        if target in mapped:
            raise ValueError(f"incremental transform: ext {dict(ext or {})} maps both '{mapped[target]}' and "
                             f"'{name}' to '{target}'; no comparison is possible: give an ext that keeps "
                             "names apart, or transform in full")
        mapped[target] = name
    return mapped


def listing_prefix(prefix: str, ext: Mapping[str, str] | None) -> str:
    """The destination's listing prefix: the shortest that holds the copy of every source name under ``prefix``.

    ``ext`` renames only what follows a name's last dot. A source name under ``prefix`` whose last dot
    lies inside ``prefix`` (``val/shard-1.t`` + ``ar``) is renamed only where an ``ext`` key begins with
    what follows that dot in ``prefix``; only then is the prefix cut there. ``v1.2`` stays ``v1.2``.
    """
    dot = prefix.rfind(".")
    if ext and dot >= 0 and any(key.startswith(prefix[dot + 1:]) for key in ext):
        return prefix[:dot + 1]
    return prefix


def leftovers(client: Client, check: Check, prefix: str, ext: Mapping[str, str] | None,
              readers: int = TAIL_READERS, progress: Progress | None = None
              ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The destination objects no listed source maps to: (orphans, others with why), from ``check``'s listings.

    An orphan ends with a valid end marker (the ledger knows it, or its tail is read now) and its name maps
    back through ``ext`` to a source name under ``prefix`` that the source listing does not hold.
    """
    orphans: list[str] = []
    others: list[tuple[str, str]] = []
    candidates: list[str] = []
    for name in check.stored.entries:
        if name in check.mapped or name.startswith(OWN_PREFIX):
            continue
        if not [source for source in source_names(name, ext) if source.startswith(prefix)]:
            others.append((name, f"its name maps back to no source name under the prefix '{prefix}'"
                                 + (f" (ext {dict(ext)})" if ext else "")))
        else:
            candidates.append(name)
    entries = check.stored.entries
    for name in candidates:
        hit = check.ledger.known(entries[name].size, entries[name].checksum)
        if hit is not None:
            check.known[entries[name].size, entries[name].checksum] = hit
    unread = {name: entries[name].size for name in candidates
              if (entries[name].size, entries[name].checksum) not in check.known and name not in check.tails}
    for name, tail in zip(unread, read_tails(client, check.stored.bucket, unread, readers, progress, "orphan check")):
        check.tails[name] = tail
        _learn(check.known, tail)
    for name in candidates:
        tail = check.tails.get(name)
        if (entries[name].size, entries[name].checksum) in check.known or (tail is not None and tail.marker):
            orphans.append(name)
        else:
            why = tail.why if tail is not None else "not read"
            others.append((name, f"no end marker of this transformer ({why})"))
    return tuple(sorted(orphans)), tuple(sorted(others))


def delete_orphan_copies(client: Client, check: Check, timeout: float = 600
                         ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Delete ``check``'s orphans with one AIS multi-object delete; (deleted, not deleted with why), as a listing
    after the delete shows them. Raises ``OrphanDeleteRefused``, deleting nothing, where the destination's
    listing was taken during a rebalance or one runs now: it may have missed copies of existing sources."""
    from os.path import commonprefix

    orphans = check.changes.orphans
    bucket = check.stored.bucket
    if not orphans:
        return (), ()
    if check.stored.rebalancing or check.sources.rebalancing:
        which = "ais://" + (bucket if check.stored.rebalancing else check.sources.bucket)
        raise OrphanDeleteRefused(bucket, f"AIS flagged the listing of {which} as taken during a rebalance (or "
                                          "after an interrupted one), so it may lack objects that exist", orphans)
    running = client.cluster().list_running_jobs(job_kind="rebalance")
    if running:
        raise OrphanDeleteRefused(bucket, f"a rebalance runs ({', '.join(running)})", orphans)
    job_id = client.bucket(bucket).objects(obj_names=list(orphans)).delete()
    result = wait_job(client.job(job_id, job_kind=DELETE_JOB_KIND), timeout)
    after = list_bucket(client, bucket, commonprefix(list(orphans)), props="name,size")
    deleted = tuple(name for name in orphans if name not in after)
    outcome = "it reports success" if result.success else f"it reports: {result.error or 'failure'}"
    left = tuple((name, f"still listed after AIS's delete job {job_id} ({outcome})") for name in orphans
                 if name in after)
    log.info("ais://%s: %d orphans deleted by job %s, %d left", bucket, len(deleted), job_id, len(left))
    return deleted, left


def new_ledger(check: Check, stored: Listing, extra: Mapping[tuple[int, str], Known] | None = None) -> Ledger:
    """The ledger a run leaves: a record for each copy in ``stored`` whose marker is known (the check's, ``extra``'s,
    the old ledger's), and the ETL's probe."""
    etl = None
    if check.etl_id and check.changes.settings:
        etl = {"id": check.etl_id, "settings": check.changes.settings, "version": check.changes.version}
    builder = LedgerBuilder(check.ledger.name, etl)
    known = {**check.known, **(extra or {})}
    for name, entry in stored.entries.items():
        if name.startswith(OWN_PREFIX) or not entry.checksum:
            continue
        hit = known.get((entry.size, entry.checksum)) or check.ledger.known(entry.size, entry.checksum)
        if hit is not None:
            builder.add_known(entry.size, entry.checksum, hit)
    ledger = builder.build()
    ledger.loaded = check.ledger.loaded
    return ledger


def known_from(tail: Tail) -> Known | None:
    """What a tail's marker records, as the ledger keeps it; None where it lacks a field."""
    marker = tail.marker
    if not marker or not all(key in marker for key in ("input", "settings", "version")):
        return None
    recorded = marker["input"] if isinstance(marker["input"], dict) else {}
    return Known(input_key(recorded.get("size"), recorded.get("cksum_type"), recorded.get("cksum")),
                 str(marker["settings"]), str(marker["version"]))


def _learn(known: dict[tuple[int, str], Known], tail: Tail) -> None:
    """Remember a tail's marker under the identity of the object it was read from (its own size and checksum)."""
    found = known_from(tail)
    if found is not None and tail.checksum and tail.size >= 0:
        known[tail.size, tail.checksum] = found


def _classify(check: Check, target: str, source: Any, identity: str, settings: str,
              version: str) -> tuple[str, str, bool]:
    """(class, why it is cut, whether the ledger told) of the present copy ``target`` of the listed ``source``."""
    entry = check.stored.entries[target]
    tail = check.tails.get(target)
    if tail is not None:  # read by this check: its own bytes, whatever the listing said
        if tail.marker is None:
            return "cut", tail.why, False
        known = known_from(tail)
        if known is None:
            return "restyled", "", False  # a marker from before these fields: stale
        from_ledger = False
    else:
        known = check.known[entry.size, entry.checksum]
        from_ledger = True
    same = (identity == INPUT_CHECKSUM and bool(source.checksum)
            and known.input == input_key(source.size, INPUT_CHECKSUM, source.checksum))
    if not same:
        return "changed", "", from_ledger
    if known.settings != settings or known.version != version:
        return "restyled", "", from_ledger
    return "up_to_date", "", from_ledger


def _etl_writes(client: Client, etl_name: str, check: Check, dry_run: bool) -> tuple[str, str, str]:
    """(settings digest, version, how it was learnt) of what the ETL writes now: remembered by the ledger for this
    ETL run, else asked of the pod (the probe; a dry run reads a source through the ETL instead)."""
    remembered = check.ledger.probe(check.etl_id) if check.etl_id else None
    if remembered is not None:
        return *remembered, "remembered"
    if dry_run:
        return *read_probe(client, etl_name, check.sources), "read"
    return *probe(client, etl_name, check.stored.bucket), "asked"


def etl_identity(client: Client, etl_name: str) -> str:
    """The ETL's name, its current run (the xaction id of its start) and a digest of its registration; '' where it
    does not run. Pods that restart abort the ETL and a start gets a new id, so one identity means the same pods."""
    running = [etl.xaction_id for etl in client.cluster().list_etls() if etl.id == etl_name and etl.xaction_id]
    if not running:
        return ""
    message = registered_message(client.etl(etl_name))
    return f"{etl_name}/{running[0]}/{digest('etl', json.dumps(message, sort_keys=True)):016x}"


def probe(client: Client, etl_name: str, bucket: str) -> tuple[str, str]:
    """The settings digest and package version the ETL writes now, read from its end marker for an empty tar
    put into ais://``bucket`` (then deleted)."""
    from aistore.sdk.etl import ETLConfig

    sweep_probes(client, bucket)
    name = f"{PROBE_PREFIX}{int(time.time())}-{uuid.uuid4().hex}.tar"
    obj = client.bucket(bucket).object(name)
    obj.get_writer().put_content(END_OF_ARCHIVE)
    try:
        data = obj.get_reader(etl=ETLConfig(etl_name)).read_all()
    finally:
        try:
            obj.delete()
        except Exception as exc:  # noqa: BLE001 (never hides the read's own error; the next check deletes it)
            log.warning("incremental check: the probe ais://%s/%s could not be deleted (%s); the first check of "
                        "this bucket after %d s deletes it", bucket, name, exc, PROBE_LIFETIME)
    return _settings_of(etl_name, data, f"ETL {etl_name}'s output for an empty tar")


def read_probe(client: Client, etl_name: str, sources: Listing) -> tuple[str, str]:
    """What ``probe`` learns, without writing: the smallest listed source read once through the ETL."""
    from aistore.sdk.etl import ETLConfig

    name = min(sources.entries, key=lambda n: (sources.entries[n].size, n))
    log.info("dry run: reading ais://%s/%s (%d bytes) through ETL %s for the settings it writes now",
             sources.bucket, name, sources.entries[name].size, etl_name)
    data = client.bucket(sources.bucket).object(name).get_reader(etl=ETLConfig(etl_name)).read_all()
    return _settings_of(etl_name, data, f"ETL {etl_name}'s output for ais://{sources.bucket}/{name}")


def _settings_of(etl_name: str, data: bytes, what: str) -> tuple[str, str]:
    try:
        marker = marker_from_tail(lambda offset, length: data[offset:offset + length], len(data), what)
    except ShardError as exc:
        raise ClientError(f"{exc.message}: the last stage of an incremental transform must be this "
                          "transformer") from None
    if "settings" not in marker or "version" not in marker:
        raise ClientError(f"ETL {etl_name} writes end markers without a settings digest: its image predates "
                          "incremental transforms; update the image, or transform in full")
    return marker["settings"], marker["version"]


def sweep_probes(client: Client, bucket: str, now: float | None = None) -> tuple[str, ...]:
    """Delete the probes in ais://``bucket`` older than ``PROBE_LIFETIME`` (their names tell their age); those
    of checks still running are younger and stay. Returns the names deleted."""
    from aistore.sdk.errors import ErrObjNotFound

    now = time.time() if now is None else now
    stale = []
    for name in list_bucket(client, bucket, PROBE_PREFIX, props="name").entries:
        stamp = name[len(PROBE_PREFIX):].split("-", 1)[0]
        if stamp.isdigit() and now - int(stamp) > PROBE_LIFETIME:
            stale.append(name)
    for name in stale:
        with contextlib.suppress(ErrObjNotFound):  # a concurrent check deleted it first
            client.bucket(bucket).object(name).delete()
        log.info("ais://%s: deleted the probe %s, left by an earlier check", bucket, name)
    return tuple(stale)


def _identity(client: Client, bucket: str) -> str:
    """``INPUT_CHECKSUM`` where the bucket's objects are checksummed as the pod hashes its input; else why not."""
    headers = client.bucket(bucket).head()
    try:
        props = json.loads(headers.get("Ais-Bucket-Props") or "{}")
    except ValueError:
        props = {}
    kind = (props.get("checksum") or {}).get("type") or "none"
    if kind == INPUT_CHECKSUM:
        return INPUT_CHECKSUM
    versioned = bool((props.get("versioning") or {}).get("enabled"))
    reason = (f"unknown: ais://{bucket} checksums its objects with {kind!r}, the pod records {INPUT_CHECKSUM!r}"
              + (" (object versions are not seen by the pod either)" if versioned else ""))
    log.warning("incremental transform: %s; every source with a destination counts as changed. Set the "
                "bucket's checksum type to %s (for objects written from then on) to compare them", reason,
                INPUT_CHECKSUM)
    return reason

