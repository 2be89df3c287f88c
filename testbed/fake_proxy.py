"""A fake AIS proxy (and target) over HTTP on 127.0.0.1, checking every request against the contract.

It answers what the client uses, as AIS 5.0 does (ais/prxetl.go: ETL init/list/view/stop/
start/delete, bucket create/list, object PUT/GET with ``etl_name``, range GETs with the object's
checksum and version, multi-object delete), plus dSort (``POST /v1/sort``,
``GET /v1/sort?uuid=``, checked against the spec fields of ``ais start dsort`` and the SDK's
``DsortFramework``; input names and missing inputs handled as aisnode v1.5.0 does). Every request
is recorded; every deviation from the contract (method, path, query, JSON body) is appended to
``problems`` and answered ``400``, so a test asserts
``proxy.problems == []`` as well as its own expectations.

Offline transforms (bucket-to-bucket ``etl-bck``, multi-object ``etl-listrange``) and ETL downloads
(``/v1/download``) run to their end before the start request is answered. ``drops`` and ``cuts`` make
the target lose an object's output without recording an error, as AIS does on some paths (a ``ws``
direct put that fails on some runs; a ``ws`` reply stored cut on the same target). ``flagged_pages``
flags every listing page as taken during a rebalance (ais/tgtbck.go), and ``running`` adds jobs to
those AIS lists as running (a rebalance, say).

Objects live in an AIS mountpath layout (``<mountpath>/@ais/<bucket>/%ob/<object>``). An object GET
with ``etl_name`` of an ``hpull://`` ETL is redirected, like a target does, to
``<pod>/<PathEscape(uname)>?etl_fqn=<PathEscape(fqn)>&etl_args=..``; one of an ``hpush://`` ETL is
relayed, status line first, with a failure after it appended as AIS's JSON error (``_relay``). So
loaders read from the real transformer service. Object PUTs are redirected proxy -> target (307).

The ETL routes and what they report back are ``fake_proxy_etl.py``; the dSort routes ``fake_proxy_dsort.py``.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import msgspec
from braceexpand import braceexpand

from testbed.aisnames import go_path_escape
from testbed.httpserve import QuietServer

from .fake_proxy_dsort import DsortRoutes, no_step
from .fake_proxy_etl import ContractViolation, EtlRoutes, FakeEtl, Recorded


class FakeProxy(EtlRoutes, DsortRoutes):
    def __init__(self, mountpath: Path, pod_url: str | None = None, page_size: int = 3):
        self.mountpath = Path(mountpath)
        self.pod_url = pod_url
        self.page_size = page_size
        self.requests: list[Recorded] = []
        self.problems: list[str] = []
        self.etls: dict[str, FakeEtl] = {}
        self.init_seconds = 0.0  # how long an ETL's init takes before the proxy answers
        self.buckets: set[str] = set()
        self.dsort_jobs: dict[str, dict[str, Any]] = {}
        self.dsort_error: str | None = None  # set to make the next dSort job abort with this error
        self.relay_cuts: dict[str, int] = {}  # object name -> bytes after which the pod's body breaks, once
        self.drops: set[str] = set()  # offline/download object names whose output is lost, no error recorded
        self.cuts: dict[str, int] = {}  # ... whose output is stored cut to that many bytes, no error recorded
        self.downloads: dict[str, dict[str, Any]] = {}  # download job id -> AIS's status of it
        self.jobs: dict[str, dict[str, Any]] = {}  # offline transform job id -> {kind, err, end_time, aborted}
        self.pod_logs = ""  # what GET /v1/etl/<name>/logs answers for the one target
        self.checksum_type = "xxhash2"  # every bucket's checksum type (AIS 5.0's default), as HEAD answers it
        self.versions: dict[tuple[str, str], int] = {}  # (bucket, object) -> its version, counted per PUT
        self.flagged_pages = False  # list pages flagged as taken during a rebalance (ais/tgtbck.go's Lst.Flags)
        self.running: list[str] = []  # "kind[id]" of jobs running besides the fake's own (which end as they start)
        self._lock = threading.Lock()
        self._server = QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # ---- storage -------------------------------------------------------------------------------

    def fqn(self, bucket: str, name: str) -> Path:
        return self.mountpath / "@ais" / bucket / "%ob" / name

    def put_object(self, bucket: str, name: str, data: bytes) -> None:
        path = self.fqn(bucket, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.buckets.add(bucket)
        with self._lock:
            self.versions[bucket, name] = self.versions.get((bucket, name), 0) + 1

    def checksum(self, bucket: str, name: str) -> str:
        """The object's checksum as AIS lists it: XXH64 (seed 0) hex for "xxhash2" (cespare/xxhash/v2), md5 hex."""
        import hashlib

        import xxhash

        data = self.fqn(bucket, name).read_bytes()
        if self.checksum_type == "xxhash2":
            return xxhash.xxh64(data, seed=0).hexdigest()
        if self.checksum_type == "md5":
            return hashlib.md5(data).hexdigest()
        return ""

    def objects(self, bucket: str) -> list[str]:
        root = self.mountpath / "@ais" / bucket / "%ob"
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []

    def calls(self, method: str, path_prefix: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path.startswith(path_prefix)]

    # ---- HTTP ----------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet test output
                pass

            def _dispatch(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body: Any = raw
                # The SDK labels every request application/json, object PUTs too: only control paths are JSON.
                is_data = parts.path.startswith(("/v1/objects/", "/_target/"))
                if raw and not is_data and self.headers.get("Content-Type", "").startswith("application/json"):
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        body = raw
                record = Recorded(self.command, parts.path, parse_qs(parts.query, keep_blank_values=True), body,
                                  dict(self.headers))
                with proxy._lock:
                    proxy.requests.append(record)
                try:
                    proxy._route(self, record)
                except ContractViolation as exc:
                    proxy.problems.append(f"{record.method} {record.path}: {exc}")
                    self.reply(400, str(exc).encode())
                except Exception as exc:  # a bug of the fake: visible in problems, never an SDK retry loop (5xx)
                    proxy.problems.append(f"{record.method} {record.path}: fake proxy failed: {exc!r}")
                    self.reply(400, repr(exc).encode())

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _dispatch

            def reply(self, status: int, body: bytes = b"", content_type: str = "text/plain",
                      headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def json(self, status: int, value: Any) -> None:
                self.reply(status, json.dumps(value).encode(), "application/json")

            def error(self, status: int, message: str) -> None:
                # AIS error body: JSON with the message; the SDK maps 404/409 by words in it.
                self.json(status, {"message": message, "method": self.command, "url_path": self.path,
                                   "status": status})

        return Handler

    def _route(self, h: Any, r: Recorded) -> None:
        path = r.path
        if path.startswith("/_target/"):  # second hop of a redirected request, as a target
            return self._target(h, r, path[len("/_target"):])
        if path == "/v1/etl" or path.startswith("/v1/etl/"):
            return self._etl(h, r, path[len("/v1/etl"):].strip("/").split("/") if path != "/v1/etl" else [])
        if path.startswith("/v1/buckets/"):
            return self._bucket(h, r, unquote(path[len("/v1/buckets/"):]))
        if path.startswith("/v1/objects/"):
            return self._object_proxy(h, r, path)
        if path == "/v1/sort":
            return self._dsort(h, r)
        if path == "/v1/cluster":
            return self._cluster(h, r)
        if path == "/v1/download":
            return self._download(h, r)
        raise ContractViolation(f"no such AIS endpoint {r.method} {path}")

    # ---- buckets and objects ---------------------------------------------------------------------

    def _provider(self, r: Recorded) -> None:
        if r.query.get("provider") != ["ais"]:
            raise ContractViolation(f"expected query provider=ais, got {r.query.get('provider')}")

    def _bucket(self, h: Any, r: Recorded, bucket: str) -> None:
        self._provider(r)
        if r.method == "HEAD":  # bucket properties in a header (ais/prxbck.go, apc.HdrBucketProps)
            if bucket not in self.buckets:
                return h.error(404, f"bucket \"ais://{bucket}\" does not exist")
            props = {"checksum": {"type": self.checksum_type}, "versioning": {"enabled": True}}
            return h.reply(200, headers={"Ais-Bucket-Props": json.dumps(props)})
        action = r.body if isinstance(r.body, dict) else None
        if action is None or set(action) != {"action", "name", "value"}:
            raise ContractViolation(f"bucket request needs an ActionMsg {{action, name, value}}, got {r.body!r}")
        if r.method == "POST" and action["action"] == "create-bck":
            if bucket in self.buckets:
                return h.error(409, f"bucket \"ais://{bucket}\" already exists")
            self.buckets.add(bucket)
            (self.mountpath / "@ais" / bucket / "%ob").mkdir(parents=True, exist_ok=True)
            return h.reply(200)
        if r.method == "GET" and action["action"] == "list":
            return self._list(h, r, bucket, action["value"])
        if r.method == "POST" and action["action"] == "etl-bck":
            return self._transform_bucket(h, r, bucket, action["value"])
        if r.method == "POST" and action["action"] == "etl-listrange":
            return self._transform_objects(h, bucket, action["value"])
        if r.method == "DELETE" and action["action"] == "delete-listrange":
            return self._delete_objects(h, bucket, action["value"])
        raise ContractViolation(f"unexpected bucket action {action['action']!r} with {r.method}")

    def _transform_bucket(self, h: Any, r: Recorded, bucket: str, value: dict[str, Any]) -> None:
        """An offline bucket-to-bucket transform (``etl-bck``), run to the end before answering.

        As AIS 5.0's target does for an ``hpush://`` ETL whose destination target is itself: each object is
        PUT to the pod with ``etl_fqn`` and no ``etl_args`` (``apc.Transform`` has none), and a ``200`` body is
        stored under the destination name (``ext`` maps extensions). A pod error is recorded as the object's
        error; with ``coer`` the job goes on, without it the job aborts.
        """
        to = r.query.get("bck_to", [""])[-1]
        if not re.fullmatch(r"ais/@#/[^/]+/", to):
            raise ContractViolation(f"bck_to {to!r} is not ais/@#/<bucket>/")
        # api/apc/tcbtco.go TCBMsg with Transform inlined ({id, pipeline, request_timeout}): no etl_args.
        unknown = set(value) - {"id", "pipeline", "request_timeout", "ext", "num-workers", "coer", "prefix", "prepend",
                                "dry_run", "force", "latest-ver", "synchronize"}
        if unknown:
            raise ContractViolation(f"unknown etl-bck fields {sorted(unknown)}")
        etl = self._offline_etl(h, bucket, value)
        if etl is None:
            return None
        names = [name for name in self.objects(bucket) if name.startswith(value.get("prefix", ""))]
        h.reply(200, self._offline(etl, bucket, to.split("/")[2], names, value, "etl-bck").encode())

    def _transform_objects(self, h: Any, bucket: str, value: dict[str, Any]) -> None:
        """A multi-object transform (``etl-listrange``, the SDK's ``ObjectGroup.transform``): ``cmn.TCOMsg``,
        the objects by ``objnames`` or ``template`` beside the ``TCBMsg`` fields and the destination
        ``tobck``. As AIS 5.0's ``lrit`` does, a listed name that does not exist is an object error, a
        template's name that does not exist is skipped (xact/xs/lrit.go, tcobjs.go)."""
        unknown = set(value) - {"objnames", "template", "tobck", "id", "pipeline", "request_timeout", "ext",
                                "num-workers", "coer", "prefix", "prepend", "dry_run", "force", "latest-ver",
                                "synchronize"}
        if unknown:
            raise ContractViolation(f"unknown etl-listrange fields {sorted(unknown)}")
        if ("objnames" in value) == ("template" in value):
            raise ContractViolation("etl-listrange needs objnames or template")
        to = value.get("tobck")
        if not isinstance(to, dict) or to.get("provider") != "ais" or not to.get("name"):
            raise ContractViolation(f"tobck {to!r} is not an ais bucket")
        etl = self._offline_etl(h, bucket, value)
        if etl is None:
            return None
        if "template" in value:
            existing = set(self.objects(bucket))
            names = [name for name in braceexpand(no_step(value["template"])) if name in existing]
        else:
            names = list(value["objnames"])
        h.reply(200, self._offline(etl, bucket, to["name"], names, value, "etl-listrange").encode())

    def _call_pod(self, method: str, target: str) -> tuple[int, bytes]:
        """One empty-bodied request to the pod, as a target makes it: the status and the whole reply."""
        pod = urlsplit(self.pod_url)
        conn = http.client.HTTPConnection(pod.hostname, pod.port, timeout=60)
        try:
            conn.request(method, target, body=b"", headers={"Content-Length": "0"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _offline_etl(self, h: Any, bucket: str, value: dict[str, Any]) -> FakeEtl | None:
        """The ETL an offline transform of ``bucket`` names, or None once answered with AIS's error for a
        missing ETL or bucket (and this fake's own 501 for an ETL it cannot run offline)."""
        etl = self.etls.get(value.get("id", ""))
        if etl is None:
            h.error(404, f"etl job {value.get('id')!r} does not exist")
        elif bucket not in self.buckets:
            h.error(404, f"bucket \"ais://{bucket}\" does not exist")
        elif self.pod_url is None or etl.message["communication"] != "hpush://":
            h.error(501, "this fake target runs offline transforms of hpush:// ETLs only")
        else:
            return etl
        return None

    def _offline(self, etl: FakeEtl, bucket: str, destination: str, names: list[str], value: dict[str, Any],
                 kind: str) -> str:
        """Each object PUT to the pod with ``etl_fqn`` and no ``etl_args`` (``apc.Transform`` has none); a
        ``200`` body is stored under the destination name (``ext`` maps extensions, ``TCBMsg.ToName``), a pod
        error is recorded under the object's ``ais://<bucket>/<name>``. Without ``coer`` the first error aborts."""
        self.buckets.add(destination)
        job = f"{kind}-" + uuid.uuid4().hex[:8]
        errors: list[dict[str, Any]] = []
        aborted = False
        for name in names:
            if not self.fqn(bucket, name).is_file():
                errors.append({"obj_name": f"ais://{bucket}/{name}", "msg": "object not found", "ecode": 404})
                continue
            query = urlencode([("etl_fqn", go_path_escape(str(self.fqn(bucket, name))))])
            status, body = self._call_pod("PUT", f"/{quote(bucket)}/{quote(name)}?{query}")
            if status == 200:
                stem, dot, ext = name.rpartition(".")
                mapped = (value.get("ext") or {}).get(ext)
                self._store(destination, value.get("prepend", "") + (f"{stem}.{mapped.lstrip('.')}" if dot and mapped
                                                                      else name), body, name)
                continue
            errors.append({"obj_name": f"ais://{bucket}/{name}",
                           "msg": f"ETL error: {body.decode('utf-8', 'replace')}", "ecode": status})
            if not value.get("coer"):
                aborted = True
                break
        etl.job_errors[job] = errors
        self.jobs[job] = {"kind": kind, "err": errors[0]["msg"] if aborted else "", "aborted": aborted,
                          "end_time": time.time_ns()}
        return job

    def _delete_objects(self, h: Any, bucket: str, value: dict[str, Any]) -> None:
        """A multi-object delete (``delete-listrange``, the SDK's ``ObjectGroup.delete``), run to its end before
        answering with the job id: names that do not exist are skipped, as AIS's ``lrit`` does."""
        if set(value) != {"objnames"} or not isinstance(value["objnames"], list):
            raise ContractViolation(f"delete-listrange value {value!r} is not {{objnames: [...]}}")
        if bucket not in self.buckets:
            return h.error(404, f"bucket \"ais://{bucket}\" does not exist")
        for name in value["objnames"]:
            if self.fqn(bucket, name).is_file():
                self.fqn(bucket, name).unlink()
        job = "delete-listrange-" + uuid.uuid4().hex[:8]
        self.jobs[job] = {"kind": "delete-listrange", "err": "", "aborted": False, "end_time": time.time_ns()}
        h.reply(200, job.encode())

    def _store(self, bucket: str, name: str, data: bytes, asked: str) -> None:
        """Store an offline or downloaded object, unless ``drops`` or ``cuts`` say the target loses it."""
        if asked in self.drops:
            return
        self.put_object(bucket, name, data[:self.cuts[asked]] if asked in self.cuts else data)

    def _download(self, h: Any, r: Recorded) -> None:
        """ETL downloads (ext/dload): each object is asked of the ``hpush://`` pod, ``POST
        /download?original_url=<link>&object_to=<name>[&etl_args=..]``, and its ``200`` body stored; any other
        answer is a download error naming the object. ``GET`` answers the job's status (``dload.StatusResp``)."""
        body = r.body if isinstance(r.body, dict) else {}
        if r.method == "GET":
            status = self.downloads.get(body.get("id", ""))
            if status is None:
                return h.error(404, f"download job {body.get('id')!r} not found")
            return h.json(200, status)
        if r.method != "POST":
            raise ContractViolation(f"{r.method} /v1/download is not used by the client")
        etl = self.etls.get(body.get("etl_name", ""))
        if etl is None or self.pod_url is None or etl.message["communication"] != "hpush://":
            return h.error(501, "this fake target downloads through hpush:// ETLs only")
        kind = body.get("type")
        if kind == "single":
            objects = {body["object_name"]: body["link"]}
        elif kind == "range":
            objects = {link.rsplit("/", 1)[-1]: link for link in braceexpand(body["template"])}
        elif kind == "multi" and isinstance(body.get("objects"), dict):
            objects = dict(body["objects"])
        elif kind == "multi":
            objects = {link.rsplit("/", 1)[-1]: link for link in body["objects"]}
        else:
            raise ContractViolation(f"download type {kind!r}")
        bucket = body["bucket"]["name"]
        self.buckets.add(bucket)
        errors = []
        for name, link in objects.items():
            query = [("original_url", link), ("object_to", name)]
            if body.get("etl_args"):
                query.append(("etl_args", body["etl_args"]))
            status, data = self._call_pod("POST", f"/download?{urlencode(query)}")
            if status == 200:
                self._store(bucket, name, data, name)
            else:
                errors.append({"name": name, "error": f"ETL pod returned error status: {status}"})
        job = "dnl-" + uuid.uuid4().hex[:8]
        self.downloads[job] = {"id": job, "finished_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "aborted": False, "total": len(objects), "finished_cnt": len(objects) - len(errors),
                               "errors_cnt": len(errors), "download_errors": errors}
        h.json(200, {"id": job})

    def _cluster(self, h: Any, r: Recorded) -> None:
        if r.method != "GET" or r.query.get("what") not in (["status"], ["qryxstats"], ["running_all"]):
            raise ContractViolation(f"{r.method} /v1/cluster?{r.query} is not used by the client")
        args = r.body if isinstance(r.body, dict) else {}
        if r.query["what"] == ["running_all"]:  # "kind[id]" of the running jobs: this fake's end as they start
            return h.json(200, [job for job in self.running if args.get("kind") in ("", job.split("[")[0])])
        job = self.jobs.get(args.get("ID", ""))  # the SDK's JobArgs: {ID, Kind, DaemonID, Bck, Buckets}
        if job is None:
            return h.error(404, f"job {args!r} not found")
        if args.get("Kind") not in ("", None, job["kind"]):
            raise ContractViolation(f"job kind {args.get('Kind')!r}, the job is {job['kind']}")
        if r.query["what"] == ["qryxstats"]:  # the targets' snapshots: a multi-object job ends idle
            ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job["end_time"] / 1e9))
            return h.json(200, {"t1": [{"id": args["ID"], "kind": job["kind"], "start-time": ended, "end-time": ended,
                                        "aborted": job["aborted"], "abort-err": job["err"], "is_idle": True}]})
        return h.json(200, {"uuid": args["ID"], "err": job["err"], "aborted": job["aborted"],
                            "end_time": job["end_time"]})

    def _list(self, h: Any, r: Recorded, bucket: str, value: dict[str, Any]) -> None:
        expected = {"prefix", "pagesize", "uuid", "props", "continuation_token", "flags", "target"}
        if not expected <= set(value):
            raise ContractViolation(f"list message lacks {sorted(expected - set(value))}")
        if bucket not in self.buckets:
            return h.error(404, f"bucket \"ais://{bucket}\" does not exist")
        names = [n for n in self.objects(bucket) if n.startswith(value["prefix"])]
        start = int(value["continuation_token"] or 0)
        page = names[start : start + self.page_size]
        token = str(start + self.page_size) if start + self.page_size < len(names) else ""
        props = set(value["props"].split(","))
        entries = [{"n": n, "s": self.fqn(bucket, n).stat().st_size} for n in page]
        for entry in entries:  # cmn/objlist.go LsoEntry: "cs" checksum value, "v" version, when asked for
            if "checksum" in props:
                entry["cs"] = self.checksum(bucket, entry["n"])
            if "version" in props:
                entry["v"] = str(self.versions.get((bucket, entry["n"]), 1))
        listing = {"UUID": value["uuid"] or "lst-" + uuid.uuid4().hex[:6], "ContinuationToken": token,
                   "Flags": int(self.flagged_pages), "Entries": entries}
        if r.headers.get("Accept") == "application/msgpack":
            return h.reply(200, msgspec.msgpack.encode(listing), "application/msgpack")
        h.json(200, listing)

    def _object_proxy(self, h: Any, r: Recorded, path: str) -> None:
        self._provider(r)
        bucket, _, name = unquote(path[len("/v1/objects/"):]).partition("/")
        if not name:
            raise ContractViolation("object path needs <bucket>/<object>")
        query = {k: v[-1] for k, v in r.query.items()}
        # The proxy redirects object data requests to the owning target.
        h.reply(307, headers={"Location": f"{self.url}/_target{path}?{urlencode(query)}"})

    def _target(self, h: Any, r: Recorded, path: str) -> None:
        bucket, _, name = unquote(path[len("/v1/objects/"):]).partition("/")
        if r.method == "PUT":
            if bucket not in self.buckets:
                return h.error(404, f"bucket \"ais://{bucket}\" does not exist")
            if int(r.headers.get("Content-Length") or 0) != len(r.body):
                raise ContractViolation("object PUT body does not match Content-Length")
            self.put_object(bucket, name, r.body)
            return h.reply(200)
        if r.method == "DELETE":
            if not self.fqn(bucket, name).is_file():
                return h.error(404, f"ais://{bucket}/{name} does not exist")
            self.fqn(bucket, name).unlink()
            return h.reply(200)
        if r.method != "GET":
            raise ContractViolation(f"{r.method} on an object is not used by the client")
        if not self.fqn(bucket, name).is_file():
            return h.error(404, f"ais://{bucket}/{name} does not exist")
        etl_name = r.query.get("etl_name", [""])[-1]
        if not etl_name and "Range" in r.headers:
            return self._range(h, r.headers["Range"], self.fqn(bucket, name).read_bytes(), self._attrs(bucket, name))
        if not etl_name:
            return h.reply(200, self.fqn(bucket, name).read_bytes(), "application/octet-stream")
        etl = self.etls.get(etl_name)
        if etl is None or etl.stage != "Running":
            return h.error(404, f"etl job {etl_name} does not exist - try starting new ETL")
        if self.pod_url is None or etl.message["communication"] not in ("hpull://", "hpush://"):
            return h.error(501, "this fake target serves hpull:// and hpush:// ETLs only")
        if etl.message["communication"] == "hpush://":
            return self._relay(h, r, bucket, name)
        # What a target answers an inline GET of an hpull:// ETL (ext/etl/communicator.go:390-413).
        query = [("etl_fqn", go_path_escape(str(self.fqn(bucket, name))))]
        if "etl_args" in r.query:
            query.append(("etl_args", r.query["etl_args"][-1]))
        location = f"{self.pod_url}/{go_path_escape(f'ais/@#/{bucket}/{name}')}?{urlencode(query)}"
        h.reply(307, headers={"Location": location})

    def _attrs(self, bucket: str, name: str) -> dict[str, str]:
        """The object's attributes a GET answers with (``cmn.ToHeader``): its checksum and version."""
        return {"Ais-Checksum-Type": self.checksum_type, "Ais-Checksum-Value": self.checksum(bucket, name),
                "Ais-Version": str(self.versions.get((bucket, name), 1))}

    def _range(self, h: Any, header: str, data: bytes, attrs: dict[str, str]) -> None:
        """A single-range GET (RFC 7233, as a target answers it): ``206`` with ``Content-Range`` and the whole
        object's attributes."""
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", header)
        if match is None or match.group(1) == match.group(2) == "":
            raise ContractViolation(f"Range {header!r} is not one byte range")
        first, last = match.group(1), match.group(2)
        start = int(first) if first else max(0, len(data) - int(last))
        end = min(len(data) - 1, int(last)) if first and last else len(data) - 1
        if start > end:
            return h.reply(416, headers={"Content-Range": f"bytes */{len(data)}"})
        h.reply(206, data[start:end + 1], "application/octet-stream",
                headers={"Content-Range": f"bytes {start}-{end}/{len(data)}", **attrs})

    def _relay(self, h: Any, r: Recorded, bucket: str, name: str) -> None:
        """An inline GET of an ``hpush://`` ETL, relayed as AIS 5.0's target relays it.

        ``pushComm.InlineTransform`` (ext/etl/communicator.go) PUTs ``<pod>/<bucket>/<object>?etl_fqn=..``
        with an empty body, writes the pod's status line to the reader, then copies the pod's body. When
        that copy fails (the pod aborted mid-body), ais/tgtetl.go writes its JSON error into the same
        response and returns normally: the reader gets a cleanly terminated chunked ``200`` holding part
        of the tar and then the error. ``relay_cuts[name] = n`` makes the pod's body break after ``n``
        bytes once (a transient failure, such as a pod restarted mid-read).
        """
        query = [("etl_fqn", go_path_escape(str(self.fqn(bucket, name))))]
        if "etl_args" in r.query:
            query.append(("etl_args", r.query["etl_args"][-1]))
        pod = urlsplit(self.pod_url)
        conn = http.client.HTTPConnection(pod.hostname, pod.port, timeout=60)
        conn.request("PUT", f"/{quote(bucket)}/{quote(name)}?{urlencode(query)}", body=b"",
                     headers={"Content-Length": "0", "Accept-Encoding": "gzip"})
        response = conn.getresponse()
        if response.status >= 400:  # the pod's error before its body: AIS answers it with the pod's status
            body = response.read().decode("utf-8", "replace")
            conn.close()
            return h.error(response.status, f"ETL error: {body}")
        with self._lock:
            cut = self.relay_cuts.pop(name, None)
        h.send_response(response.status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        copied = 0
        try:
            while True:
                data = response.read1(1 << 16)
                if not data:
                    break
                if cut is not None and copied + len(data) >= cut:
                    chunk(data[:cut - copied])
                    raise ConnectionResetError("connection reset by peer")
                chunk(data)
                copied += len(data)
        except (http.client.HTTPException, OSError) as exc:
            error = {"message": f"ETL {bucket}/{name}: failed to copy the transformed object: {exc!r}",
                     "method": "GET", "url_path": r.path, "status": 500}
            chunk(json.dumps(error).encode())
        finally:
            conn.close()
        h.wfile.write(b"0\r\n\r\n")
