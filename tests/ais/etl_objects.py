"""The target's ETL object endpoint, for a pod started by hand next to a real aisnode.

In Kubernetes a pod's ``AIS_TARGET_URL`` is ``<target intra-data>/v1/etl/_object/<etl>/<secret>``,
and the target answers ``HEAD``/``GET <that>/<PathEscape(uname)>`` from the object's metadata and
data (``ais/tgtetl.go`` ``etlObjHandler``). Outside Kubernetes aisnode refuses that route ("the
operation requires Kubernetes"), so this relay stands in for it: it checks the ETL name and secret,
parses the uname (``<provider>/@<uuid>#<namespace>/<bucket>/<object>``) as ``meta.ParseUname`` does,
and forwards to the same target's object API (``/v1/objects/<bucket>/<object>?provider=&namespace=``),
which answers from the same metadata: ``Content-Length`` on ``HEAD`` is the object's size, whole, for a
chunked object too. Every request is recorded; ``head_status`` makes ``HEAD`` fail on purpose.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import quote, unquote

import httpx

from testbed.httpserve import QuietServer

PREFIX = "/v1/etl/_object/"


@dataclass
class Seen:
    method: str
    raw_path: str
    uname: str
    status: int


def parse_uname(uname: str) -> tuple[str, str, str, str]:
    """(provider, namespace, bucket, object): ``ais/@#/b/o`` -> ('ais', '', 'b', 'o'); a named namespace
    is returned as AIS's query parameter writes it, ``@<uuid>#<name>``."""
    provider, ns, bucket, name = uname.split("/", 3)
    if not ns.startswith("@") or "#" not in ns:
        raise ValueError(f"uname {uname!r}: namespace {ns!r} is not @<uuid>#<name>")
    return provider, ("" if ns == "@#" else ns), bucket, name


class EtlObjectRelay:
    def __init__(self, target_url: str, etl_name: str, secret: str):
        self.target_url, self.etl_name, self.secret = target_url.rstrip("/"), etl_name, secret
        self.seen: list[Seen] = []
        self.head_status: int | None = None  # answer HEAD with this status instead of relaying it
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0))
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                relay._serve(self, "HEAD")

            def do_GET(self) -> None:  # noqa: N802
                relay._serve(self, "GET")

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.ais_target_url = f"{self.url}{PREFIX}{etl_name}/{secret}"  # what the pod gets as AIS_TARGET_URL
        self._thread = threading.Thread(target=self._server.serve_forever, name="etl-object-relay", daemon=True)
        self._thread.start()

    def recorded(self) -> list[Seen]:
        with self._lock:
            return list(self.seen)

    def clear(self) -> None:
        with self._lock:
            self.seen.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def _serve(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        raw = handler.path.split("?", 1)[0]
        uname, seen = "", False

        def record(status: int) -> None:  # before the answer leaves: the pod may finish, and a test look, at once
            nonlocal seen
            seen = True
            with self._lock:
                self.seen.append(Seen(method, raw, uname, status))

        try:
            parts = raw[len(PREFIX):].split("/", 2) if raw.startswith(PREFIX) else []
            if len(parts) != 3 or parts[0] != self.etl_name or parts[1] != self.secret:
                record(403)
                return self._reply(handler, 403, b"unknown ETL or bad secret")
            uname = unquote(parts[2])
            provider, ns, bucket, name = parse_uname(uname)
            if method == "HEAD" and self.head_status is not None:
                record(self.head_status)
                return self._reply(handler, self.head_status, b"")
            params = {"provider": provider, **({"namespace": ns} if ns else {})}
            url = f"{self.target_url}/v1/objects/{quote(bucket)}/{quote(name)}"
            with self._http.stream(method, url, params=params) as upstream:
                record(upstream.status_code)
                handler.send_response(upstream.status_code)
                length = upstream.headers.get("content-length")
                if length is not None:
                    handler.send_header("Content-Length", length)
                handler.end_headers()
                if method == "GET":
                    for chunk in upstream.iter_raw():
                        handler.wfile.write(chunk)
        finally:
            if not seen:
                record(500)

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
