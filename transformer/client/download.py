"""ETL downloads: shards fetched from HTTP(S) links, transformed by the ETL's pods, stored in a bucket.

AIS's downloader with an ``etl_name`` does not fetch the link itself: each target asks its pod,
``POST /download?original_url=<link>&object_to=<name>[&etl_args=...]``, and stores the pod's answer
as the object (``ext/dload``, ``ext/etl/communicator.go``). So the stored object is what an inline
read of the same shard gives, ``etl_args`` included (unlike an offline bucket transform, which
carries none). Only ``hpush://`` ETLs serve downloads: AIS answers hpull and ws with 501 for every
object, so ``download`` refuses those before starting a job.

An object fails whole: a link that does not answer 200, a shard the pod refuses, or a sample failing
under ``on_error=fail`` after the first byte (AIS stores nothing when the pod's answer is cut). Each
failure is in ``DownloadJob.object_errors`` with AIS's message. Once the job ends, the bucket is checked
as an offline copy is (``transformer.client.whole_copy``): every object asked for is among those errors
or stored with its end marker, else ``IncompleteCopy``.

The aistore SDK has no download API; the requests go through the SDK's own request client, so
authentication, TLS and error mapping stay the SDK's.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from .errors import IncompleteCopy
from .etlspec import comm_url, validate_name
from .registration import ais_errors, registered_message
from .urls import encode_etl_args, expand_template
from .whole_copy import check_copy

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
    verified: int = 0  # objects found whole in the bucket
    objects: dict[str, str] = field(default_factory=dict, repr=False)  # object name -> its link, as asked for

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
    seconds (``TimeoutError`` names the job, which goes on); ``wait=False`` returns after starting, and
    ``wait_download`` waits and checks later.

    Once the job ends, every object asked for must be among its errors or stored whole (its end marker
    verified from its last 2 KiB); ``IncompleteCopy`` names the others, whatever AIS reports.
    """
    from aistore.sdk.const import HTTP_METHOD_POST

    name = validate_name(etl_name)
    body: dict[str, Any] = {"bucket": {"name": bucket, "provider": "ais"}, "etl_name": name}
    encoded = encode_etl_args(etl_args)
    if encoded:
        body["etl_args"] = encoded
    body.update(_links(links))
    etl = client.etl(name)
    requests = etl._client  # the SDK's request client (see the module's docstring)
    with ais_errors(name, "download"):
        registered = registered_message(etl)
        if registered is None:
            raise ValueError(f"download: ETL '{name}' is not registered")
        comm = comm_url(registered.get("communication"))
        if comm != "hpush://":
            raise ValueError(f"download: ETL '{name}' communicates over {comm}; AIS serves downloads through "
                             "hpush:// ETLs only")
        job_id = requests.request(HTTP_METHOD_POST, path="download", json=body).json()["id"]
    log.info("download %s: %s -> ais://%s with ETL %s", job_id, _describe(links), bucket, name)
    job = DownloadJob(name, job_id, bucket, objects=_objects(body))
    if not wait:
        return job
    return wait_download(client, job, timeout, poll)


def wait_download(client: Client, job: DownloadJob, timeout: float = 3600, poll: float = 0.5) -> DownloadJob:
    """Wait for a download ``download(..., wait=False)`` started, then prove the bucket holds it whole.

    Returns the finished job; raises ``IncompleteCopy`` when an object asked for is neither among its
    errors nor stored whole, and ``TimeoutError`` after ``timeout`` seconds (the job goes on).
    """
    from aistore.sdk.const import HTTP_METHOD_GET

    requests = client.etl(job.etl_name)._client  # the SDK's request client (see the module's docstring)
    deadline = time.monotonic() + timeout
    while True:
        with ais_errors(job.etl_name, "download status"):
            status = requests.request(HTTP_METHOD_GET, path="download", json={"id": job.job_id}).json()
        aborted = bool(status.get("aborted"))
        if aborted or not str(status.get("finished_time") or "").startswith(_UNSET_TIMES):
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(f"download {job.job_id} (ETL '{job.etl_name}' -> ais://{job.bucket}) not finished "
                               f"after {timeout:g} s; it goes on in the cluster")
        time.sleep(poll)
    errors = [(entry["name"], entry["error"]) for entry in status.get("download_errors") or []]
    done = DownloadJob(job.etl_name, job.job_id, job.bucket, finished=True, aborted=aborted,
                       stored=int(status.get("finished_cnt") or 0), object_errors=errors, objects=job.objects)
    with ais_errors(job.etl_name, "download check"):
        check = check_copy(client, job.bucket, job.objects, {name for name, _ in errors})
    done.verified = check.whole
    if not check.complete:
        state = "aborted" if aborted else "finished" + (f" with {len(errors)} errors" if errors else "")
        raise IncompleteCopy(job.job_id, f"download with ETL {job.etl_name}", job.bucket, check.missing,
                             dict(check.cut), expected=check.expected, ais_status=f"it reports the download as {state}",
                             sources=job.objects, job=done)
    return done


def _objects(body: Mapping[str, Any]) -> dict[str, str]:
    """Object name -> link for every object the download asks for, named as AIS's downloader names them
    (ext/dload: ``path.Base`` of a link, its query dropped and its escapes undone)."""
    kind = body["type"]
    if kind == "single":
        return {_downloaded_name(body["object_name"]): body["link"]}
    if kind == "range":
        links = expand_template(body["template"])
    elif isinstance(body["objects"], Mapping):
        return {_downloaded_name(name): link for name, link in body["objects"].items()}
    else:
        links = body["objects"]
    return {_downloaded_name(posixpath.basename(link.rstrip("/"))): link for link in links}


def _downloaded_name(name: str) -> str:
    """AIS's ``NormalizeObjName``: the path of ``name`` read as a URL (no query), unescaped (twice, as Go's
    ``url.PathUnescape`` of the already unescaped ``URL.Path``)."""
    path = urlsplit(name).path
    return unquote(unquote(path)) if path else name


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

