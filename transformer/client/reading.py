"""Reading ETL'd shards whole: open, read, check the end marker, and retry a cut shard where it stopped.

Every shard the service writes ends with ``__etl__/end.json`` (``transformer.integrity``). A read
that ends without it was cut: by the pod failing after its first byte (AIS relays that as a cleanly
ended ``200``), by a dropped connection, or by a proxy in between. Python's ``tarfile`` and
webdataset's ``tar_file_expander`` read some of those cuts as a shorter, valid shard; the reader here
uses the service's own strict tar reader (``transformer.shards.read_samples``) and the marker, so a
cut shard is always an error, never a shorter epoch.

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
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import webdataset as wds
from webdataset.filters import pipelinefilter

from ..errors import ShardError
from ..integrity import IncompleteShard, ShardCheck
from ..shards import read_samples
from .errors import ShardFetchError

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

    def close(self) -> None:
        self._response.close()

    def __repr__(self) -> str:  # webdataset puts the stream into error messages
        return f"<shard stream {self._response.url}>"


def shard_samples(stream: BinaryIO, url: str, *, require_marker: bool = True) -> Iterator[dict[str, Any]]:
    """The shard's samples as webdataset dicts (``__key__``, ``__url__``, one ``bytes`` per extension).

    Grouped and filtered as webdataset's ``tarfile_to_samples`` does (consecutive members sharing a
    key, lower-case extensions, non-files and ``__*__`` members skipped), but read strictly: a cut or
    a garbage header raises ``IncompleteShard`` (``samples``: how many were yielded), and so does a
    missing or wrong end marker unless ``require_marker`` is off (shards not written by this ETL).
    """
    check = ShardCheck(url)
    try:
        for sample in read_samples(stream, url, _MAX_MEMBER_BYTES):
            if check.sample(sample):
                continue
            fields: dict[str, Any] = {"__key__": sample.key, "__url__": url}
            for member, extension in zip(sample.members, sample.extensions):
                if extension is None or not member.info.isreg() or _META.match(member.info.name):
                    continue
                extension = extension.lower()
                if extension in fields:
                    raise ValueError(f"{url}: sample '{sample.key}' has two '{extension}' members")
                fields[extension] = member.data
            if len(fields) > 2:
                check.samples += 1
                yield fields
    except IncompleteShard:
        raise
    except ShardError as exc:
        raise check.incomplete(exc.reason) from None
    except (OSError, EOFError) as exc:
        raise check.incomplete(f"the read failed: {exc}") from None
    except Exception as exc:
        if type(exc) is ValueError:  # a duplicate extension: the shard's own content, not a cut
            raise
        # requests and urllib3 raise their own types for a body cut short (chunked framing, timeouts).
        raise check.incomplete(f"the read failed: {exc.__class__.__name__}: {exc}") from None
    if require_marker:
        check.finish()


def whole_shard_samples(
    url: str,
    *,
    opener: Callable[[str], BinaryIO] = open_shard,
    retries: int = 2,
    require_marker: bool = True,
) -> Iterator[dict[str, Any]]:
    """One shard's samples, each exactly once: a cut read is fetched again (up to ``retries`` times) and
    continued after the samples already yielded, which the new read must repeat key for key.

    Raises ``IncompleteShard`` (with the number of samples delivered) once the retries are spent, and
    ``ShardFetchError`` when the shard cannot be fetched at all.
    """
    delivered: list[str] = []
    for attempt in range(retries + 1):
        stream = opener(url)
        try:
            position = 0
            for sample in shard_samples(stream, url, require_marker=require_marker):
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
