"""ETL downloads: shards fetched from HTTP(S) links, transformed by the ETL's pods, stored in a bucket.

AIS's downloader with an ``etl_name`` does not fetch the link itself: each target asks its pod,
``POST /download?original_url=<link>&object_to=<name>[&etl_args=...]``, and stores the pod's answer
as the object (``ext/dload``, ``ext/etl/communicator.go``). So the stored object is what an inline
read of the same shard gives, ``etl_args`` included (unlike an offline bucket transform, which
carries none). Only ``hpush://`` ETLs serve downloads: AIS answers hpull and ws with 501 for every
object, so ``download`` refuses those before starting a job.

An object fails whole: a link that does not answer 200, a shard the pod refuses, or a sample failing
under ``on_error=fail`` after the first byte (AIS stores nothing when the pod's answer is cut). Each
failure is in ``DownloadJob.object_errors`` with AIS's message.

The aistore SDK has no download API; the requests go through the SDK's own request client, so
authentication, TLS and error mapping stay the SDK's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .registration import _comm, _registered_message, ais_errors, validate_name
from .urls import encode_etl_args

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

_UNSET_TIMES = ("0001-01-01", "1970-01-01")  # how AIS spells "not finished" (Go's zero time, or Unix 0)


@dataclass
class DownloadJob:
    """An ETL download job: its id, and once waited for, how it ended and the objects that failed."""

    etl_name: str
    job_id: str
    bucket: str
    finished: bool = False
    aborted: bool = False
    stored: int = 0  # objects downloaded, transformed and stored
    object_errors: list[tuple[str, str]] = field(default_factory=list)  # (object name, AIS's message)

    @property
    def success(self) -> bool:
        """Finished, not aborted, and every object stored."""
        return self.finished and not self.aborted and not self.object_errors


def download(
    client: Client,
    etl_name: str,
    bucket: str,
    links: str | Sequence[str] | Mapping[str, str],
    *,
    etl_args: Mapping[str, Any] | str | None = None,
    timeout: float = 3600,
    wait: bool = True,
    poll: float = 0.5,
) -> DownloadJob:
    """Download ``links`` into ais bucket ``bucket`` (created if missing) through the ETL ``etl_name``.

    ``links``: one URL; a brace template such as ``https://host/train-{0000..0099}.tar``; a list of
    URLs (each object is named after the last segment of its URL's path); or a mapping object name ->
    URL. ``etl_args`` reach the pod as they do for an inline read. ``timeout`` bounds the wait, in
    seconds (``TimeoutError`` names the job, which goes on); ``wait=False`` returns after starting.
    """
    from aistore.sdk.const import HTTP_METHOD_GET, HTTP_METHOD_POST

    name = validate_name(etl_name)
    body: dict[str, Any] = {"bucket": {"name": bucket, "provider": "ais"}, "etl_name": name}
    encoded = encode_etl_args(etl_args)
    if encoded:
        body["etl_args"] = encoded
    body.update(_links(links))
    etl = client.etl(name)
    requests = etl._client  # the SDK's request client (see the module's docstring)
    with ais_errors(name, "download"):
        registered = _registered_message(etl)
        if registered is None:
            raise ValueError(f"download: ETL '{name}' is not registered")
        comm = _comm(registered.get("communication"))
        if comm != "hpush://":
            raise ValueError(f"download: ETL '{name}' communicates over {comm}; AIS serves downloads through "
                             "hpush:// ETLs only")
        job_id = requests.request(HTTP_METHOD_POST, path="download", json=body).json()["id"]
    log.info("download %s: %s -> ais://%s with ETL %s", job_id, _describe(links), bucket, name)
    job = DownloadJob(name, job_id, bucket)
    if not wait:
        return job
    deadline = time.monotonic() + timeout
    while True:
        with ais_errors(name, "download status"):
            status = requests.request(HTTP_METHOD_GET, path="download", json={"id": job_id}).json()
        aborted = bool(status.get("aborted"))
        if aborted or not str(status.get("finished_time") or "").startswith(_UNSET_TIMES):
            errors = [(entry["name"], entry["error"]) for entry in status.get("download_errors") or []]
            return DownloadJob(name, job_id, bucket, finished=True, aborted=aborted,
                               stored=int(status.get("finished_cnt") or 0), object_errors=errors)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"download {job_id} (ETL '{name}' -> ais://{bucket}) not finished after {timeout:g} s; "
                               "it goes on in the cluster")
        time.sleep(poll)


def _links(links: str | Sequence[str] | Mapping[str, str]) -> dict[str, Any]:
    """The part of AIS's download request that says what to fetch: single, range (template) or multi."""
    if isinstance(links, str):
        _check_url(links)
        if "{" in links:
            return {"type": "range", "template": links, "subdir": ""}
        return {"type": "single", "link": links, "object_name": _basename(links)}
    if isinstance(links, Mapping):
        objects = {str(key): str(value) for key, value in links.items()}
        for url in objects.values():
            _check_url(url)
        if not objects:
            raise ValueError("download: no links")
        return {"type": "multi", "objects": objects}
    urls = [str(url) for url in links]
    if not urls:
        raise ValueError("download: no links")
    for url in urls:
        _check_url(url)
        _basename(url)
    return {"type": "multi", "objects": urls}


def _check_url(url: str) -> None:
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"download: {url!r} is not an http(s) URL")


def _basename(url: str) -> str:
    name = urlsplit(url).path.rsplit("/", 1)[-1]
    if not name:
        raise ValueError(f"download: {url!r} names no object (its path ends with '/'); give a mapping name -> URL")
    return name


def _describe(links: str | Sequence[str] | Mapping[str, str]) -> str:
    return links if isinstance(links, str) else f"{len(links)} links"

