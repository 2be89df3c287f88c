"""Reading ETL'd shards whole: open, read, check the end marker, and retry a cut shard where it stopped.

Every shard the service writes ends with ``__etl__/end.json`` (``transformer.integrity``). A read
that ends without it was cut: by the pod failing after its first byte (AIS relays that as a cleanly
ended ``200``), by a dropped connection, or by a proxy in between. Python's ``tarfile`` and
webdataset's ``tar_file_expander`` read some of those cuts as a shorter, valid shard; the reader here
reads headers with the service's own strict tar code (``transformer.shards``: only a zero block ends
the archive, checksums, sizes, compressed shards) and checks the marker, so a cut shard is always an
error, never a shorter epoch.

The loader reads each ``.npy`` member straight into its place (``shard_samples(arrays=True,
place=...)``): the ``.npy`` header is parsed once per distinct header and the array bytes are read
from the stream into a row of the batch tensor, one copy, instead of bytes, then ``np.load``, then a
stack (``python -m bench.reader`` measures both against a minimal one-copy reader).

A cut shard is fetched again and read past the samples already delivered (checked key by key), so
each sample reaches the training step once. With ``seed`` in ``etl_args`` the service's output is the
same on every read, so the samples after the cut are exactly what the first read would have given;
without a seed they are fresh augmentation draws of the same samples, as any unseeded read is.

``tarfile_to_whole_samples`` is the same thing as a webdataset pipeline stage, for pipelines built
by hand: ``wds.DataPipeline(wds.SimpleShardList(urls), tarfile_to_whole_samples(), wds.decode(), ...)``.
"""

from __future__ import annotations

import functools
import logging
import re
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np
import webdataset as wds
from webdataset.filters import pipelinefilter
from webdataset.tariterators import base_plus_ext

from ..errors import IncompleteShard, ShardError
from ..integrity import ShardCheck
from ..shards import Chunks, Member, TarHeaders, decompressed, header_from
from ..wire import BLOCK, END_MARKER_NAME, plain_member
from .errors import DuplicateMember, ShardFetchError, SharedMemoryError

log = logging.getLogger("transformer.client")

_ERROR_BODY_LIMIT = 2000  # the service's error bodies are short; never read a huge one into a message
_MAX_MEMBER_BYTES = 1 << 40  # the reader's buffers grow with the bytes that arrive, not with a header's claim
# The members webdataset's ``tar_file_iterator`` skips by default (``skip_meta``), and its meta files.
_META = re.compile(r"__[^/]*__($|/)")


def open_shard(url: str, timeout: tuple[float, float] = (10.0, 300.0), retries: int = 2) -> BinaryIO:
    """A readable stream of one shard. HTTP(S) through ``requests``; anything else through ``wds.gopen``.

    Not webdataset's curl opener: ``curl -f`` drops the service's error body (which names shard,
    sample and reason) and ``--retry 30`` re-runs a whole shard transform up to 30 times.
    Connection failures and 502/503/504 are retried ``retries`` times; other statuses fail at once.
    """
    if not url.startswith(("http://", "https://")):
        return wds.gopen(url, "rb")
    import requests

    for attempt in range(retries + 1):
        try:
            response = requests.get(url, stream=True, timeout=timeout, headers={"Accept-Encoding": "identity"})
        except requests.ConnectionError as exc:
            if attempt == retries:
                raise ShardFetchError(url, f"connection failed: {exc}") from exc
            time.sleep(0.5 * (attempt + 1))
            continue
        if response.status_code < 400:
            response.raw.decode_content = True
            return _ResponseStream(response)
        body = response.raw.read(_ERROR_BODY_LIMIT, decode_content=True).decode("utf-8", "replace").strip()
        response.close()
        if response.status_code in (502, 503, 504) and attempt < retries:
            time.sleep(0.5 * (attempt + 1))
            continue
        raise ShardFetchError(url, body or response.reason or "no reason given", response.status_code)
    raise AssertionError("unreachable")


class _ResponseStream:
    """A file-like view of a streamed response body; closing it returns the connection."""

    def __init__(self, response):
        self._response = response

    def read(self, size: int = -1) -> bytes:
        return self._response.raw.read(None if size is None or size < 0 else size)

    def readinto(self, buffer) -> int:
        return self._response.raw.readinto(buffer)

    def close(self) -> None:
        self._response.close()

    def __repr__(self) -> str:  # webdataset puts the stream into error messages
        return f"<shard stream {self._response.url}>"


# Where an ``.npy`` member's array goes: ``(sample fields, extension, shape, dtype)`` -> a C-contiguous
# array of that shape and dtype to read it into (a row of a batch tensor), or None for an array of its own.
Place = Callable[[dict, str, tuple, np.dtype], "np.ndarray | None"]


class MalformedMember:
    """An ``.npy`` member whose bytes do not match its header: an error for whoever picks it, naming why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def shard_samples(stream: BinaryIO, url: str, *, require_marker: bool = True, arrays: bool = False,
                  place: Place | None = None) -> Iterator[dict[str, Any]]:
    """The shard's samples as webdataset dicts (``__key__``, ``__url__``, one value per extension).

    Grouped and filtered as webdataset's ``tarfile_to_samples`` does (consecutive members sharing a
    key, lower-case extensions, non-files and ``__*__`` members skipped), but read strictly: a cut or
    a garbage header raises ``IncompleteShard`` (``samples``: how many were yielded), and so does a
    missing or wrong end marker unless ``require_marker`` is off (shards not written by this ETL).

    Values are ``bytes``; with ``arrays``, ``.npy`` members are numpy arrays instead, read from the
    stream in one copy (the ``.npy`` header parsed by numpy, once per distinct header), into what
    ``place`` gives or an array of their own. A member whose size does not match its header becomes
    a ``MalformedMember``. A sample is yielded once the next one's first header arrived (or the
    archive's end), before that member's bytes are read: ``place`` can hand out a batch row at a time.
    """
    check = ShardCheck(url)
    fields: dict[str, Any] | None = None
    group_key: str | None = None  # the key of the members being grouped (None: a member of its own)
    try:
        try:
            stream, _ = decompressed(stream)
        except (tarfile.TarError, EOFError, OSError, ValueError, TypeError) as exc:
            raise ShardError(url, f"not a tar archive ({exc})") from None
        chunks = Chunks(stream)
        headers = TarHeaders(chunks, _MAX_MEMBER_BYTES)
        while True:
            block = chunks.read(BLOCK)
            plain = plain_member(block) if not headers.pax_headers else None
            if plain is not None:  # a plain regular file's header, the kind the ETL writes: no TarInfo
                info, regular = None, True
                name, size = plain
            else:  # anything else, by tarfile
                info = header_from(headers, url, block, chunks.tell() - len(block))
                if info is None:
                    break  # the end-of-archive marker
                if info.sparse is not None:
                    raise ShardError(url, f"member '{info.name}' is a sparse file, which is not supported")
                name, regular = info.name, info.isreg()
                size = info.size if regular or info.type not in tarfile.SUPPORTED_TYPES else 0
            key, extension = split_key(name) if regular else _NO_KEY  # tarfile's isfile() is isreg()
            if extension is None or key != group_key:  # the sample before this member is complete
                if fields is not None and len(fields) > 2:
                    check.samples += 1
                    yield fields
                fields = {"__key__": key, "__url__": url} if extension is not None else None
                group_key = key if extension is not None else None
            if size > _MAX_MEMBER_BYTES:
                raise ShardError(url, f"member '{name}' is {size} bytes, over the limit of {_MAX_MEMBER_BYTES}")
            if check.marker is not None or name == END_MARKER_NAME:
                if info is None:
                    info = tarfile.TarInfo(name)
                    info.offset = chunks.tell() - BLOCK  # nothing was read since its header
                check.member(Member(info=info, pieces=[_payload(chunks, size, name, url)]))
                continue
            check.members += 1
            if fields is None or not regular or (name[:2] == "__" and _META.match(name)):
                _payload(chunks, size, name, url)
                continue
            extension = extension.lower()
            if extension in fields:
                raise DuplicateMember(url, key, extension)
            if arrays and (extension == "npy" or extension.endswith(".npy")):
                fields[extension] = _array(chunks, size, name, url, fields, extension, place)
                continue
            data = _payload(chunks, size, name, url)
            fields[extension] = data if type(data) is bytes else bytes(data)
    except (IncompleteShard, DuplicateMember, SharedMemoryError):  # the last: no room for a batch, not a bad shard
        raise
    except ShardError as exc:
        raise check.incomplete(exc.reason) from None
    except (OSError, EOFError) as exc:
        raise check.incomplete(f"the read failed: {exc}") from None
    except Exception as exc:
        # requests and urllib3 raise their own types for a body cut short (chunked framing, timeouts).
        raise check.incomplete(f"the read failed: {exc.__class__.__name__}: {exc}") from None
    if fields is not None and len(fields) > 2:
        check.samples += 1
        yield fields
    if require_marker:
        check.finish()


_NO_KEY = (None, None)


def split_key(name: str) -> tuple[str, str] | tuple[None, None]:
    """webdataset's ``base_plus_ext``: the key (up to the first dot of the last path element) and the
    extensions, (None, None) for a name without. String operations for the names every shard has (three
    per sample); its regular expression decides the rest (a dot first in the last element, a newline)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot > slash and "\n" not in name:
        return name[:dot], name[dot + 1:]
    return base_plus_ext(name)


def _payload(chunks: Chunks, size: int, name: str, url: str) -> bytes | bytearray:
    data = chunks.read_padded(size) if size else b""
    if len(data) != size:
        raise ShardError(url, f"truncated inside member '{name}'")
    return data


def _read_exactly(chunks: Chunks, size: int, name: str, url: str) -> bytes | bytearray:
    data = chunks.read(size) if size else b""
    if len(data) != size:
        raise ShardError(url, f"truncated inside member '{name}'")
    return data


# ``.npy`` headers seen so far -> (shape, dtype, Fortran order, array bytes) or the reason it is refused.
# An ETL's shards repeat one or two headers; numpy's own parser (``ast.literal_eval``) runs once per header.
_NPY_HEADERS: dict[bytes, tuple | str] = {}
_NPY_PREFIX = 10  # magic (6), version (2), header length (2 in version 1.0)


def _npy_header(head: bytes) -> tuple | str:
    """Parse a whole ``.npy`` header with numpy: (shape, dtype, fortran, array bytes), or why it is not one."""
    import io

    from numpy.lib import format as npy

    try:
        stream = io.BytesIO(head)
        version = npy.read_magic(stream)
        if version != (1, 0):
            return "not a version 1.0 .npy header"  # read as bytes: np.load decides
        shape, fortran, dtype = npy.read_array_header_1_0(stream)
    except ValueError as exc:
        return f"not a .npy header ({exc})"
    if dtype.hasobject:
        return "an object array"  # read as bytes: np.load refuses pickles
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    return shape, dtype, fortran, nbytes


def _array(chunks: Chunks, size: int, name: str, url: str, fields: dict, extension: str,
           place: Place | None) -> Any:
    """An ``.npy`` member read into an array in one copy; bytes when numpy's own ``np.load`` must decide
    (other versions, object arrays); a ``MalformedMember`` when its size is not what its header says."""
    if size < _NPY_PREFIX:
        return bytes(_payload(chunks, size, name, url))
    head = chunks.read(_NPY_PREFIX)
    length = _NPY_PREFIX + int.from_bytes(head[8:10], "little") if head[6:8] == b"\x01\x00" else size
    if length > size:
        length = size
    head += chunks.read(length - _NPY_PREFIX)
    if len(head) != length:
        raise ShardError(url, f"truncated inside member '{name}'")
    if type(head) is not bytes:
        head = bytes(head)
    rest = size - length
    parsed = _NPY_HEADERS.get(head)
    if parsed is None:
        parsed = _npy_header(head)
        if len(_NPY_HEADERS) < 1024:
            _NPY_HEADERS[head] = parsed
    if type(parsed) is str:
        data = head + bytes(_read_exactly(chunks, rest, name, url))  # np.load reads it, or says why not
        chunks.skip(-size % BLOCK)
        return data
    shape, dtype, fortran, nbytes = parsed
    if nbytes != rest:
        _read_exactly(chunks, rest, name, url)
        chunks.skip(-size % BLOCK)
        return MalformedMember(f"'{extension}' holds {rest} bytes of array data, its .npy header "
                               f"{tuple(shape)} {dtype} says {nbytes}")
    target = place(fields, extension, shape, dtype) if place is not None and not fortran else None
    if target is None:
        target = np.empty(shape, dtype, order="F" if fortran else "C")
    if nbytes:
        try:
            view = memoryview(target).cast("B")  # C order and a plain numeric type: the common case
        except (TypeError, ValueError):
            view = memoryview(target.reshape(-1, order="A").view(np.uint8))
        if chunks.read_into(view) != nbytes:
            raise ShardError(url, f"truncated inside member '{name}'")
    chunks.skip(-size % BLOCK)
    return target


def whole_shard_samples(
    url: str,
    *,
    opener: Callable[[str], BinaryIO] = open_shard,
    retries: int = 2,
    require_marker: bool = True,
    arrays: bool = False,
    place: Place | None = None,
) -> Iterator[dict[str, Any]]:
    """One shard's samples, each exactly once: a cut read is fetched again (up to ``retries`` times) and
    continued after the samples already yielded, which the new read must repeat key for key.
    ``arrays`` and ``place`` are ``shard_samples``'s.

    Raises ``IncompleteShard`` (with the number of samples delivered) once the retries are spent, and
    ``ShardFetchError`` when the shard cannot be fetched at all.
    """
    delivered: list[str] = []
    for attempt in range(retries + 1):
        stream = opener(url)
        try:
            position = 0
            for sample in shard_samples(stream, url, require_marker=require_marker, arrays=arrays, place=place):
                key = sample["__key__"]
                if position < len(delivered):
                    if key != delivered[position]:
                        raise IncompleteShard(url, f"read again after a cut, sample {position} is '{key}', "
                                              f"not '{delivered[position]}'", len(delivered), retryable=False)
                else:
                    delivered.append(key)
                    yield sample
                position += 1
            if position < len(delivered):
                raise IncompleteShard(url, f"read again after a cut, it has {position} samples, not "
                                      f"{len(delivered)} or more", len(delivered), retryable=False)
            return
        except IncompleteShard as exc:
            if not exc.retryable or attempt == retries:
                tries = f"; read {attempt + 1} times" if attempt else ""
                raise IncompleteShard(url, exc.detail + tries, len(delivered), retryable=False) from None
            log.warning("%s; reading it again from sample %d", exc.message, len(delivered))
        finally:
            stream.close()


def _tarfile_to_whole_samples(data: Iterable[dict[str, Any]], handler: Callable[[BaseException], bool] =
                              wds.reraise_exception, retries: int = 2, require_marker: bool = True,
                              timeout: tuple[float, float] = (10.0, 300.0)) -> Iterator[dict[str, Any]]:
    """``whole_shard_samples`` for each ``{"url": ...}``; errors go to the webdataset ``handler``
    (true: go on with the next shard; false: stop)."""
    opener = functools.partial(open_shard, timeout=timeout)
    for source in data:
        try:
            yield from whole_shard_samples(source["url"], opener=opener, retries=retries,
                                           require_marker=require_marker)
        except Exception as exc:
            if not handler(exc):
                break


tarfile_to_whole_samples = pipelinefilter(_tarfile_to_whole_samples)
tarfile_to_whole_samples.__doc__ = """A webdataset stage: ``{"url": ...}`` dicts in, whole shards' samples out.

Use it in place of ``wds.tarfile_to_samples()``: ``tarfile_to_whole_samples(handler=..., retries=2,
require_marker=True, timeout=(10, 300))``. A cut shard is read again and continued; one still cut
after ``retries`` is an ``IncompleteShard`` for ``handler`` (default: raise), naming the URL and how
many samples arrived.
"""
