"""Streaming tar in -> samples; members -> streaming tar out. No HTTP and no torch here.

Reading uses the standard library's ``tarfile`` in stream mode (``r|*``: never seeks, handles bz2 and
xz), so the input can be a request body, a local file or an upstream HTTP stream. gzip goes through
``gzip.GzipFile`` instead, which checks the CRC at the end (tarfile's stream mode never does, so a
flipped bit in a stored block would pass silently). Samples are grouped by
webdataset's own key rule (``base_plus_ext``: the key ends at the first dot of the basename), imported
rather than re-implemented so our grouping can never disagree with the readers'. The grouping loop
itself is ours because webdataset's ``group_by_keys`` drops the tar headers (mode, mtime, owner) and
raises on the first duplicate instead of letting the error policy decide.
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from webdataset.tariterators import base_plus_ext

from .errors import Cancelled, ShardError
from .samples import Member, Sample

BLOCK = tarfile.BLOCKSIZE
# What a damaged or hostile stream can raise from tarfile and the decompressors (tarfile's own gzip
# reader raised TypeError on a 3-byte gzip header, found by bench/fuzz_tar.py).
_TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, TypeError, ValueError)
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


def read_samples(stream: BinaryIO, shard: str, max_member_bytes: int) -> Iterator[Sample]:
    """Yield the shard's samples in order; ``ShardError`` if the stream is not a complete tar."""
    gzipped = None
    try:
        head = stream.read(2)
        stream = _Prefixed(head, stream)
        if head == b"\x1f\x8b":
            stream = gzipped = gzip.GzipFile(fileobj=stream, mode="rb")
        archive = tarfile.open(fileobj=stream, mode="r|*", errorlevel=2, tarinfo=_StrictTarInfo)
    except Cancelled:
        raise
    except _TAR_ERRORS as exc:
        raise ShardError(shard, f"not a tar archive ({_reason(exc)})") from None
    current: Sample | None = None
    try:
        for info in _members(archive, shard):
            if info.isfile():
                if info.size > max_member_bytes:
                    raise ShardError(
                        shard,
                        f"member '{info.name}' is {info.size} bytes, over the limit of {max_member_bytes} "
                        "(ETL_MAX_MEMBER_BYTES)",
                    )
                try:
                    data = archive.extractfile(info).read()
                except Cancelled:
                    raise
                except _TAR_ERRORS as exc:
                    raise ShardError(shard, f"truncated inside member '{info.name}' ({_reason(exc)})") from None
                if len(data) != info.size:
                    raise ShardError(shard, f"truncated inside member '{info.name}'")
                key, extension = base_plus_ext(info.name)
                if key is None:  # no dot in the basename: a member of its own, passed through
                    key, extension = info.name, None
            else:  # directories, links: passed through as their own group
                key, extension, data = info.name, None, b""
            member = Member(info=info, pieces=[data] if data else [])
            # A member without an extension is a group of its own: nothing joins it (it has no sample key).
            if current is not None and key == current.key and extension is not None \
                    and current.extensions[0] is not None:
                current.members.append(member)
                current.extensions.append(extension)
                continue
            if current is not None:
                yield current
            current = Sample(key=key, members=[member], extensions=[extension])
        if gzipped is not None:
            _check_gzip_end(gzipped, shard)
    finally:
        archive.close()
    if current is not None:
        yield current


def _check_gzip_end(gzipped: gzip.GzipFile, shard: str) -> None:
    """Read past the end-of-archive marker to the gzip trailer, where the CRC is verified."""
    try:
        while gzipped.read(1 << 16):
            pass
    except Cancelled:
        raise
    except _TAR_ERRORS as exc:
        raise ShardError(shard, f"corrupt gzip stream ({_reason(exc)})") from None


class _Prefixed:
    """A read-only stream: ``head`` (bytes already read to sniff the format), then the rest."""

    def __init__(self, head: bytes, stream: BinaryIO):
        self._head, self._stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size is None or size < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:size], self._head[size:]
        return data if len(data) == size else data + self._stream.read(size - len(data))


def _members(archive: tarfile.TarFile, shard: str) -> Iterator[tarfile.TarInfo]:
    while True:
        try:
            info = archive.next()
        except Cancelled:
            raise
        except _TAR_ERRORS as exc:
            raise ShardError(shard, f"corrupt or truncated tar ({_reason(exc)})") from None
        if info is None:
            return
        # Stream mode never looks back, but TarFile keeps every header it read (about 1.3 KB each):
        # without this, memory grows with the member count (250 MB for a 200k-member shard).
        archive.members.clear()
        yield info


class _StrictTarInfo(tarfile.TarInfo):
    """Refuses what ``tarfile`` silently takes for the end of the archive.

    After the first member, ``TarFile.next`` treats a cut-off header, a missing end-of-archive
    marker and a garbage header block as a normal end, which would turn a truncated or corrupt
    shard (or the first chunk of a chunked AIS object) into a shorter, valid-looking output.
    Only a zero block (the end-of-archive marker) ends the archive here.
    """

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tarfile_)
        except (tarfile.TruncatedHeaderError, tarfile.EmptyHeaderError, tarfile.InvalidHeaderError) as exc:
            if tarfile_.offset == 0:
                raise  # TarFile reports these as "not a tar archive" already
            reason = "no end-of-archive marker" if isinstance(exc, tarfile.EmptyHeaderError) else str(exc)
            raise tarfile.ReadError(f"{reason} at offset {tarfile_.offset}") from None


def _reason(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return text if len(text) < 200 else text[:200] + "..."


def member_bytes(member: Member) -> Iterable[bytes | memoryview]:
    """A member as tar blocks: header, payload pieces, zero padding to the block size."""
    info = member.info
    yield info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
    yield from member.pieces
    remainder = info.size % BLOCK
    if remainder:
        yield b"\0" * (BLOCK - remainder)


def json_member(name: str, payload: bytes, mtime: float) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), int(mtime), 0o644
    return Member(info=info, pieces=[payload])
