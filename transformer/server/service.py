"""The AIS ETL contract over HTTP (docs/contract.md), and the app that serves it with ``WS /ws``.

Routes: ``PUT /<bucket>/<obj>`` (hpush), ``GET /<PathEscape(uname)>`` (hpull), ``POST /download``,
``GET /health``, ``GET /metrics`` (``router``), and ``WS /ws`` (``websocket.py``). Each shard request
becomes a ``ShardJob``; this module only decides where its input comes from and where its output goes.
``create_app`` wires the routes and the runtime's lifespan; the host's logging is the caller's
(``wds-transform serve`` passes ``logs.serve_log_config`` to uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from urllib.parse import unquote, urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import Settings, process_threads
from ..errors import RequestError, TransformerError
from ..options import forwarded_etl_args, parse_etl_args
from ..pool import TransformPool
from ..redact import install_logging, redact
from .body import BodySource, watch_disconnect
from .hops import HEADER_NODE_URL, parse_node_url
from .httpreply import respond_http
from .jobs import Runtime, ShardJob, ShardRequest
from .logs import quiet_foreseen_aborts
from .metrics import Metrics
from .output import Output
from .processes import ShardProcesses
from .protocols import protocol_of, transport_of
from .sources import (
    HttpSource,
    Source,
    fqn_source,
    origin_client,
    shard_too_large,
    target_client,
)
from .websocket import websocket
from .worker import WorkerConfig

log = logging.getLogger("transformer.server")

HPUSH_QUERY = frozenset({"etl_fqn", "etl_args"})  # all AIS 5.0 sends (ext/etl/communicator.go)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The ASGI app: the routes, and a lifespan that starts the runtime (pool or worker processes, clients)."""
    settings = settings or Settings.from_env()
    install_logging(settings.ais_target_url)  # the ETL secret is masked in every log line and error body
    # A response cut by a foreseen failure is the job's one log line, not uvicorn's traceback as well.
    quiet_foreseen_aborts(logging.getLogger("uvicorn.error"))
    app = FastAPI(title="AIS WebDataset transformer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """``app.state.runtime`` while the app serves: started before the first request, closed after the last."""
    settings: Settings = app.state.settings
    metrics = Metrics()
    processes = pool = None
    if settings.processes:
        processes = ShardProcesses(settings.processes, WorkerConfig(
            threads=process_threads(settings.workers, settings.processes),
            max_inflight=math.ceil(settings.max_inflight / settings.processes),
            log_level=settings.log_level, ais_target_url=settings.ais_target_url, stall=settings.worker_timeout,
            settings=settings),
            on_restart=metrics.worker_restarts.inc)
        metrics.add_decode_paths(processes.decode_paths)
        metrics.add_spread(processes.spread)
        # Ready only once the workers run: AIS sends shards as soon as /health answers.
        await asyncio.to_thread(processes.wait_ready, settings.obj_timeout)
    else:
        pool = TransformPool(settings.workers, settings.max_inflight)
    runtime = Runtime(
        settings=settings,
        pool=pool,
        processes=processes,
        client=target_client(settings),
        origin_client=origin_client(settings),
        metrics=metrics,
    )
    app.state.runtime = runtime
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


router = APIRouter()


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


@router.get("/health", response_class=PlainTextResponse)
async def health() -> str:
    return "Running"


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(runtime(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/download")
async def download(request: Request) -> Response:
    """ETL download jobs: fetch ``original_url``, transform, answer 200 + bytes (ext/etl/communicator.go)."""
    query = request.query_params
    url = query.get("original_url", "")
    if urlsplit(url).scheme not in ("http", "https"):
        return _error(RequestError(f"original_url {url!r} must be an http(s) URL"))
    name = query.get("object_to") or urlsplit(url).path.rsplit("/", 1)[-1]
    return await _shard_response(request, lambda rt, job_deadline: HttpSource(rt.origin_client, url, job_deadline),
                                 shard=name, object_name=name, comm="download", object_path=name)


@router.put("/{path:path}")
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
    limit = runtime(request).settings.max_shard_bytes
    if not fqn and length.isdigit() and int(length) > limit:
        return _error(shard_too_large(path, int(length), limit))  # before reading a byte of it
    make = _fqn_source(fqn, path, object_name) if fqn else None  # None: the body, read inside the response
    return await _shard_response(request, make, shard=path, object_name=object_name, comm="hpush",
                                 object_path=path)


@router.get("/{path:path}")
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
        target = runtime(request).settings.ais_target_url
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


router.add_api_websocket_route("/ws", websocket)


async def _shard_response(request: Request, make_source, *, shard: str, object_name: str, comm: str,
                          object_path: str) -> Response:
    rt = runtime(request)
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


class ShardResponse(Response):
    """Streams a shard job's output (``httpreply.respond_http``): the status line once the first chunk or a
    complete answer exists, a hard abort on a failure after it."""

    def __init__(self, rt: Runtime, request: ShardRequest, source: Source | None, deadline: float):
        super().__init__()
        self.rt, self.request, self.source, self.deadline = rt, request, source, deadline

    async def __call__(self, scope, receive, send) -> None:
        cancel = threading.Event()
        source, body = self.source, None
        if source is None:  # the request body, read by the event loop as the driver (or a worker) asks for it
            source = body = BodySource(asyncio.get_running_loop(), cancel, pipe=self.rt.processes is not None)
        transport = transport_of(scope) if self.rt.settings.direct_send else None
        output = Output(self.request.shard, cancel=cancel, deadline=self.deadline,
                        input_done=body.complete if body is not None else None, may_go_direct=transport is not None)
        protocol = protocol_of(scope)
        if body is not None and body.piped and protocol is not None:
            body.sink_to(protocol)  # the body goes from the HTTP parser into the worker's pipe
        watcher = asyncio.create_task(body.pump(receive, cancel.set) if body is not None
                                      else watch_disconnect(receive, cancel.set))
        ShardJob(self.rt, self.request, source, output).start()
        received = (lambda: self._body_received(body)) if body is not None else None
        try:
            await respond_http(output, send, transport, received)
        finally:
            cancel.set()  # a no-op once the job is done; otherwise it stops the job's work
            watcher.cancel()
            if body is not None:
                body.close()

    async def _body_received(self, body: BodySource) -> None:
        """Before the response ends: the rest of the request body arrived (``BodySource.received``)."""
        if not await body.received(self.deadline - time.monotonic()):
            log.warning("shard %s: the request body did not end within the object timeout; ending the response "
                        "anyway", self.request.shard)


def _error(exc: TransformerError) -> Response:
    return PlainTextResponse(redact(exc.message), status_code=exc.status)
