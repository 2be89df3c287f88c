"""Where a shard's bytes come from: an ``etl_fqn`` file, an HTTP fetch, bytes, or the request body (``body.py``).

Every source opens as a file object read by the shard's driver thread; ``replayable`` sources can be
read again (a retried direct put), the request body cannot.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Iterator
from typing import BinaryIO

import httpx

from ..config import Settings
from ..errors import RequestError, UpstreamError
from ..redact import redact
from ..shards import readinto
from .hops import https_hint, no_secret

log = logging.getLogger("transformer.server")


class Source:
    """Where a shard's bytes come from. ``replayable`` sources can be read again for a retry."""

    replayable = True
    kind = "body"

    def open(self) -> contextlib.AbstractContextManager[BinaryIO]:
        raise NotImplementedError


class FileSource(Source):
    """A local file named by ``etl_fqn`` (already confined and decoded by ``fqn.resolve``)."""

    kind = "fqn"

    def __init__(self, path: str):
        self.path = path

    def open(self):
        return open(self.path, "rb", buffering=1024 * 1024)


class HttpSource(Source):
    """An object fetched over HTTP: hpull from ``AIS_TARGET_URL``, or a ``/download`` origin."""

    kind = "fetch"

    def __init__(self, client: httpx.Client, url: str, deadline: float):
        self.client, self.url, self.deadline = client, url, deadline

    @contextlib.contextmanager
    def open(self):
        remaining = max(0.1, self.deadline - time.monotonic())
        try:
            timeout = httpx.Timeout(remaining, connect=min(5.0, remaining))
            with self.client.stream("GET", self.url, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    status = 404 if r.status_code == 404 else 502
                    raise UpstreamError(f"GET {no_secret(self.url)}: {r.status_code} {redact(r.text)[:300]}", status)
                yield IteratorReader(r.iter_raw())
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"GET {no_secret(self.url)}: timed out ({exc.__class__.__name__})", 504) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"GET {no_secret(self.url)}: {exc.__class__.__name__}: {exc}"
                                f"{https_hint(self.url, exc)}", 502) from None


class ObjectFileSource(FileSource):
    """An ``etl_fqn`` file checked against the target's size of the object first (chunked objects).

    For a chunked AIS object only the first chunk lives at the FQN (core/ufest.go), so reading
    the file alone would transform a truncated shard. A ``HEAD`` of the object on the target
    (``AIS_TARGET_URL/<escaped uname>``, answered from metadata) gives its full size; when it differs
    from the file's, the object is fetched over HTTP instead. When the target cannot tell (HEAD
    failed), the file is read: the strict tar reader still refuses a shard cut short (422). With
    worker processes the worker leading the shard makes the check (``checked_file``).
    """

    def __init__(self, path: str, client: httpx.Client, object_url: str, deadline: float):
        super().__init__(path)
        self.client, self.object_url, self.deadline = client, object_url, deadline

    @contextlib.contextmanager
    def open(self):
        with open(self.path, "rb", buffering=1024 * 1024) as stream, \
                checked_file(stream, self.path, self.client, self.object_url, self.deadline) as checked:
            yield checked


@contextlib.contextmanager
def checked_file(stream: BinaryIO, path: str, client: httpx.Client, object_url: str, deadline: float):
    """``stream`` (an FQN's open file), or the object fetched from ``object_url`` when the target's size of it
    differs (``ObjectFileSource``)."""
    local = os.fstat(stream.fileno()).st_size
    size = _target_size(client, object_url, deadline, path)
    if size is None or size == local:
        yield stream
        return
    log.warning("etl_fqn %s has %d of the object's %d bytes (a chunked object); fetching %s over HTTP",
                path, local, size, no_secret(object_url))
    with HttpSource(client, object_url, deadline).open() as fetched:
        yield fetched


def _target_size(client: httpx.Client, object_url: str, deadline: float, path: str) -> int | None:
    remaining = max(0.1, deadline - time.monotonic())
    try:
        response = client.head(object_url, timeout=httpx.Timeout(min(5.0, remaining)))
    except httpx.HTTPError as exc:
        log.warning("etl_fqn %s: HEAD %s failed (%s); reading the file as is",
                    path, no_secret(object_url), exc.__class__.__name__)
        return None
    length = response.headers.get("content-length", "")
    if response.status_code != 200 or not length.isdigit():
        log.warning("etl_fqn %s: HEAD %s answered %d without a size; reading the file as is",
                    path, no_secret(object_url), response.status_code)
        return None
    return int(length)


class BytesSource(Source):
    """Bytes already in memory (a WebSocket content frame)."""

    def __init__(self, data: bytes):
        self.data = data

    def open(self):
        return io.BytesIO(self.data)


class IteratorReader:
    """A read-only file object over an iterator of byte chunks (what ``tarfile`` stream mode needs)."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = iter(chunks)
        self._buffer = memoryview(b"")
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            parts = [bytes(self._buffer)] + list(self._chunks)
            self._buffer = memoryview(b"")
            data = b"".join(parts)
            self.bytes_read += len(data)
            return data
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._buffer = memoryview(chunk)
        data = bytes(self._buffer[:size])
        self._buffer = self._buffer[size:]
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer) -> int:
        """Up to ``len(buffer)`` bytes from the current chunk (the next one when it is used up)."""
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._buffer = memoryview(chunk)
        count = min(len(buffer), len(self._buffer))
        buffer[:count] = self._buffer[:count]
        self._buffer = self._buffer[count:]
        self.bytes_read += count
        return count

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Counting:
    """Counts bytes read through any file object (bytes-in metric) and enforces ETL_MAX_SHARD_BYTES."""

    def __init__(self, stream: BinaryIO, shard: str, limit: int):
        self._stream, self.count = stream, 0
        self.shard, self.limit = shard, limit

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._counted(len(data))
        return data

    def readinto(self, buffer) -> int:
        return self._counted(readinto(self._stream, buffer))

    def _counted(self, count: int) -> int:
        self.count += count
        if self.count > self.limit:
            raise shard_too_large(self.shard, self.count, self.limit)
        return count


def shard_too_large(shard: str, size: int, limit: int) -> RequestError:
    return RequestError(f"shard '{shard}': {size} bytes or more, over the limit of {limit} (ETL_MAX_SHARD_BYTES)",
                        status=413)


def fqn_source(raw: str, settings: Settings, client: httpx.Client, deadline: float, *, shard: str,
               object_name: str, uname: str | None = None) -> FileSource:
    """The input named by ``etl_fqn``: decoded, confined, size-limited, and chunk-checked when possible.

    The chunk check asks the target (``AIS_TARGET_URL``) with ``client``; ``uname`` is the object's uname
    when the request carries it exactly (hpull), otherwise it is derived from the FQN and ``object_name``.
    """
    from ..wire import path_escape
    from .fqn import object_uname, resolve_fqn

    path = resolve_fqn(raw, settings.fqn_roots)
    size = os.path.getsize(path)
    if size > settings.max_shard_bytes:
        raise shard_too_large(shard, size, settings.max_shard_bytes)
    if not settings.ais_target_url:
        return FileSource(path)
    uname = uname or object_uname(path, object_name)
    return ObjectFileSource(path, client, f"{settings.ais_target_url}/{path_escape(uname)}", deadline)


def target_client(settings: Settings) -> httpx.Client:
    """The client for AIS targets (hpull fetch, size check, direct put): the server's and each worker's."""
    # TLS to AIS targets (hpull fetch, size check, direct put): AIS_CLIENT_CA, AIS_SKIP_VERIFY_CRT and the
    # client certificate AIS_CRT + AIS_CRT_KEY (mutual TLS), checked when the settings were read.
    verify = settings.ais_tls()
    # Idle connections expire before the target's own 6 s idle timeout would close them under us.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=4.0)
    return httpx.Client(verify=verify, limits=limits, follow_redirects=False, timeout=settings.obj_timeout)


def origin_client(settings: Settings) -> httpx.Client:
    """The client for ``/download`` origins."""
    # /download origins are any host (a web server, a cloud bucket's URL): verified against the default
    # bundle plus AIS_CLIENT_CA, never skip-verify, never the AIS client certificate, redirects followed.
    return httpx.Client(verify=settings.origin_tls(), follow_redirects=True, timeout=settings.obj_timeout)
