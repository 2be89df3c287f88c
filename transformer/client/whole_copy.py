"""An offline job's destination, proven whole by the client: each object is a recorded error or whole.

Every object asked for is either among the job's recorded errors or stored with its end marker.

AIS's job status alone cannot tell: an offline ``ws`` job whose object fails after the first byte
stores the cut tar and records nothing when the destination is on the same target, and with a direct
put to the other target it records the failure on some runs and drops it on others (the job then
reports success with the object missing). So after every offline job (``transform_bucket``,
``download``) the client lists the destination once (names, sizes and checksums, the listing's pages)
and reads the last ``TAIL_BYTES`` (2 KiB) of each object it expects with a suffix range GET, several
at a time: the pod's end marker must close the object and count exactly the bytes before it
(``transformer.integrity.marker_from_tail``). The object's size is taken from that read, not from the
listing, so an object rewritten after the listing is judged by what it holds then. A stage that
writes no marker (a pipeline ending in another ETL) can only be checked for presence. Anything else
raises ``IncompleteCopy``, naming the missing and the cut objects, whatever AIS says of the job.

An object already in the destination under an expected name, from before the job, counts as stored:
copy into an empty bucket (or prefix) to prove that this job wrote each one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from os.path import commonprefix
from typing import TYPE_CHECKING, Protocol

from ..errors import ShardError
from ..integrity import TAIL_BYTES, marker_from_tail
from ..wire import BLOCK
from .listing import Listing, list_bucket

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

TAIL_READERS = 16  # range GETs in flight: each is two short round trips (proxy redirect, target)


class ProgressBar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class Progress(Protocol):
    """Makes a progress bar for ``total`` steps of ``what`` (the command line passes tqdm's)."""

    def __call__(self, total: int, what: str) -> ProgressBar: ...


@dataclass(frozen=True)
class Tail:
    """What the last bytes of one stored object say: its end marker, or why it has none.

    ``size`` and ``checksum`` are those of the object the bytes were read from (the range GET's own
    ``Content-Range`` total and ``Ais-Checksum-Value``), which a listing taken earlier may no longer
    match: an object rewritten in between is judged by what it holds now.
    """

    marker: dict | None
    why: str  # '' when the marker is there and valid
    reads: int
    size: int = -1  # -1: not read (told from the listed size alone, or gone)
    checksum: str = ""


@dataclass(frozen=True)
class CopyCheck:
    """What the check of one destination found, and what it cost."""

    bucket: str
    expected: int  # objects asked for
    recorded: int  # ... accounted for by the job's errors
    whole: int  # ... stored whole (end marker verified), or present where no marker can be checked
    missing: tuple[str, ...]  # not in the destination, no error recorded
    cut: tuple[tuple[str, str], ...]  # (object, why) stored without a valid end marker, no error recorded
    tail_reads: int
    seconds: float
    tails: Mapping[str, Tail] = field(default_factory=dict, repr=False)  # destination name -> its tail, as read
    listing: Listing | None = field(default=None, repr=False)  # the destination listing it used

    @property
    def complete(self) -> bool:
        return not self.missing and not self.cut


def destination_name(name: str, ext: Mapping[str, str] | None) -> str:
    """The name an offline copy stores ``name`` under: AIS replaces the extension after the last dot by
    ``ext``'s value for it (``TCBMsg.ToName``, api/apc/tcbtco.go)."""
    if ext:
        dot = name.rfind(".")
        if dot >= 0 and name[dot + 1:] in ext:
            return name[:dot + 1] + ext[name[dot + 1:]].lstrip(".")
    return name


def source_names(name: str, ext: Mapping[str, str] | None) -> tuple[str, ...]:
    """Every source name ``destination_name`` maps to ``name``: ``destination_name``'s inverse."""
    candidates = {name}
    for old, new in (ext or {}).items():
        new = new.lstrip(".")
        if name.endswith("." + new):
            candidates.add(name[:len(name) - len(new)] + old)
    return tuple(sorted(candidate for candidate in candidates if destination_name(candidate, ext) == name))


def check_copy(client: Client, bucket: str, expected: Mapping[str, str], recorded: Collection[str], *,
               end_marker: bool = True, readers: int = TAIL_READERS, listing: Listing | None = None,
               progress: Progress | None = None) -> CopyCheck:
    """Check ais://``bucket`` against ``expected`` (destination name -> what it was made from, for messages).

    ``recorded`` holds the destination names the job recorded an error for: those need not be there.
    Every other one must be listed and, with ``end_marker``, end with a valid end marker. ``listing`` is
    a listing of the bucket taken after the job that covers every expected name (one is taken otherwise).
    """
    started = time.monotonic()
    wanted = [name for name in expected if name not in recorded]
    if listing is None:
        listing = list_bucket(client, bucket, commonprefix(wanted)) if wanted else Listing(bucket, "")
    listed = listing.entries
    missing = [name for name in wanted if name not in listed]
    present = [name for name in wanted if name in listed]
    cut: list[tuple[str, str]] = []
    tails: dict[str, Tail] = {}
    if end_marker and present:
        for name, tail in zip(present, read_tails(client, bucket, {n: listed[n].size for n in present}, readers,
                                                  progress, "copy check")):
            tails[name] = tail
            if tail.why == GONE:
                missing.append(name)
            elif tail.why:
                cut.append((name, tail.why))
    reads = sum(tail.reads for tail in tails.values())
    check = CopyCheck(bucket, len(expected), len(expected) - len(wanted), len(wanted) - len(missing) - len(cut),
                      tuple(missing), tuple(cut), reads, time.monotonic() - started, tails, listing)
    log.info("ais://%s: %d of %d objects %s, %d recorded as failed by AIS, %d missing, %d cut (%d range reads "
             "in %.2f s)", bucket, check.whole, check.expected, "whole" if end_marker else "present",
             check.recorded, len(missing), len(cut), reads, check.seconds)
    return check


GONE = "listed, then not found when read"


def read_tails(client: Client, bucket: str, sizes: Mapping[str, int], readers: int = TAIL_READERS,
               progress: Progress | None = None, what: str = "tail reads") -> list[Tail]:
    """``read_tail`` of each object of ``sizes`` (name -> listed size), ``readers`` at a time, in their order."""
    names = list(sizes)
    if not names:
        return []
    bar = progress(len(names), what) if progress else None
    try:
        def one(name: str) -> Tail:
            tail = read_tail(client, bucket, name, sizes[name])
            if bar is not None:
                bar.update(1)
            return tail

        with ThreadPoolExecutor(min(readers, len(names)), thread_name_prefix="tail-read") as pool:
            return list(pool.map(one, names))
    finally:
        if bar is not None:
            bar.close()


def read_tail(client: Client, bucket: str, name: str, listed_size: int) -> Tail:
    """An object's end marker, read from its tail: one suffix range GET (the last ``TAIL_BYTES``), more only
    for a tar padded after its end-of-archive blocks.

    ``listed_size`` tells a cut object without a read (empty, or not whole tar blocks); otherwise the
    size is the one AIS gives with the bytes, so a listing older than the object costs no failure.
    """
    from aistore.sdk.errors import AISError, ErrObjNotFound

    if listed_size <= 0 or listed_size % BLOCK:
        try:
            marker_from_tail(_no_read, listed_size, name)
        except ShardError as exc:
            return Tail(None, exc.reason, 0)
    obj = client.bucket(bucket).object(name)
    reads = 0
    for _ in range(3):  # the object replaced between two of its reads: read its new tail
        try:
            tail = _read_once(obj, name)
            return replace(tail, reads=reads + tail.reads)
        except ErrObjNotFound:
            return Tail(None, GONE, reads + 1)
        except AISError as exc:
            if exc.status_code != 416:  # 416: a further range past the end of the object that replaced it
                raise
            reads += 1
    return Tail(None, "rewritten while its tail was read, three times", reads)


def _read_once(obj, name: str) -> Tail:
    """``read_tail``'s one attempt: the suffix read, then (for a padded tar) ranges before it."""
    data, size, checksum = _suffix(obj, TAIL_BYTES)
    start, reads = size - len(data), 1

    def read(offset: int, length: int) -> bytes:
        nonlocal reads
        if offset >= start:
            return data[offset - start:offset - start + length]
        reads += 1
        return obj.get_reader(byte_range=f"bytes={offset}-{offset + length - 1}").read_all()

    try:
        return Tail(marker_from_tail(read, size, name), "", reads, size, checksum)
    except ShardError as exc:
        return Tail(None, exc.reason, reads, size, checksum)


def _suffix(obj, length: int) -> tuple[bytes, int, str]:
    """The last ``length`` bytes of ``obj`` (all of it if shorter), its whole size and its checksum."""
    response = obj.get_reader(byte_range=f"bytes=-{length}").raw()  # raw: the headers come with the bytes
    try:
        data = response.read()
        headers = response.headers
    finally:
        response.release_conn()
    total = (headers.get("Content-Range") or "").rpartition("/")[2]
    size = int(total) if total.isdigit() else len(data)
    return data, size, headers.get("Ais-Checksum-Value") or ""


def _no_read(offset: int, length: int) -> bytes:
    raise AssertionError("an object of this size is told cut without reading it")
