"""The names and formats the pod and the training client agree on, defined once for both sides.

Standard library only: the client imports it without the server's dependencies, and the server
without the client's. What lives here:

* ``ETL_ARG_FIELDS``: the fields of ``etl_args`` the service accepts (``transformer.options`` parses
  them, ``transformer.client.urls`` checks them before any request), and the values of its choices:
  ``DTYPES``, ``LAYOUTS``, ``ERROR_POLICIES``; the ``COMM_TYPES`` an ETL serves.
* AIS object names: ``GLOBAL_NAMESPACE`` of a uname, the ``%ob`` folder of an FQN, ``path_escape``
  (Go's ``url.PathEscape``, which AIS applies to both in its pod URLs).
* The end marker's member name, key and format, and the input checksum it records
  (``transformer.integrity`` writes and checks it; the client reads it from a shard's tail).
* The tar block: its size, the end-of-archive blocks, and the plain ustar header of a regular file
  (the kind every shard writer emits) read in one step (``plain_file`` for the pod's reader in
  ``transformer.shards``, ``plain_member`` for the client's in ``transformer.client.reading``) and
  written in one (``ustar_header``). Every other header is left to ``tarfile``.
"""

from __future__ import annotations

import re
import struct
import tarfile
import zlib
from urllib.parse import quote

# The etl_args fields the service accepts; anything else is refused on both sides.
ETL_ARG_FIELDS = ("preset", "transforms", "dtype", "layout", "seed", "epoch", "on_error", "skip", "crop_decode",
                  "dct_scaling")
DTYPES = ("float32", "float16", "uint8")  # an image array's dtype (uint8: not normalized)
LAYOUTS = ("CHW", "HWC")  # an image array's axes
ERROR_POLICIES = ("skip", "fail", "passthrough")  # what a sample whose own content fails gets
COMM_TYPES = ("hpush", "hpull", "ws")  # how AIS hands the pod an object (its spec's communication, without ://)

GLOBAL_NAMESPACE = "@#"  # AIS uname of a bucket in the global namespace: <provider>/@#/<bucket>/<object>
OBJECT_FOLDER = "%ob"  # an FQN's folder of objects: <mountpath>/@<provider>/[<ns>/]<bucket>/%ob/<object>

END_MARKER_NAME = "__etl__/end.json"
END_MARKER_KEY = "__etl__/end"  # its webdataset key (the name up to the basename's first dot)
END_MARKER_FORMAT = "ais-wds-etl-end/1"
# The input digest: XXH64 with seed 0, as hex of its big-endian value. AIS 5.0 computes the same for a
# bucket of checksum type "xxhash2" (github.com/cespare/xxhash/v2; its default for new buckets).
INPUT_CHECKSUM = "xxhash2"


def path_escape(text: str) -> str:
    """Go's ``url.PathEscape``, which AIS uses for the one-segment uname in its object URLs: one path
    segment, ``/ ; , ?`` escaped, ``$ & + : = @`` kept.

    Hand-written (one line) because no Python library exposes Go's exact segment rule.
    """
    return quote(text, safe="$&+:=@")


BLOCK = tarfile.BLOCKSIZE
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)

# The fields of a POSIX ustar header block, in order (the last 12 bytes are padding).
_USTAR = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s")
_USTAR_MAGIC = tarfile.POSIX_MAGIC  # b"ustar\x0000"
# mode, uid, gid, size, mtime, checksum and the type of a regular file (bytes 100-156), as octal
# numbers the way Python's tarfile, Go's archive/tar and libarchive write them: digits (or leading
# spaces) and a NUL or space terminator. Anything else is left to tarfile.
_PLAIN_NUMBERS = re.compile(
    rb"([ 0-7]{7})[\0 ]([ 0-7]{7})[\0 ]([ 0-7]{7})[\0 ]([ 0-7]{11})[\0 ]([ 0-7]{11})[\0 ]([ 0-7]{6})[\0 ][\0 ]0"
)
_PLAIN_DEVICES = re.compile(rb"([ 0-7]{7})[\0 ]([ 0-7]{7})[\0 ]")
_NO_DEVICES = (b"0000000\0" * 2, b"\0" * 16)  # what tarfile and Go write for a regular file, or nothing
_OCTAL = (8,) * 6


def plain_file(block: bytes, offset: int) -> tarfile.TarInfo | None:
    """A POSIX ustar header of a regular file, the kind every shard writer emits, read in one step.

    ``TarInfo.fromtarfile`` runs a dozen Python calls per header, a large share of the driver thread's
    CPU per sample; this is one regular expression for the numbers, and the checksum as two Adler-32
    sums (each half block's byte sum is exact below Adler's modulus). Anything else (GNU or pax
    headers, base-256 numbers, other member types, a bad or signed checksum) returns None and goes to
    tarfile, and tests/test_shards.py checks this against ``TarInfo.frombuf`` field by field.
    """
    fields = _plain_fields(block)
    if fields is None:
        return None
    mode, uid, gid, size, mtime, checksum, major, minor = fields
    info = tarfile.TarInfo(_plain_name(block[:100], block[345:500]))
    info.mode, info.uid, info.gid, info.size, info.mtime, info.chksum = mode, uid, gid, size, mtime, checksum
    info.type, info.linkname = tarfile.REGTYPE, _text(block, 157, 257)
    info.uname, info.gname = _text(block, 265, 297), _text(block, 297, 329)
    info.devmajor, info.devminor = major, minor
    info.offset, info.offset_data = offset, offset + BLOCK
    return info


def _plain_fields(block: bytes) -> tuple[int, ...] | None:
    """mode, uid, gid, size, mtime, checksum, devmajor, devminor of a plain ustar regular file's header
    whose checksum is right; None for anything else."""
    numbers = _PLAIN_NUMBERS.match(block, 100)
    if numbers is None or len(block) != BLOCK or block[257:265] != _USTAR_MAGIC:
        return None
    try:
        mode, uid, gid, size, mtime, checksum = map(int, numbers.groups(), _OCTAL)
        if block[329:345] in _NO_DEVICES:
            major = minor = 0
        else:
            devices = _PLAIN_DEVICES.match(block, 329)
            if devices is None:
                return None
            major, minor = map(int, devices.groups(), _OCTAL)
    except ValueError:  # a field of spaces only: tarfile decides
        return None
    if not _checksum_matches(block, checksum):
        return None  # tarfile also accepts the signed sum some old writers used, or refuses
    return mode, uid, gid, size, mtime, checksum, major, minor


def _checksum_matches(block: bytes, checksum: int) -> bool:
    """The header's byte sum with its checksum field read as spaces, as two Adler-32 sums (each half
    block's byte sum is exact below Adler's modulus)."""
    byte_sum = (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2
    return checksum == byte_sum - sum(block[148:156]) + 256


# The whole header block of a plain ustar regular file: name, the numbers as ``_PLAIN_NUMBERS`` reads
# them, the magic, no device numbers, the name prefix (groups: name, the six numbers, prefix).
_PLAIN_MEMBER = re.compile(
    rb"(?s)(.{100})" + _PLAIN_NUMBERS.pattern + rb".{100}" + re.escape(_USTAR_MAGIC) + rb".{64}(?:"
    + b"|".join(re.escape(devices) for devices in _NO_DEVICES) + rb")(.{155}).{12}"
)


def plain_member(block: bytes) -> tuple[str, int] | None:
    """The name and size of a header ``plain_file`` reads, when only those are wanted (the training
    client, three headers per sample): the same checks in one regular expression and the checksum,
    the other numbers left unparsed (the pattern already holds them to octal digits, which tarfile
    reads); None otherwise."""
    match = _PLAIN_MEMBER.fullmatch(block)
    if match is None:
        return None
    name, size, checksum, prefix = match.group(1, 5, 7, 8)
    try:
        size, checksum = int(size, 8), int(checksum, 8)
    except ValueError:  # a field of spaces only: tarfile decides
        return None
    if not _checksum_matches(block, checksum):
        return None
    return _plain_name(name, prefix), size


def _plain_name(name: bytes, prefix: bytes) -> str:
    """A ustar member's name from its name and prefix fields (NUL-terminated, decoded as ``_text``)."""
    name = name.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    return prefix.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + name if prefix[0] else name


def _text(block: bytes, start: int, end: int) -> str:
    """A NUL-terminated header field, decoded as tarfile does for this service (utf-8, surrogateescape)."""
    if not block[start]:
        return ""
    stop = block.find(b"\0", start, end)
    return block[start:end if stop < 0 else stop].decode("utf-8", "surrogateescape")


_USTAR_BLOCK = struct.Struct(_USTAR.format + "12x")


def ustar_header(info: tarfile.TarInfo) -> bytes | None:
    """The header ``info.tobuf(PAX_FORMAT)`` writes for a plain regular file, in one step.

    ``tobuf`` runs a dozen Python calls (pax checks, ``stn``/``itn`` per field, checksum), the
    largest part of the shard driver's CPU per written ``.npy`` member; this is one ``struct.pack``.
    It answers only where tarfile writes a single ustar block (ASCII names that fit, integer fields in
    octal range, no pax headers); anything else returns None and goes to ``tobuf``.
    tests/test_shards.py checks the two byte for byte.
    """
    if info.type != tarfile.REGTYPE or info.pax_headers or info.linkname:
        return None
    name, uname, gname = info.name, info.uname, info.gname
    numbers = (info.uid, info.gid, info.size, info.mtime, info.mode)
    if (len(name) > 100 or len(uname) > 32 or len(gname) > 32 or not (name + uname + gname).isascii()
            or any(type(n) is not int for n in numbers)  # noqa: E721 (bool and float go to tarfile)
            or not (0 <= info.uid < 8**7 and 0 <= info.gid < 8**7 and 0 <= info.size < 8**11
                    and 0 <= info.mtime < 8**11)):
        return None
    block = _USTAR_BLOCK.pack(
        name.encode(), b"%07o\0" % (info.mode & 0o7777), b"%07o\0" % info.uid, b"%07o\0" % info.gid,
        b"%011o\0" % info.size, b"%011o\0" % info.mtime, b"        ", tarfile.REGTYPE, b"", _USTAR_MAGIC,
        uname.encode(), gname.encode(), b"", b"", b"",
    )
    return block[:148] + b"%06o\0" % sum(block) + block[155:]
