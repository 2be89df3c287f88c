"""Streaming tar in -> samples; members -> streaming tar out. No HTTP and no torch here.

Headers are parsed by the standard library's ``tarfile`` (``TarInfo.fromtarfile``: ustar, GNU long
names, pax, base-256 numbers, checksums), a plain ustar one in one step (``transformer.wire``); the
blocks around them are read here, sequentially and in large chunks, so the input can be a request
body, a local file or an upstream HTTP stream and the reading costs a few Python calls per member
instead of tarfile stream mode's dozens (see ``Chunks``). Compressed shards (gzip, bzip2, xz) go
through the decompressors' file objects, read to their end so a checksum mismatch is an error
(tarfile's stream mode never checks gzip's CRC, so a flipped bit in a stored block would pass
silently). A member that is passed through keeps its raw header blocks, so it is written back byte
for byte.

Samples are grouped by webdataset's own key rule (``base_plus_ext``: the key ends at the first dot of
the basename), imported rather than re-implemented so our grouping can never disagree with the
readers'. The grouping loop itself is ours because webdataset's ``group_by_keys`` drops the tar
headers (mode, mtime, owner) and raises on the first duplicate instead of letting the error policy
decide.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from webdataset.tariterators import base_plus_ext

from .errors import Cancelled, ShardError
from .wire import BLOCK, plain_file, ustar_header


@dataclass
class Member:
    """One tar member: its header and its payload (pieces, written back to back)."""

    info: tarfile.TarInfo
    pieces: list[bytes | memoryview] = field(default_factory=list)
    header: bytes | None = None  # the raw header blocks read from the input, written back unchanged

    @property
    def data(self) -> bytes:
        return b"".join(self.pieces) if len(self.pieces) != 1 else bytes(self.pieces[0])


@dataclass
class Sample:
    """The members of one WebDataset key, in shard order."""

    key: str
    members: list[Member]
    extensions: list[str | None]  # extension after the key's first dot, None for non-files


# What a damaged or hostile stream can raise from tarfile and the decompressors (tarfile's own gzip
# reader raised TypeError on a 3-byte gzip header, found by bench/fuzz_tar.py).
_TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError, TypeError, ValueError)


def read_samples(stream: BinaryIO, shard: str, max_member_bytes: int) -> Iterator[Sample]:
    """Yield the shard's samples in order; ``ShardError`` if the stream is not a complete tar."""
    try:
        stream, compressed = decompressed(stream)
    except Cancelled:
        raise
    except _TAR_ERRORS as exc:
        raise ShardError(shard, f"not a tar archive ({_reason(exc)})") from None
    chunks = Chunks(stream)
    headers = TarHeaders(chunks, max_member_bytes)
    current: Sample | None = None
    for info, raw in _members(headers, shard):
        if info.sparse is not None:
            raise ShardError(shard, f"member '{info.name}' is a sparse file, which is not supported")
        data = b""
        if info.isreg() or info.type not in tarfile.SUPPORTED_TYPES:  # what tarfile reads as payload
            if info.size > max_member_bytes:
                raise ShardError(
                    shard,
                    f"member '{info.name}' is {info.size} bytes, over the limit of {max_member_bytes} "
                    "(ETL_MAX_MEMBER_BYTES)",
                )
            try:
                data = chunks.read_padded(info.size)
            except Cancelled:
                raise
            except _TAR_ERRORS as exc:
                raise ShardError(shard, f"truncated inside member '{info.name}' ({_reason(exc)})") from None
            if len(data) != info.size:
                raise ShardError(shard, f"truncated inside member '{info.name}'")
        extension = None
        if info.isfile():
            key, extension = base_plus_ext(info.name)
        if extension is None:  # no dot in the basename, or not a file: a member of its own, passed through
            key = info.name
        member = Member(info=info, pieces=[data] if data else [], header=raw)
        # A member without an extension is a group of its own: nothing joins it (it has no sample key).
        if current is not None and key == current.key and extension is not None \
                and current.extensions[0] is not None:
            current.members.append(member)
            current.extensions.append(extension)
            continue
        if current is not None:
            yield current
        current = Sample(key=key, members=[member], extensions=[extension])
    if compressed:
        _check_compressed_end(chunks, shard)
    if current is not None:
        yield current


def decompressed(stream: BinaryIO) -> tuple[BinaryIO, bool]:
    """The tar stream inside ``stream``, and whether it was compressed (gzip, bzip2, xz: by magic bytes)."""
    head = b""
    while len(head) < 6:  # a streamed body may hand out fewer bytes than asked for
        more = stream.read(6 - len(head))
        if not more:
            break
        head += more
    stream = _Prefixed(head, stream)
    for magic, opener in _COMPRESSED:
        if head.startswith(magic):
            return opener(stream), True
    return stream, False


# The decompressors' file objects check what tarfile's stream mode never does: gzip's CRC and length,
# the end-of-stream markers of bzip2 and xz (read to the end by ``_check_compressed_end``).
_COMPRESSED = (
    (b"\x1f\x8b", lambda s: gzip.GzipFile(fileobj=s, mode="rb")),
    (b"BZh", lambda s: bz2.BZ2File(s, mode="rb")),
    (b"\xfd7zXZ\x00", lambda s: lzma.LZMAFile(s, mode="rb")),
)


def _check_compressed_end(chunks: Chunks, shard: str) -> None:
    """Read past the end-of-archive marker to the compressed stream's end, where its checksum is verified."""
    try:
        chunks.drain()
    except Cancelled:
        raise
    except _TAR_ERRORS as exc:
        raise ShardError(shard, f"corrupt compressed stream ({_reason(exc)})") from None


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
        return data

    def readinto(self, buffer) -> int:
        if not self._head:
            return readinto(self._stream, buffer)
        count = min(len(buffer), len(self._head))
        buffer[:count], self._head = self._head[:count], self._head[count:]
        return count


def readinto(stream: BinaryIO, buffer) -> int:
    """``stream.readinto(buffer)``; through ``read`` and a copy for a stream without ``readinto``.

    The readers that wrap a stream (byte counting, progress, the sniffed head) pass ``readinto``
    through, so a large member is copied once, from the file's or the body's buffer into its own.
    """
    method = getattr(stream, "readinto", None)
    if method is not None:
        return method(buffer) or 0
    data = stream.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)


class Chunks:
    """Sequential reads from a stream fetched in chunks.

    tarfile's stream mode reads 10 KB at a time through three Python layers and copies each member
    twice on the way out; this slices headers and small members out of one chunk, and reads a large
    member (an image) with ``readinto`` straight into its own ``bytearray``: one copy, and a writable
    buffer the decoder takes as is (``bench.run``'s engine row measures it; tests/test_shards.py checks
    the result against tarfile on the same archives).
    """

    __slots__ = ("_stream", "_readinto", "_chunk", "_pos", "_base", "recorded")
    SIZE = 1 << 14  # 16 KB per read: headers and small members; below glibc's mmap threshold
    GROW = 1 << 20  # a large member's buffer grows as its bytes arrive, never ahead of them by more

    def __init__(self, stream: BinaryIO):
        head = b""
        if type(stream) is _Prefixed:  # the sniffed head is the first chunk; then the stream itself
            head, stream = stream._head, stream._stream
        self._stream, self._chunk, self._pos, self._base = stream, head, 0, 0
        self._readinto = getattr(stream, "readinto", None)
        self.recorded: list[bytes] | None = None  # header blocks, kept while a header is parsed

    def tell(self) -> int:
        return self._base + self._pos

    def read(self, size: int) -> bytes | bytearray:
        """``size`` bytes, or fewer at the end of the stream (a ``bytearray`` when read into one)."""
        chunk, pos = self._chunk, self._pos
        if pos + size <= len(chunk):
            self._pos = pos + size
            data = chunk[pos:pos + size]
        elif size > self.SIZE and self._readinto is not None and self.recorded is None:
            return self._read_into(size)
        else:
            parts = [chunk[pos:]] if pos < len(chunk) else []
            missing = size - (len(chunk) - pos)
            while missing > 0:
                self._base += len(self._chunk)
                self._chunk, self._pos = self._stream.read(max(missing, self.SIZE)) or b"", 0
                if not self._chunk:
                    break
                take = min(missing, len(self._chunk))
                parts.append(self._chunk if take == len(self._chunk) else self._chunk[:take])
                self._pos, missing = take, missing - take
            data = b"".join(parts)
        if self.recorded is not None:
            self.recorded.append(data)
        return data

    def _read_into(self, size: int) -> bytearray:
        chunk, pos = self._chunk, self._pos
        filled = len(chunk) - pos
        # Not bytearray(size) at once: a header alone could then make the pod allocate (and zero) up
        # to ETL_MAX_MEMBER_BYTES for bytes that never come. Images fit the first allocation.
        buffer = bytearray(min(size, max(self.GROW, filled)))
        buffer[:filled] = memoryview(chunk)[pos:]
        while filled < size:
            if filled == len(buffer):
                buffer.extend(bytes(min(size, 2 * filled) - filled))
            with memoryview(buffer) as view, view[filled:] as free:
                count = self._readinto(free)
            if not count:
                break
            filled += count
        self._base += pos + filled
        self._chunk, self._pos = b"", 0
        if filled < len(buffer):
            del buffer[filled:]  # the stream ended: the caller sees the short read
        return buffer

    def read_into(self, view: memoryview) -> int:
        """Fill ``view`` (a writable byte view): the rest of the current chunk, then straight from the
        stream with ``readinto`` (one copy: the training client reads arrays into batch tensors so).
        Returns the bytes filled, fewer only at the end of the stream."""
        chunk, pos, size = self._chunk, self._pos, len(view)
        have = min(size, len(chunk) - pos)
        if have:
            view[:have] = memoryview(chunk)[pos:pos + have]
            self._pos = pos + have
        filled = have
        if filled < size:
            self._base += len(chunk)
            self._chunk, self._pos = b"", 0
            fill = self._readinto
            while filled < size:
                count = fill(view[filled:]) if fill is not None else readinto(self._stream, view[filled:])
                if not count:
                    break
                filled += count
            self._base += filled - have
        return filled

    def read_padded(self, size: int) -> bytes | bytearray:
        """A member's ``size`` bytes; its zero padding to the block size is skipped (a cut there shows
        at the next header)."""
        end = self._pos + size + (-size % BLOCK)
        if end <= len(self._chunk):
            data, self._pos = self._chunk[self._pos:self._pos + size], end
            return data
        data = self.read(size)
        self.skip(-size % BLOCK)
        return data

    def skip(self, size: int) -> None:
        if size:
            self.read(size)

    def drain(self) -> None:
        while self._stream.read(self.SIZE):
            pass


class TarHeaders:
    """What ``TarInfo.fromtarfile`` reads a header through: tarfile parses, this only feeds it blocks.

    Parsing stays tarfile's (ustar, GNU long names, pax, base-256 numbers, checksums); the pax or GNU
    extension blocks a header is made of are size-checked before they are read.
    """

    encoding, errors = "utf-8", "surrogateescape"

    def __init__(self, chunks: Chunks, max_member_bytes: int):
        self.chunks = chunks
        self.fileobj = self
        self.pax_headers: dict[str, str] = {}  # global pax headers ('g' members), applied by tarfile
        self.offset = 0
        self.pending: bytes | None = None  # a header block read ahead by the fast path, for tarfile
        self._max = max_member_bytes

    def tell(self) -> int:
        return self.chunks.tell()

    def read(self, size: int) -> bytes:
        if self.pending is not None:
            block, self.pending = self.pending, None
            return block  # fromtarfile's first read is exactly this one block
        if size > self._max:
            raise tarfile.InvalidHeaderError(f"extended header of {size} bytes, over ETL_MAX_MEMBER_BYTES")
        return self.chunks.read(size)


def _members(headers: TarHeaders, shard: str) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """Each member's header, and its raw header blocks when they can be written back unchanged.

    Only a zero block (the end-of-archive marker) ends the archive. tarfile's ``TarFile.next`` also
    takes a cut-off header, a missing marker and a garbage header block after the first member for
    a normal end, which would turn a truncated or corrupt shard (or the first chunk of a chunked AIS
    object) into a shorter, valid-looking output.
    """
    chunks = headers.chunks
    while True:
        offset = chunks.tell()
        try:
            block = chunks.read(BLOCK)
        except Cancelled:
            raise
        except _TAR_ERRORS as exc:
            raise _header_error(shard, exc, offset) from None
        info = plain_file(block, offset) if not headers.pax_headers else None
        raw = [block]
        if info is None:
            info = header_from(headers, shard, block, offset, raw)
            if info is None:
                return  # a zero block: the end-of-archive marker
        # Global pax headers change how later headers read: those members are written afresh.
        yield info, ((block if len(raw) == 1 else b"".join(raw)) if not headers.pax_headers else None)


def header_from(headers: TarHeaders, shard: str, block: bytes, offset: int, raw: list | None = None
                ) -> tarfile.TarInfo | None:
    """The header starting with ``block`` (read at ``offset``), parsed by tarfile, which reads any
    extension blocks after it (appended to ``raw``); None for a zero block, the end of the archive."""
    chunks = headers.chunks
    try:
        chunks.recorded = raw if raw is not None else []  # the blocks tarfile reads after this one
        headers.pending = block
        return tarfile.TarInfo.fromtarfile(headers)
    except Cancelled:
        raise
    except tarfile.EOFHeaderError:
        return None
    except _TAR_ERRORS as exc:
        raise _header_error(shard, exc, offset) from None
    finally:
        chunks.recorded = None


def _header_error(shard: str, exc: BaseException, offset: int) -> ShardError:
    reason = _reason(exc)
    if isinstance(exc, tarfile.EmptyHeaderError):  # nothing more to read where a header belongs
        reason = "empty file" if offset == 0 else "no end-of-archive marker"
    if offset == 0:
        return ShardError(shard, f"not a tar archive ({reason})")
    return ShardError(shard, f"corrupt or truncated tar ({reason} at offset {offset})")


def _reason(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return text if len(text) < 200 else text[:200] + "..."


def member_header(member: Member) -> bytes:
    """A member's header blocks: a passed-through member's own, byte for byte, or made from its ``info``."""
    if member.header is not None:
        return member.header
    return ustar_header(member.info) or member.info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8",
                                                          errors="surrogateescape")


def member_bytes(member: Member) -> Iterable[bytes | memoryview]:
    """A member as tar blocks: header, payload pieces, zero padding to the block size."""
    info = member.info
    yield member_header(member)
    for piece in member.pieces:  # a member read into its own buffer goes out as a view (bytes-like, fixed)
        yield memoryview(piece) if type(piece) is bytearray else piece
    remainder = info.size % BLOCK
    if remainder:
        yield b"\0" * (BLOCK - remainder)


def json_member(name: str, payload: bytes, mtime: float) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), int(mtime), 0o644
    return Member(info=info, pieces=[payload])
