"""The AIS ETL contract over HTTP and WebSocket (docs/ais-contract.md).

Routes: ``PUT /<bucket>/<obj>`` (hpush), ``GET /<PathEscape(uname)>`` (hpull), ``WS /ws``,
``POST /download``, ``GET /health``, ``GET /metrics``. Each shard request becomes a ``ShardJob``;
this module only decides where its input comes from and where its output goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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

from ..config import Settings
from ..engine import TransformPool
from ..errors import Cancelled, OptionsError, RequestError, TransformerError, UpstreamError
from ..options import forwarded_etl_args, parse_etl_args
from . import direct
from .hops import HEADER_NODE_URL, parse_node_url
from .jobs import (
    BodySource,
    BytesSource,
    Final,
    HttpSource,
    Runtime,
    ShardJob,
    Source,
    fqn_source,
    shard_too_large,
    watch_disconnect,
)
from .metrics import Metrics
from .wsstream import FragmentingWebSocketProtocol, fragmenter_of

log = logging.getLogger("transformer.server")

TAR_CONTENT_TYPE = "application/x-tar"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state: dict[str, Runtime] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        runtime = Runtime(
            settings=settings,
            pool=TransformPool(settings.workers, settings.max_inflight),
            client=_http_client(settings),
            metrics=Metrics(),
        )
        state["runtime"] = runtime
        log.info("transformer ready: %d workers, window %d, preset %s, obj_timeout %.0fs",
                 settings.workers, settings.window, settings.preset, settings.obj_timeout)
        try:
            yield
        finally:
            runtime.pool.shutdown()
            runtime.client.close()

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
        return await _shard_response(request, lambda rt, job_deadline: HttpSource(rt.client, url, job_deadline),
                                     shard=name, object_name=name, comm="download", object_path=name)

    @app.put("/{path:path}")
    async def hpush(path: str, request: Request) -> Response:
        """hpush: ``PUT /<bucket>/<obj>``, input from ``etl_fqn`` (empty body) or the body."""
        fqn = request.query_params.get("etl_fqn")
        object_name = path.split("/", 1)[1] if "/" in path else path
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
            return fqn_source(fqn, rt, deadline, shard=shard, object_name=object_name, uname=uname)

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
        return ShardResponse(rt, source, options, hop, shard=shard, object_name=object_name, comm=comm)

    @app.websocket("/ws")
    async def websocket(ws: WebSocket) -> None:
        await serve_websocket(ws, runtime())

    return app


class ShardResponse(Response):
    """Streams a shard job's output with a deferred start and a hard abort on late failure.

    The status line is sent only when the first output chunk (or a complete answer) exists, so an
    unreadable shard or a bad first sample is still a proper 4xx/5xx. After that, a failure raises
    out of the ASGI call: uvicorn then closes the connection without the final chunk, so the caller
    sees a broken transfer, never a cleanly terminated, truncated tar.
    """

    def __init__(self, rt: Runtime, source: Source | None, options, hop, *, shard: str, object_name: str, comm: str):
        super().__init__()
        self.rt, self.source, self.options, self.hop = rt, source, options, hop
        self.shard, self.object_name, self.comm = shard, object_name, comm

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        job = ShardJob(self.rt, BytesSource(b""), self.options, shard=self.shard, object_name=self.object_name,
                       hop=self.hop, comm=self.comm)
        if self.source is None:
            body = BodySource(loop, job.cancel)
            job.source = body
            watcher = asyncio.create_task(body.pump(receive, job.cancel.set))
        else:
            job.source = self.source
            watcher = asyncio.create_task(watch_disconnect(receive, job.cancel.set))
        transport = direct.transport_of(scope) if self.rt.settings.direct_send else None
        if transport is not None:
            job.handoff = threading.Event()
        job.start()
        finished = False
        try:
            item = await job.next_item()
            if isinstance(item, BaseException):
                finished = True
                await _send_whole(send, *_error_parts(item))
                return
            if isinstance(item, Final):
                finished = True
                await _send_whole(send, item.status, item.body, item.headers or {})
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", TAR_CONTENT_TYPE.encode())]})
            first = True
            while item is not None:
                if isinstance(item, BaseException):
                    raise StreamAborted(f"aborting the response of shard '{self.shard}' after "
                                        f"{job.report.bytes_out} bytes: {item}") from item
                await send({"type": "http.response.body", "body": bytes(item), "more_body": True})
                if first and transport is not None:
                    # uvicorn wrote the status line and the first chunk: the driver may take the socket.
                    ready = await direct.drained(transport, direct.STALL_SECONDS)
                    job.go_direct((lambda: direct.DirectSender(loop, transport)) if ready else None)
                first = False
                item = await job.next_item()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        finally:
            if not finished:
                job.cancel.set()
            watcher.cancel()


class StreamAborted(Exception):
    """Raised out of the ASGI app so the server drops the connection mid-body (on purpose)."""


async def _send_whole(send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if status != 204:
        raw_headers.append((b"content-type", b"text/plain; charset=utf-8"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": b"" if status == 204 else body})


def _error_parts(exc: BaseException) -> tuple[int, bytes, dict[str, str]]:
    if isinstance(exc, TransformerError):
        return exc.status, exc.message.encode(), {}
    return 500, f"internal error: {exc!r}".encode(), {}


def _error(exc: TransformerError) -> Response:
    return PlainTextResponse(exc.message, status_code=exc.status)


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
    (wsstream.py); a failure after its first frame completes any frame cut short and ends the
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
    reply: _WsReply | Final | None = None
    try:
        reply = await _ws_request(ws, rt, control, pipeline, fragmenter)
        if isinstance(reply, Final):
            await ws.send_text(reply.headers.get("Ais-Direct-Put-Length", "0") if reply.headers else "0")
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
    if isinstance(reply, _WsReply) and reply.frames_sent > 0 and fragmenter is not None:
        await reply.end_with_error(fragmenter, body)  # the message already began: its last frame
    elif fragmenter is not None:
        await fragmenter.send_frame(body, first=True, fin=True, deadline=None)
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
    return json.dumps({"message": message, "status": status, "object": path}).encode()


def _control_message(message: dict[str, Any]) -> dict[str, Any] | None:
    raw = message.get("bytes") if message.get("bytes") is not None else (message.get("text") or "").encode()
    try:
        control = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return control if isinstance(control, dict) else None


async def _ws_request(ws: WebSocket, rt: Runtime, control: dict[str, Any], pipeline: str,
                      fragmenter: FragmentingWebSocketProtocol | None) -> _WsReply | Final:
    path = str(control.get("path") or "")
    etl_args = str(control.get("etl_args") or "")
    fqn = control.get("fqn")
    if fqn:
        # Single-encoded in the ws JSON: resolve_fqn's one percent-decode is the only one.
        source: Source = fqn_source(str(fqn), rt, time.monotonic() + rt.settings.obj_timeout, shard=path,
                                    object_name=path)
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
    try:
        options = parse_etl_args(etl_args, rt.settings)
    except OptionsError:
        raise
    hop = parse_node_url(pipeline or None, path, forwarded_etl_args(etl_args), rt.settings.ais_target_url)
    job = ShardJob(rt, source, options, shard=path, object_name=path, hop=hop, comm="ws")
    if fragmenter is not None and rt.settings.direct_send:
        job.handoff = threading.Event()  # the reply's threads may write its frames (_WsReply.send)
    job.start()
    reply = _WsReply(job, path)
    try:
        first = await reply.next()
    except BaseException:
        job.cancel.set()
        raise
    if isinstance(first, Final):
        job.cancel.set()
        return first
    reply.first = first
    return reply


class _WsReply:
    """A ws reply whose first chunk is ready (so a failure before it is still an ordinary error reply)."""

    def __init__(self, job: ShardJob, path: str):
        self.job, self.path = job, path
        self.first: bytes | memoryview | None = None
        self.frames_sent = 0

    async def next(self) -> bytes | memoryview | Final | None:
        """The job's next output chunk, its ``Final`` (a direct put or a next hop's answer), or None at the end."""
        item = await self.job.next_item()
        if item is None or isinstance(item, (bytes, bytearray, memoryview)):
            return item
        if isinstance(item, BaseException):
            raise item if isinstance(item, TransformerError) else TransformerError(repr(item))
        if isinstance(item, Final):
            if item.status == 204:
                return item
            raise UpstreamError(f"ws request {self.path!r}: next hop answered {item.status}: "
                                f"{item.body[:300].decode('utf-8', 'replace')}", item.status)
        return item

    async def _chunks(self):
        chunk = self.first
        while chunk is not None:
            if isinstance(chunk, Final):
                raise TransformerError(f"ws request {self.path!r}: a direct put answered after output began")
            yield chunk
            chunk = await self.next()

    async def whole(self) -> bytes:
        """Every chunk, joined: the message for a server that cannot send frame by frame."""
        try:
            return b"".join([chunk async for chunk in self._chunks()])
        finally:
            self.job.cancel.set()

    async def send(self, fragmenter: FragmentingWebSocketProtocol) -> None:
        """The reply as one Binary message of many frames, each sent as the shard's output arrives.

        With direct send, the first frame goes out here, then the shard's threads write the frames
        that follow (direct.py, as for HTTP responses); the last frame, with FIN, goes out here again,
        so websockets' own state stays right. Without it, every frame goes out here.
        """
        held = None  # one chunk held back, so the last frame carries data and FIN
        deadline = self.job.deadline
        try:
            async for chunk in self._chunks():
                if held is not None:
                    await self._frame(fragmenter, held, fin=False, deadline=deadline)
                held = chunk
                if self.frames_sent == 0 and self.job.handoff is not None:
                    # The job waits for go_direct() after its first chunk: it cannot be held back.
                    await self._frame(fragmenter, held, fin=False, deadline=deadline)
                    held = None
                    await self._go_direct(fragmenter)
            await self._frame(fragmenter, held if held is not None else b"", fin=True, deadline=deadline)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            raise TransformerError(f"ws request {self.path!r}: the reply was not read within the object "
                                   "timeout") from None
        finally:
            self.job.cancel.set()
            fragmenter.threads_write(False)

    async def end_with_error(self, fragmenter: FragmentingWebSocketProtocol, body: bytes) -> None:
        """After a failure: the message already begun ends with ``body`` as its last frame (FIN).

        ``send`` has returned (the job is cancelled, the shard's threads write no more, a frame they
        cut short was completed through the transport, pongs held back went out). Written without
        waiting for the peer to read: it is small, and it must follow at once for the next reply to
        start at a message boundary, also after the object timeout.
        """
        await fragmenter.send_frame(body, first=False, fin=True, deadline=None)
        self.frames_sent += 1

    async def _frame(self, fragmenter: FragmentingWebSocketProtocol, data: bytes | memoryview, *, fin: bool,
                     deadline: float) -> None:
        await fragmenter.send_frame(data, first=self.frames_sent == 0, fin=fin, deadline=deadline)
        self.frames_sent += 1

    async def _go_direct(self, fragmenter: FragmentingWebSocketProtocol) -> None:
        """After the first frame: the shard's threads write the next ones, once the transport is empty.

        Not with a per-message extension (compression: ``serve`` turns it off), whose frames only
        websockets can build.
        """
        transport = fragmenter.transport
        ready = not fragmenter.conn.extensions and await direct.drained(transport, direct.STALL_SECONDS)
        if ready:
            fragmenter.threads_write(True)  # no pong of ours may land inside a frame being written
        loop = asyncio.get_running_loop()
        self.job.go_direct((lambda: direct.DirectSender(loop, transport, frame=direct.ws_continuation_frame,
                                                        protocol_ends_message=True)) if ready else None)


def _http_client(settings: Settings) -> httpx.Client:
    # TLS to AIS targets (hpull fetch, size check, direct put): AIS_CLIENT_CA, AIS_SKIP_VERIFY_CRT and the
    # client certificate AIS_CRT + AIS_CRT_KEY (mutual TLS), checked when the settings were read.
    verify = settings.ais_tls()
    # Idle connections expire before the target's own 6 s idle timeout would close them under us.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=4.0)
    return httpx.Client(verify=verify, limits=limits, follow_redirects=False, timeout=settings.obj_timeout)
