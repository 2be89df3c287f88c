"""An offline job's destination, proven whole by the client: each object is a recorded error or whole.

Every object asked for is either among the job's recorded errors or stored with its end marker.

AIS's job status alone cannot tell: an offline ``ws`` job whose object fails after the first byte
stores the cut tar and records nothing when the destination is on the same target, and with a direct
put to the other target it records the failure on some runs and drops it on others (the job then
reports success with the object missing). So after every offline job (``transform_bucket``,
``download``) the client lists the destination once (names and sizes, the listing's pages) and reads
the last ``TAIL_BYTES`` (2 KiB) of each object it expects with a range GET, several at a time: the
pod's end marker must close the object and count exactly the bytes before it
(``transformer.integrity.marker_from_tail``). A stage that writes no marker (a pipeline ending in
another ETL) can only be checked for presence. Anything else raises ``IncompleteCopy``, naming the
missing and the cut objects, whatever AIS says of the job.

An object already in the destination under an expected name, from before the job, counts as stored:
copy into an empty bucket (or prefix) to prove that this job wrote each one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os.path import commonprefix
from typing import TYPE_CHECKING

from ..errors import ShardError
from ..integrity import marker_from_tail

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

TAIL_READERS = 16  # range GETs in flight: each is two short round trips (proxy redirect, target)


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


def check_copy(client: Client, bucket: str, expected: Mapping[str, str], recorded: Collection[str], *,
               end_marker: bool = True, readers: int = TAIL_READERS) -> CopyCheck:
    """Check ais://``bucket`` against ``expected`` (destination name -> what it was made from, for messages).

    ``recorded`` holds the destination names the job recorded an error for: those need not be there.
    Every other one must be listed and, with ``end_marker``, end with a valid end marker.
    """
    started = time.monotonic()
    wanted = [name for name in expected if name not in recorded]
    sizes = _sizes(client, bucket, commonprefix(wanted)) if wanted else {}
    missing = [name for name in wanted if name not in sizes]
    present = [name for name in wanted if name in sizes]
    cut: list[tuple[str, str]] = []
    reads = 0
    if end_marker and present:
        with ThreadPoolExecutor(min(readers, len(present)), thread_name_prefix="copy-check") as pool:
            for name, (why, count) in zip(present, pool.map(lambda n: _tail(client, bucket, n, sizes[n]), present)):
                reads += count
                if why == _GONE:
                    missing.append(name)
                elif why:
                    cut.append((name, why))
    check = CopyCheck(bucket, len(expected), len(expected) - len(wanted), len(wanted) - len(missing) - len(cut),
                      tuple(missing), tuple(cut), reads, time.monotonic() - started)
    log.info("ais://%s: %d of %d objects %s, %d recorded as failed by AIS, %d missing, %d cut (%d range reads "
             "in %.2f s)", bucket, check.whole, check.expected, "whole" if end_marker else "present",
             check.recorded, len(missing), len(cut), reads, check.seconds)
    return check


_GONE = "\0gone"  # listed, then not found when read


def _sizes(client: Client, bucket: str, prefix: str) -> dict[str, int]:
    """Name -> size of every object under ``prefix``: one listing, its pages, names and sizes only."""
    from aistore.sdk.errors import ErrBckNotFound

    try:
        return {entry.name: entry.size for entry in client.bucket(bucket).list_objects_iter(prefix=prefix,
                                                                                          props="name,size")}
    except ErrBckNotFound:  # AIS made no destination at all: every object is missing
        return {}


def _tail(client: Client, bucket: str, name: str, size: int) -> tuple[str, int]:
    """Why the object is not whole ('' when it is), and the range reads it took."""
    _, why, reads = tail_marker(client, bucket, name, size, gone=_GONE)
    return why, reads


def tail_marker(client: Client, bucket: str, name: str, size: int, *, gone: str) -> tuple[dict | None, str, int]:
    """An object's end marker read from its tail with range GETs: (the marker, '', reads), or (None, why it has
    none, reads); ``gone`` is the why of an object listed, then not found when read."""
    from aistore.sdk.errors import ErrObjNotFound

    obj = client.bucket(bucket).object(name)
    reads = 0

    def read(offset: int, length: int) -> bytes:
        nonlocal reads
        reads += 1
        return obj.get_reader(byte_range=f"bytes={offset}-{offset + length - 1}").read_all()

    try:
        return marker_from_tail(read, size, name), "", reads
    except ShardError as exc:
        return None, exc.reason, reads
    except ErrObjNotFound:
        return None, gone, reads
