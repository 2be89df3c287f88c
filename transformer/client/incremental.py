"""Incremental offline transforms: what of a destination is stale, read from the end markers' tails.

Every shard the pod writes ends with its end marker, which records what it was made from: the input's
size and XXH64 digest (``input``, the value AIS lists as an ``xxhash2`` object checksum), a digest of
the effective transform settings (``settings``) and the package version (``version``). So one listing
of each bucket and one range GET of each destination's last 2 KiB classify every source object:

* **new**: no destination object;
* **cut**: the destination has no valid end marker;
* **changed**: the source's size or checksum differs from the marker's ``input`` (or cannot be
  compared: the source bucket's checksum type is not ``xxhash2``, or AIS lists no checksum);
* **restyled**: the marker's ``settings`` or ``version`` differs from what the ETL writes now, or the
  marker predates these fields;
* **up to date**: none of these;

and each destination object that no source maps to is an **orphan**. What the ETL writes now is asked
of the pod itself: a 1 KiB empty tar, the probe, is put into the destination, read once through the
ETL (the same defaults an offline job gets: no ``etl_args``), and deleted, whether the read worked or
not; its marker carries the pod's settings digest and version. Exact, whatever image or environment
the ETL runs with. A probe's name is unique (its time and a random part), so concurrent checks of one
bucket never share one; probes are never orphans, and one older than ``PROBE_LIFETIME`` (left by a
check that was killed, or whose delete failed) is deleted by the next check of that bucket.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ShardError
from ..integrity import marker_from_tail
from ..wire import END_OF_ARCHIVE, INPUT_CHECKSUM
from .errors import ClientError
from .etlspec import validate_name
from .registration import ais_errors
from .whole_copy import TAIL_READERS, destination_name, tail_marker

if TYPE_CHECKING:
    from aistore.sdk import Client

_DELETED = "deleted while being checked"  # listed, then not found when its tail was read

log = logging.getLogger("transformer.client")

PROBE_PREFIX = "__etl__/probe-"  # + "<unix seconds>-<random hex>.tar": put into the destination, read, deleted
PROBE_LIFETIME = 3600  # seconds; a probe older than this is a leftover: no live check holds one that long
CLASSES = ("new", "changed", "restyled", "cut", "up_to_date", "orphan")


@dataclass(frozen=True)
class Changes:
    """How each source object of an incremental transform compares with its destination.

    Names are source names, except ``orphans`` and ``deleted`` (destination names). ``identity`` says
    how inputs were compared: ``"xxhash2"``, or why they could not be (every one then counts as changed).
    """

    new: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    restyled: tuple[str, ...] = ()
    cut: tuple[tuple[str, str], ...] = ()  # (source name, why its destination is not whole)
    up_to_date: tuple[str, ...] = ()
    orphans: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()  # the orphans removed (delete_orphans=True)
    identity: str = INPUT_CHECKSUM
    tail_reads: int = 0
    seconds: float = 0.0  # the check's time: listings, probe, tail reads
    settings: str = field(default="", repr=False)  # what the ETL writes now: settings digest
    version: str = field(default="", repr=False)  # ... and package version

    @property
    def stale(self) -> tuple[str, ...]:
        """The source objects to transform again: new, changed, restyled and cut."""
        return self.new + self.changed + self.restyled + tuple(name for name, _ in self.cut)

    @property
    def counts(self) -> dict[str, int]:
        return {"new": len(self.new), "changed": len(self.changed), "restyled": len(self.restyled),
                "cut": len(self.cut), "up_to_date": len(self.up_to_date), "orphan": len(self.orphans)}


def find_changes(client: Client, etl_name: str, source: str, destination: str, *, prefix: str = "",
                 ext: Mapping[str, str] | None = None, readers: int = TAIL_READERS) -> Changes:
    """Classify the objects of ais://``source`` under ``prefix`` against ais://``destination``; nothing is written
    but the probe (put, read through the ETL, deleted). Raises ``ValueError`` where ``ext`` maps two sources to
    one destination name (no comparison is possible)."""
    started = time.monotonic()
    validate_name(etl_name)
    if source == destination:
        raise ValueError(f"incremental transform: source and destination are both ais://{source}")
    with ais_errors(etl_name, "incremental check"):
        identity = _identity(client, source)
        sources = {entry.name: entry for entry in
                   client.bucket(source).list_objects_iter(prefix=prefix, props="name,size,checksum,version")}
        mapped: dict[str, str] = {}
        for name in sources:
            target = destination_name(name, ext)
            if target in mapped:
                raise ValueError(f"incremental transform: ext {dict(ext or {})} maps both '{mapped[target]}' and "
                                 f"'{name}' to '{target}'; no comparison is possible: give an ext that keeps "
                                 "names apart, or transform in full")
            mapped[target] = name
        stored = _destination(client, destination, _listing_prefix(prefix, ext))
        present = [target for target in mapped if target in stored]
        settings = version = ""
        if present:
            settings, version = probe(client, etl_name, destination)
        markers: dict[str, tuple[dict | None, str]] = {}
        reads = 0
        if present:
            with ThreadPoolExecutor(min(readers, len(present)), thread_name_prefix="sync-check") as pool:
                tails = pool.map(lambda t: tail_marker(client, destination, t, stored[t], gone=_DELETED), present)
                for target, (marker, why, count) in zip(present, tails):
                    markers[target] = (marker, why)
                    reads += count
    classes: dict[str, list] = {name: [] for name in ("new", "changed", "restyled", "cut", "up_to_date")}
    for target, name in mapped.items():
        if target not in markers:
            classes["new"].append(name)
            continue
        marker, why = markers[target]
        if marker is None:
            classes["cut"].append((name, why))
        elif not all(key in marker for key in ("input", "settings", "version")):
            classes["restyled"].append(name)  # a marker from before these fields: stale
        elif not _same_input(marker["input"], sources[name], identity):
            classes["changed"].append(name)
        elif marker["settings"] != settings or marker["version"] != version:
            classes["restyled"].append(name)
        else:
            classes["up_to_date"].append(name)
    orphans = tuple(sorted(name for name in stored if name not in mapped and not name.startswith(PROBE_PREFIX)))
    changes = Changes(**{key: tuple(value) for key, value in classes.items()}, orphans=orphans,
                      identity=identity, tail_reads=reads, seconds=time.monotonic() - started,
                      settings=settings, version=version)
    log.info("ais://%s -> ais://%s: %s (%d range reads in %.2f s)", source, destination,
             ", ".join(f"{count} {key.replace('_', ' ')}" for key, count in changes.counts.items()),
             reads, changes.seconds)
    return changes


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
    what = f"ETL {etl_name}'s output for an empty tar"
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
    for entry in client.bucket(bucket).list_objects_iter(prefix=PROBE_PREFIX, props="name"):
        stamp = entry.name[len(PROBE_PREFIX):].split("-", 1)[0]
        if stamp.isdigit() and now - int(stamp) > PROBE_LIFETIME:
            stale.append(entry.name)
    for name in stale:
        with contextlib.suppress(ErrObjNotFound):  # a concurrent check deleted it first
            client.bucket(bucket).object(name).delete()
        log.info("ais://%s: deleted the probe %s, left by an earlier check", bucket, name)
    return tuple(stale)


def delete_objects(client: Client, bucket: str, names: tuple[str, ...], readers: int = TAIL_READERS
                   ) -> tuple[str, ...]:
    """Delete ``names`` from ais://``bucket`` (several at a time); the names deleted."""
    if not names:
        return ()
    with ThreadPoolExecutor(min(readers, len(names)), thread_name_prefix="sync-delete") as pool:
        list(pool.map(lambda name: client.bucket(bucket).object(name).delete(), names))
    log.info("ais://%s: %d objects deleted", bucket, len(names))
    return names


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


def _same_input(recorded: Any, entry: Any, identity: str) -> bool:
    if identity != INPUT_CHECKSUM or not isinstance(recorded, dict):
        return False
    return (recorded.get("cksum_type") == INPUT_CHECKSUM and bool(entry.checksum)
            and recorded.get("cksum") == entry.checksum and recorded.get("size") == entry.size)


def _listing_prefix(prefix: str, ext: Mapping[str, str] | None) -> str:
    """The destination's listing prefix: the source's, cut before an extension that ``ext`` may rename."""
    if ext and "." in prefix.rsplit("/", 1)[-1]:
        return prefix[:prefix.rfind(".")]
    return prefix


def _destination(client: Client, bucket: str, prefix: str) -> dict[str, int]:
    """Name -> size under ``prefix`` in ais://``bucket``; empty where it does not exist yet."""
    from aistore.sdk.errors import ErrBckNotFound

    try:
        return {entry.name: entry.size for entry in client.bucket(bucket).list_objects_iter(prefix=prefix,
                                                                                          props="name,size")}
    except ErrBckNotFound:
        return {}
