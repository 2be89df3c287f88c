"""The end marker: the last member of every shard the pod writes, the proof that the shard is whole.

Why it is needed: on an inline read through AIS (hpush), the target sends the pod's status line to
the reader before it copies the pod's body. If the pod fails after that, the target writes its JSON
error into the same body and ends the response normally, so the reader gets a cleanly terminated
``200`` holding part of the tar. Python's ``tarfile`` (under webdataset) takes an invalid header at a
member boundary for the end of the archive, so such a cut reads as a shorter, valid shard. Only
something at the end of the shard, checked by the reader, tells a whole shard from a cut one.

The marker is a small JSON member, ``__etl__/end.json``, written after every sample (and after the
error manifest, if any), just before the end-of-archive blocks. It records what the pod read and
wrote, the number of tar members before it and their byte count. webdataset's readers skip members
under ``__*__/`` by default, so a stock pipeline never sees it; ``ShardCheck`` verifies it.

It also records what the shard was made from, so that a later run can tell a stale copy from a
current one by reading this tail alone (``transformer.client.incremental``): ``input`` (the size and
XXH64 digest of every byte the pod read, the value AIS lists as the object's ``xxhash2`` checksum),
``settings`` (a digest of the effective transform settings, ``options.settings_digest``) and
``version`` (the package's). Markers written before these fields existed stay valid for readers.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from typing import Any, BinaryIO

from .errors import IncompleteShard, ShardError
from .shards import Member, Sample, readinto
from .wire import BLOCK, END_MARKER_FORMAT, END_MARKER_KEY, END_MARKER_NAME, INPUT_CHECKSUM


def end_marker_payload(*, samples_in: int, samples_out: int, skipped: int, passed_through: int, members: int,
                       bytes_before: int, source: dict[str, Any] | None = None, settings: str | None = None,
                       version: str | None = None) -> bytes:
    """The marker's JSON: counts for people, ``members`` and ``bytes`` for ``ShardCheck``; ``input``,
    ``settings`` and ``version`` (when given) for an incremental transform.

    No names: the output for an object is the same bytes whichever comm type or path asked for it.
    """
    marker: dict[str, Any] = {
        "format": END_MARKER_FORMAT,
        "samples_in": samples_in,
        "samples_out": samples_out,
        "skipped": skipped,
        "passed_through": passed_through,
        "members": members,
        "bytes": bytes_before,
    }
    if source is not None:
        marker["input"] = source
    if settings is not None:
        marker["settings"] = settings
    if version is not None:
        marker["version"] = version
    return json.dumps(marker, indent=1).encode()


class InputDigest:
    """A read-through wrapper that hashes every byte read from ``stream`` (``INPUT_CHECKSUM``) and counts them.

    ``drain()`` reads whatever is left (the second end-of-archive block, a tar writer's padding), so the
    digest covers the whole object, as AIS's checksum of it does.
    """

    __slots__ = ("_stream", "_hash", "size")

    def __init__(self, stream: BinaryIO):
        import xxhash  # the pod's dependency only: a reader of markers never hashes

        self._stream, self._hash, self.size = stream, xxhash.xxh64(seed=0), 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._hash.update(data)
        self.size += len(data)
        return data

    def readinto(self, buffer) -> int:
        count = readinto(self._stream, buffer)
        if count:
            self._hash.update(memoryview(buffer)[:count])
            self.size += count
        return count

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def identity(self) -> dict[str, Any]:
        """What the marker records as ``input``: size, checksum type and value."""
        return {"size": self.size, "cksum_type": INPUT_CHECKSUM, "cksum": self._hash.hexdigest()}


class ShardCheck:
    """Follows one shard's members as they are read and verifies its end marker.

    ``member()`` is called for every tar member in order and answers whether it is the marker (which
    the caller drops); ``finish()`` is called once the end-of-archive blocks were read, and raises
    ``IncompleteShard`` unless the marker came last and matches what came before it. A reader that
    failed before ``finish()`` (a cut inside a member, a garbage header) reports ``incomplete()``.
    """

    __slots__ = ("shard", "members", "samples", "marker")

    def __init__(self, shard: str):
        self.shard = shard
        self.members = 0  # tar members before the marker
        self.samples = 0  # samples received, counted by the caller
        self.marker: dict | None = None

    def sample(self, sample: Sample) -> bool:
        """Count a sample's members; true if it is the end marker (which the caller drops)."""
        if sample.key != END_MARKER_KEY and self.marker is None:
            self.members += len(sample.members)
            return False
        return any([self.member(member) for member in sample.members])

    def member(self, member: Member) -> bool:
        info = member.info
        if self.marker is not None:
            raise self.incomplete(f"member '{info.name}' after the end marker")
        if info.name != END_MARKER_NAME:
            self.members += 1
            return False
        try:
            marker = json.loads(member.data)
        except ValueError:
            marker = None
        if not isinstance(marker, dict) or marker.get("format") != END_MARKER_FORMAT:
            raise self.incomplete(f"'{END_MARKER_NAME}' is not a valid end marker")
        if marker.get("members") != self.members or marker.get("bytes") != info.offset:
            raise self.incomplete(
                f"the end marker counts {marker.get('members')} members in {marker.get('bytes')} bytes, "
                f"the shard has {self.members} members in {info.offset} bytes")
        self.marker = marker
        return True

    def finish(self) -> dict:
        """The marker's contents, once the whole shard was read; ``IncompleteShard`` otherwise."""
        if self.marker is None:
            raise self.incomplete(f"no end marker ('{END_MARKER_NAME}') after its last member")
        return self.marker

    def incomplete(self, reason: str) -> IncompleteShard:
        return IncompleteShard(self.shard, reason, self.samples)


# What ends every shard the pod writes: the marker's header block, its JSON (well under one block: seven
# short fields) and the two end-of-archive blocks. A stored copy is proven whole from these bytes alone.
TAIL_BYTES = 4 * BLOCK
_MARKER_SPAN = 8 * BLOCK  # how far before the end-of-archive blocks the marker's header is looked for
_MAX_ZEROS = 1 << 20  # tar padding after the end-of-archive blocks (a record is 10 KiB by default)


def marker_from_tail(read: Callable[[int, int], bytes], size: int, shard: str) -> dict:
    """The end marker of a stored shard of ``size`` bytes, read from its last bytes only.

    ``read(offset, length)`` returns that range of the object (a range GET): ``TAIL_BYTES`` for a
    shard as the pod writes it, more where a tar writer padded the archive with further zero blocks.
    The marker must be the last member and count, as its ``bytes``, exactly the bytes before it; so a
    shard cut anywhere (no marker at its end) or holding something else fails. Its ``members`` count
    needs the whole shard and is left to the reader (``ShardCheck``). Raises ``ShardError`` naming
    the reason.
    """
    if size <= 0:
        raise ShardError(shard, "empty object, no end marker")
    if size % BLOCK:
        raise ShardError(shard, f"{size} bytes are not whole {BLOCK}-byte tar blocks: cut short, no end marker")
    length = min(size, TAIL_BYTES)
    while True:
        start = size - length
        tail = read(start, length)
        if len(tail) != length:
            raise ShardError(shard, f"a read of its last {length} bytes returned {len(tail)}")
        end = length
        while end >= BLOCK and tail.count(0, end - BLOCK, end) == BLOCK:
            end -= BLOCK
        zeros = length - end
        if start == 0 or zeros > _MAX_ZEROS:
            break
        if end == 0:  # padding after the end-of-archive blocks: read further back
            length = min(size, 8 * length)
            continue
        last = _last_header(tail, end)
        if last is not None or end >= _MARKER_SPAN:
            break
        length = min(size, zeros + _MARKER_SPAN)
    if end == 0:
        raise ShardError(shard, f"its last {length} bytes are all zeros, no end marker")
    if zeros < 2 * BLOCK:
        raise ShardError(shard, "no end-of-archive blocks at its end: cut short")
    last = _last_header(tail, end)
    if last is None:
        raise ShardError(shard, f"no end marker ('{END_MARKER_NAME}') before its end-of-archive blocks: cut short")
    header, info = last
    if info.name != END_MARKER_NAME:
        raise ShardError(shard, f"its last member is '{info.name}', not the end marker '{END_MARKER_NAME}'")
    try:
        marker = json.loads(tail[header + BLOCK:header + BLOCK + info.size])
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != END_MARKER_FORMAT:
        raise ShardError(shard, f"'{END_MARKER_NAME}' is not a valid end marker")
    if marker.get("bytes") != start + header:
        raise ShardError(shard, f"the end marker counts {marker.get('bytes')} bytes before it, the object "
                                f"holds {start + header}")
    return marker


def _last_header(tail: bytes, end: int) -> tuple[int, tarfile.TarInfo] | None:
    """The header (offset, parsed) whose member's blocks end at ``end``, looked for in the marker's reach."""
    for header in range(end - BLOCK, max(-1, end - _MARKER_SPAN - 1), -BLOCK):
        try:
            info = tarfile.TarInfo.frombuf(tail[header:header + BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            continue
        if header + BLOCK + -(-info.size // BLOCK) * BLOCK == end:
            return header, info
    return None
