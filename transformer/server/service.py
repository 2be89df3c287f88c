"""The AIS ETL contract over HTTP and WebSocket (docs/contract.md).

Routes: ``PUT /<bucket>/<obj>`` (hpush), ``GET /<PathEscape(uname)>`` (hpull), ``WS /ws``,
``POST /download``, ``GET /health``, ``GET /metrics``. Each shard request becomes a ``ShardJob``;
this module only decides where its input comes from and where its output goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.websockets import WebSocketDisconnect
from uvicorn.protocols.utils import ClientDisconnected

from ..config import Settings, shard_threads
from ..engine import TransformPool
from ..errors import Cancelled, RequestError, TransformerError
from ..options import forwarded_etl_args, parse_etl_args
from ..redact import install_logging, redact
from .hops import HEADER_NODE_URL, parse_node_url
from .jobs import Runtime, ShardJob, ShardRequest
from .metrics import Metrics
from .output import Final, Output, WsReply, quiet_foreseen_aborts, respond_http, send_ws_frame
from .processes import ShardProcesses, WorkerConfig
from .protocols import FragmentingWebSocketProtocol, fragmenter_of, transport_of
from .sources import BodySource, BytesSource, HttpSource, Source, fqn_source, shard_too_large, watch_disconnect

log = logging.getLogger("transformer.server")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_logging(settings.ais_target_url)  # the ETL secret is masked in every log line and error body
    # A response cut by a foreseen failure is the job's one log line, not uvicorn's traceback as well.
    quiet_foreseen_aborts(logging.getLogger("uvicorn.error"))
    state: dict[str, Runtime] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        metrics = Metrics()
        processes = pool = None
        if settings.processes:
            processes = ShardProcesses(settings.processes, WorkerConfig(
                threads=shard_threads(settings.workers, settings.processes),
                max_inflight=math.ceil(settings.max_inflight / settings.processes),
                log_level=settings.log_level, ais_target_url=settings.ais_target_url),
                on_restart=metrics.worker_restarts.inc)
            metrics.add_decode_paths(processes.decode_paths)
            # Ready only once the workers run: AIS sends shards as soon as /health answers.
            await asyncio.to_thread(processes.wait_ready, settings.obj_timeout)
        else:
            pool = TransformPool(settings.workers, settings.max_inflight)
        runtime = Runtime(
            settings=settings,
            pool=pool,
            processes=processes,
            client=_http_client(settings),
            origin_client=_origin_client(settings),
            metrics=metrics,
        )
        state["runtime"] = runtime
        log.info("transformer ready: %d workers in %s, window %d, preset %s, obj_timeout %.0fs",
                 settings.workers, f"{settings.processes} worker processes" if processes else "this process",
                 settings.window, settings.preset, settings.obj_timeout)
        try:
            yield
        finally:
            if pool is not None:
                pool.shutdown()
            if processes is not None:
                processes.shutdown()
            runtime.client.close()
            runtime.origin_client.close()

    app = FastAPI(title="AIS WebDataset transformer", lifespan=lifespan, docs_url=None, redoc_url=None)

    def runtime() -> Runtime:
        return state["runtime"]

    @app.get("/health", response_class=PlainTextResponse)
    async def health() -> str:
        return "Running"

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(runtime().metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/download")
    async def download(request: Request) -> Response:
        """ETL download jobs: fetch ``original_url``, transform, answer 200 + bytes (ext/etl/communicator.go)."""
        query = request.query_params
        url = query.get("original_url", "")
        if urlsplit(url).scheme not in ("http", "https"):
            return _error(RequestError(f"original_url {url!r} must be an http(s) URL"))
        name = query.get("object_to") or urlsplit(url).path.rsplit("/", 1)[-1]
        return await _shard_response(request, lambda rt, job_deadline: HttpSource(rt.origin_client, url, job_deadline),
                                     shard=name, object_name=name, comm="download", object_path=name)

    @app.put("/{path:path}")
    async def hpush(path: str, request: Request) -> Response:
        """hpush: ``PUT /<bucket>/<obj>``, input from ``etl_fqn`` (empty body) or the body."""
        fqn = request.query_params.get("etl_fqn")
        object_name = path.split("/", 1)[1] if "/" in path else path
        unknown = sorted(set(request.query_params) - HPUSH_QUERY)
        if unknown:
            # AIS joins the raw object name into the URL: a '?' in the name starts the query early, so the
            # rest of the name becomes a parameter and etl_args would be lost (a transform with defaults).
            return _error(RequestError(
                f"shard '{path}': unexpected query parameters {', '.join(unknown)}: the object name holds a '?', "
                "which AIS's hpush does not escape; read such names through an hpull or ws ETL"))
        length = request.headers.get("content-length", "")
        limit = runtime().settings.max_shard_bytes
        if not fqn and length.isdigit() and int(length) > limit:
            return _error(shard_too_large(path, int(length), limit))  # before reading a byte of it
        make = _fqn_source(fqn, path, object_name) if fqn else None  # None: the body, read inside the response
        return await _shard_response(request, make, shard=path, object_name=object_name, comm="hpush",
                                     object_path=path)

    @app.get("/{path:path}")
    async def hpull(path: str, request: Request) -> Response:
        """hpull: ``GET /<PathEscape(uname)>``, input from ``etl_fqn`` or fetched from the target."""
        raw = request.scope.get("raw_path", b"").decode("latin-1").lstrip("/") or path
        uname = unquote(raw)
        parts = uname.split("/", 3)
        object_name = parts[3] if len(parts) == 4 else uname
        fqn = request.query_params.get("etl_fqn")
        if fqn:
            make = _fqn_source(fqn, uname, object_name, uname)
        else:
            target = runtime().settings.ais_target_url
            if not target:
                return _error(RequestError("hpull without etl_fqn needs AIS_TARGET_URL, which is not set", 500))
            if "/" in raw or raw in (".", ".."):
                # AIS sends PathEscape(uname): one segment. Anything else could walk to another target
                # endpoint with our ETL secret in the URL (no open proxy to the cluster).
                return _error(RequestError(f"hpull path {raw!r} is not one escaped uname segment"))
            # Keep the escaping exactly: the uname travels as one path segment (ext/etl/communicator.go).
            url = f"{target}/{raw}"
            if request.query_params.get("latest-ver"):
                url += "?latest-ver=true"
            make = lambda rt, job_deadline: HttpSource(rt.client, url, job_deadline)  # noqa: E731
        return await _shard_response(request, make, shard=uname, object_name=object_name, comm="hpull",
                                     object_path=uname)

    def _fqn_source(fqn: str, shard: str, object_name: str, uname: str | None = None):
        def make(rt: Runtime, deadline: float) -> Source:
            return fqn_source(fqn, rt.settings, rt.client, deadline, shard=shard, object_name=object_name,
                              uname=uname)

        return make

    async def _shard_response(request: Request, make_source, *, shard: str, object_name: str, comm: str,
                              object_path: str) -> Response:
        rt = runtime()
        etl_args = request.query_params.get("etl_args", "")
        try:
            options = parse_etl_args(etl_args, rt.settings)
            hop = parse_node_url(request.headers.get(HEADER_NODE_URL), object_path, forwarded_etl_args(etl_args),
                                 rt.settings.ais_target_url)
            deadline = time.monotonic() + rt.settings.obj_timeout
            source = make_source(rt, deadline) if make_source is not None else None
        except TransformerError as exc:
            return _error(exc)
        shard_request = ShardRequest(shard=shard, object_name=object_name, comm=comm, options=options, hop=hop)
        return ShardResponse(rt, shard_request, source, deadline)

    @app.websocket("/ws")
    async def websocket(ws: WebSocket) -> None:
        await serve_websocket(ws, runtime())

    return app


HPUSH_QUERY = frozenset({"etl_fqn", "etl_args"})  # all AIS 5.0 sends (ext/etl/communicator.go)


class ShardResponse(Response):
    """Streams a shard job's output (``output.respond_http``): the status line once the first chunk or a
    complete answer exists, a hard abort on a failure after it."""

    def __init__(self, rt: Runtime, request: ShardRequest, source: Source | None, deadline: float):
        super().__init__()
        self.rt, self.request, self.source, self.deadline = rt, request, source, deadline

    async def __call__(self, scope, receive, send) -> None:
        cancel = threading.Event()
        source, body = self.source, None
        if source is None:  # the request body, read by the event loop as the driver asks for it
            source = body = BodySource(asyncio.get_running_loop(), cancel)
        transport = transport_of(scope) if self.rt.settings.direct_send else None
        output = Output(self.request.shard, cancel=cancel, deadline=self.deadline,
                        input_done=body.complete if body is not None else None, may_go_direct=transport is not None)
        watcher = asyncio.create_task(body.pump(receive, cancel.set) if body is not None
                                      else watch_disconnect(receive, cancel.set))
        ShardJob(self.rt, self.request, source, output).start()
        received = (lambda: self._body_received(body)) if body is not None else None
        try:
            await respond_http(output, send, transport, received)
        finally:
            cancel.set()  # a no-op once the job is done; otherwise it stops the job's work
            watcher.cancel()

    async def _body_received(self, body: BodySource) -> None:
        """Before the response ends: the rest of the request body arrived (``BodySource.received``)."""
        if not await body.received(self.deadline - time.monotonic()):
            log.warning("shard %s: the request body did not end within the object timeout; ending the response "
                        "anyway", self.request.shard)


def _error(exc: TransformerError) -> Response:
    return PlainTextResponse(redact(exc.message), status_code=exc.status)


# ------------------------------------------------------------------------------------------ websocket


async def serve_websocket(ws: WebSocket, rt: Runtime) -> None:
    """``ws://``: Binary JSON control [+ Binary content], one reply per request, in order, on one connection.

    AIS dials a session's connections once and never again, and takes any Text reply as "delivered
    by direct put"; there is no error frame. So every request gets exactly one reply and the
    connection stays open: Text only after a direct put succeeded, Binary otherwise, also for a
    per-object failure (bad ``etl_args``, an ``fqn`` missing or not allowed, an unreadable shard, a
    sample failing under ``on_error=fail``, a next hop or a destination refusing, the object
    timeout). A close would cost AIS that connection for good and leave the requests it already
    queued on it waiting forever.

    The error reply is ``ws_error_body``: a small JSON object ``{"message", "status", "object"}``
    (``message`` and ``status`` as in AIS's own error bodies). AIS stores a Binary reply as the
    object (an inline read gets it as the body of its 200; an offline job with a local destination
    stores it) or, when it expected a direct put (remote destination), records an object error; a
    tar reader refuses it either way. The reply leaves frame by frame as the shard is transformed
    (output.py); a failure after its first frame completes any frame cut short and ends the
    message with a last frame carrying the same JSON, so the reader holds a tar cut short followed
    by bytes that are no tar (as after a failed hpush reply relayed by AIS), never a shorter,
    valid-looking shard. Only a message that is no JSON control message, a protocol violation,
    closes the connection (1003); a caller gone ends it.
    """
    await ws.accept()
    fragmenter = fragmenter_of(ws.scope)
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            control = _control_message(message)
            if control is None:
                await ws.close(code=1003, reason="expected a JSON control message {path, fqn?, etl_args?, pipeline?}")
                return
            if not await _ws_serve_one(ws, rt, control, fragmenter):
                return
    except (WebSocketDisconnect, ClientDisconnected):
        return


async def _ws_serve_one(ws: WebSocket, rt: Runtime, control: dict[str, Any],
                        fragmenter: FragmentingWebSocketProtocol | None) -> bool:
    """One request and its one reply; False when the connection is gone (nothing more can be sent)."""
    pipeline = control.get("pipeline") or ""
    reply: WsReply | Final | None = None
    try:
        reply = await _ws_request(ws, rt, control, pipeline, fragmenter)
        if isinstance(reply, Final):
            await ws.send_text((reply.headers or {}).get("Ais-Direct-Put-Length", "0"))
        elif fragmenter is None:
            await ws.send_bytes(await reply.whole())  # no frame-by-frame sending: one message, held whole
        else:
            await reply.send(fragmenter)
        return True
    except Cancelled:
        return False  # a write to the socket failed: the caller is gone, and a frame may be cut
    except (TransformerError, ValueError) as exc:
        failure: TransformerError | ValueError = exc
    path = str(control.get("path") or "")
    text = failure.message if isinstance(failure, TransformerError) else str(failure)
    log.warning("ws request %s failed: %s", path, text)
    body = ws_error_body(path, failure)
    if isinstance(reply, WsReply) and reply.frames_sent > 0 and fragmenter is not None:
        await reply.end_with_error(fragmenter, body)  # the message already began: its last frame
    elif fragmenter is not None:
        await send_ws_frame(fragmenter, body, first=True, fin=True, deadline=None)
    else:
        await ws.send_bytes(body)
    return True


def ws_error_body(path: str, exc: BaseException) -> bytes:
    """A ws per-object failure, as the reply's bytes (or its last ones): ``{"message", "status", "object"}``.

    JSON like AIS's own error bodies (``message``, ``status``: the HTTP status the same failure gets
    over hpush), plus the object's path from the control message. It starts with ``{``, so it is never
    a tar header nor the end-of-archive marker: no tar reader takes it for the end of a shard.
    """
    status = exc.status if isinstance(exc, TransformerError) else 400
    message = exc.message if isinstance(exc, TransformerError) else str(exc)
    return json.dumps({"message": redact(message), "status": status, "object": path}).encode()


def _control_message(message: dict[str, Any]) -> dict[str, Any] | None:
    raw = message.get("bytes") if message.get("bytes") is not None else (message.get("text") or "").encode()
    try:
        control = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return control if isinstance(control, dict) else None


async def _ws_request(ws: WebSocket, rt: Runtime, control: dict[str, Any], pipeline: str,
                      fragmenter: FragmentingWebSocketProtocol | None) -> WsReply | Final:
    """Start one ws request's job; its ``Final`` (a direct put) or its reply once the first chunk exists."""
    path = str(control.get("path") or "")
    etl_args = str(control.get("etl_args") or "")
    fqn = control.get("fqn")
    deadline = time.monotonic() + rt.settings.obj_timeout
    if fqn:
        # Single-encoded in the ws JSON: resolve_fqn's one percent-decode is the only one.
        source: Source = fqn_source(str(fqn), rt.settings, rt.client, deadline, shard=path, object_name=path)
    else:
        content = await ws.receive()
        if content["type"] == "websocket.disconnect":
            raise WebSocketDisconnect()
        data = content.get("bytes")
        if data is None:
            raise RequestError(f"ws request {path!r}: expected a Binary content frame after the control message")
        if len(data) > rt.settings.max_shard_bytes:
            raise shard_too_large(path, len(data), rt.settings.max_shard_bytes)
        source = BytesSource(data)
    options = parse_etl_args(etl_args, rt.settings)
    hop = parse_node_url(pipeline or None, path, forwarded_etl_args(etl_args), rt.settings.ais_target_url)
    output = Output(path, cancel=threading.Event(), deadline=deadline,
                    may_go_direct=fragmenter is not None and rt.settings.direct_send)
    ShardJob(rt, ShardRequest(shard=path, object_name=path, comm="ws", options=options, hop=hop),
             source, output).start()
    reply = WsReply(output, path)
    try:
        final = await reply.start()
    except BaseException:
        output.cancel.set()
        raise
    if final is not None:
        output.cancel.set()
        return final
    return reply


def _http_client(settings: Settings) -> httpx.Client:
    # TLS to AIS targets (hpull fetch, size check, direct put): AIS_CLIENT_CA, AIS_SKIP_VERIFY_CRT and the
    # client certificate AIS_CRT + AIS_CRT_KEY (mutual TLS), checked when the settings were read.
    verify = settings.ais_tls()
    # Idle connections expire before the target's own 6 s idle timeout would close them under us.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=4.0)
    return httpx.Client(verify=verify, limits=limits, follow_redirects=False, timeout=settings.obj_timeout)


def _origin_client(settings: Settings) -> httpx.Client:
    # /download origins are any host (a web server, a cloud bucket's URL): verified against the default
    # bundle plus AIS_CLIENT_CA, never skip-verify, never the AIS client certificate, redirects followed.
    return httpx.Client(verify=settings.origin_tls(), follow_redirects=True, timeout=settings.obj_timeout)
