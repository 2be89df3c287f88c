"""Bucket listings taken page by page, each entry's size, checksum and version, and whether AIS flagged a page.

A target that lists its objects while a rebalance runs (or after one was interrupted) leaves out the
objects not yet on the target that will own them, and says so by setting the page's ``Flags``
(AIS's ``ais/tgtbck.go``; the misplaced objects are skipped in ``xact/xs/wi_lso.go``). The proxy
ORs the targets' flags into the page it returns. Such a listing may miss objects that exist: it can
be used to find what to transform (a missing copy is made again), never to decide what to delete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aistore.sdk import Client

PROPS = "name,size,checksum"  # what the incremental check needs of every object


@dataclass(frozen=True, slots=True)
class Entry:
    """One listed object: its size, and the checksum and version AIS keeps for it ('' when not asked or none)."""

    size: int
    checksum: str = ""
    version: str = ""


@dataclass(frozen=True)
class Listing:
    """The objects under ``prefix`` in ais://``bucket``, name -> ``Entry``, as one listing found them.

    ``rebalancing``: some page was flagged as taken during (or after an interrupted) rebalance, so objects
    that exist may be missing from it. ``exists`` is false where the bucket does not exist (no entries).
    """

    bucket: str
    prefix: str
    entries: dict[str, Entry] = field(default_factory=dict)
    pages: int = 0
    rebalancing: bool = False
    exists: bool = True

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)


def list_bucket(client: Client, bucket: str, prefix: str = "", props: str = PROPS) -> Listing:
    """List ais://``bucket`` under ``prefix``, every page, with ``props``; a missing bucket lists empty."""
    from aistore.sdk.errors import ErrBckNotFound

    handle = client.bucket(bucket)
    entries: dict[str, Entry] = {}
    uuid = token = ""
    pages, flagged = 0, False
    try:
        while True:
            # paged by hand: the SDK's list_objects_iter gives the entries only, and drops each page's flags
            page = handle.list_objects(prefix=prefix, props=props, uuid=uuid, continuation_token=token)
            pages += 1
            flagged = flagged or bool(page.flags)
            for entry in page.entries:
                entries[entry.name] = Entry(entry.size, entry.checksum or "", entry.version or "")
            uuid, token = page.uuid, page.continuation_token
            if not token:
                break
    except ErrBckNotFound:
        return Listing(bucket, prefix, exists=False)
    return Listing(bucket, prefix, entries, pages, flagged)
