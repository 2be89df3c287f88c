"""The copy ledger: what the end markers of a destination's copies say, kept in one small object beside them.

A listing gives each copy's size and AIS's checksum of its bytes, but not what the copy was made
from: that is in its end marker, inside those bytes. The ledger remembers, for every copy whose
marker the client has read (the incremental check's tail reads, the proof after a job), the copy's
identity as a listing gives it (size and checksum) and what its marker records: the input's size and
checksum, the settings digest and the version. A later check finds each listed copy's identity in the
ledger and knows its marker without reading it. A copy rewritten since (by anyone) has other bytes,
so another checksum: it is not found, and its tail is read. The ledger is a cache keyed by content:
stale, lost or from another check, it can cost reads, never give a wrong class.

It also keeps what the ETL wrote the last time it was asked (the probe), with the ETL's identity: its
name, its current run (the xaction id AIS gives each start: pods that restart abort the ETL, and a
start gets a new id) and a digest of its registration. While that identity holds, the same pods
run, and the check asks them nothing.

One ledger per sync scope (source bucket, prefix, ext), stored as ``__etl__/sync/<digest>.ledger`` in
the destination: a header line of JSON, then 18 bytes a copy (two 8-byte digests, a 2-byte style
number). 10,000 copies take 176 KiB. Digests are 64-bit BLAKE2b: two different copies (or inputs)
sharing one is a 1-in-2^64 event per pair.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

LEDGER_PREFIX = "__etl__/sync/"
_MAGIC = b"wds-transform copy ledger 1\n"
_RECORD = struct.Struct("<QQH")  # copy identity, input identity, style number


def digest(*parts: object) -> int:
    """A 64-bit digest of ``parts`` (joined with NUL): the ledger's keys."""
    return int.from_bytes(hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def copy_key(size: int, checksum: str) -> int:
    """A copy's identity as a listing gives it."""
    return digest("copy", size, checksum)


def input_key(size: int, checksum_type: str, checksum: str) -> int:
    """An input's identity, as an end marker records it and as a source listing gives it (``xxhash2``)."""
    return digest("input", size, checksum_type, checksum)


@dataclass(frozen=True, slots=True)
class Known:
    """A copy's end marker as the ledger remembers it."""

    input: int  # input_key of the marker's ``input``
    settings: str
    version: str


@dataclass
class Ledger:
    """One sync scope's ledger: copy identity -> ``Known``, and the ETL's last probe (``etl``: id, settings,
    version)."""

    name: str
    records: dict[int, tuple[int, int]] = field(default_factory=dict)  # copy key -> (input key, style number)
    styles: list[tuple[str, str]] = field(default_factory=list)  # (settings digest, version)
    etl: dict[str, str] | None = None
    loaded: bytes = field(default=b"", repr=False)  # the stored bytes it was read from

    def known(self, size: int, checksum: str) -> Known | None:
        """What the marker of the copy with this size and checksum records, if a check read it."""
        if not checksum:
            return None
        record = self.records.get(copy_key(size, checksum))
        if record is None or record[1] >= len(self.styles):
            return None
        settings, version = self.styles[record[1]]
        return Known(record[0], settings, version)

    def probe(self, etl_id: str) -> tuple[str, str] | None:
        """The settings digest and version the ETL writes, if it was probed with this identity."""
        if self.etl and self.etl.get("id") == etl_id:
            return self.etl["settings"], self.etl["version"]
        return None

    def encode(self) -> bytes:
        header = json.dumps({"styles": self.styles, "etl": self.etl, "records": len(self.records)},
                            separators=(",", ":")).encode()
        body = b"".join(_RECORD.pack(key, *self.records[key]) for key in sorted(self.records))
        return _MAGIC + header + b"\n" + body


class LedgerBuilder:
    """The ledger a check leaves: a record for each copy it knows the marker of, and the ETL's probe."""

    def __init__(self, name: str, etl: dict[str, str] | None):
        self.ledger = Ledger(name, etl=etl)
        self._styles: dict[tuple[str, str], int] = {}

    def add(self, size: int, checksum: str, marker: Mapping[str, Any]) -> bool:
        """Record the copy of this size and checksum with ``marker``; false where it cannot be recorded."""
        recorded = marker.get("input")
        settings, version = marker.get("settings"), marker.get("version")
        if not checksum or not isinstance(recorded, dict) or not isinstance(settings, str) \
                or not isinstance(version, str):
            return False
        key = input_key(recorded.get("size"), recorded.get("cksum_type"), recorded.get("cksum"))
        return self.add_known(size, checksum, Known(key, settings, version))

    def add_known(self, size: int, checksum: str, known: Known) -> bool:
        style = self._styles.setdefault((known.settings, known.version), len(self._styles))
        if style > 0xFFFF:
            return False
        self.ledger.records[copy_key(size, checksum)] = (known.input, style)
        return True

    def build(self) -> Ledger:
        self.ledger.styles = [style for style, _ in sorted(self._styles.items(), key=lambda item: item[1])]
        return self.ledger


def ledger_name(source: str, prefix: str, ext: Mapping[str, str] | None) -> str:
    """The ledger's object name for one sync scope."""
    scope = json.dumps([source, prefix, sorted((ext or {}).items())])
    return f"{LEDGER_PREFIX}{digest('scope', scope):016x}.ledger"


def decode(name: str, data: bytes) -> Ledger:
    """A stored ledger; ``ValueError`` naming what is wrong with it."""
    if not data.startswith(_MAGIC):
        raise ValueError("not a copy ledger (its first line)")
    header, newline, body = data[len(_MAGIC):].partition(b"\n")
    if not newline:
        raise ValueError("no header line")
    meta = json.loads(header)
    styles = [tuple(style) for style in meta.get("styles") or []]
    if not all(len(style) == 2 and all(isinstance(part, str) for part in style) for style in styles):
        raise ValueError("malformed styles")
    etl = meta.get("etl")
    if etl is not None and not (isinstance(etl, dict) and {"id", "settings", "version"} <= set(etl)):
        raise ValueError("malformed ETL probe")
    count = meta.get("records")
    if not isinstance(count, int) or len(body) != count * _RECORD.size:
        raise ValueError(f"{len(body)} bytes of records, the header says {count} records")
    records = {key: (value, style) for key, value, style in _RECORD.iter_unpack(body)}
    return Ledger(name, records, styles, etl, data)


def load_ledger(client: Client, bucket: str, name: str) -> Ledger:
    """The ledger ``name`` of ais://``bucket``; an empty one where there is none or it cannot be read."""
    from aistore.sdk.errors import ErrBckNotFound, ErrObjNotFound

    try:
        data = client.bucket(bucket).object(name).get_reader().read_all()
    except (ErrObjNotFound, ErrBckNotFound):
        return Ledger(name)
    try:
        return decode(name, data)
    except ValueError as exc:
        log.warning("ais://%s/%s: the copy ledger cannot be read (%s); every copy's tail is read instead", bucket,
                    name, exc)
        return Ledger(name)


def save_ledger(client: Client, bucket: str, ledger: Ledger) -> bool:
    """Store ``ledger`` in ais://``bucket`` unless it holds what is stored already; whether it was written."""
    data = ledger.encode()
    if data == ledger.loaded:
        return False
    client.bucket(bucket).object(ledger.name).get_writer().put_content(data)
    ledger.loaded = data
    return True


