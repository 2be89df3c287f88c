"""The AIS ETL contract over WebSocket: ``WS /ws``, one reply per request, in order, on one connection."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect
from uvicorn.protocols.utils import ClientDisconnected

from ..errors import Cancelled, FrameCut, RequestError, TransformerError
from ..options import forwarded_etl_args, parse_etl_args
from ..redact import redact
from .hops import parse_node_url
from .jobs import Runtime, ShardJob, ShardRequest
from .output import Final, Output
from .protocols import FragmentingWebSocketProtocol, fragmenter_of
from .sources import BytesSource, Source, fqn_source, shard_too_large
from .wsreply import WsReply, send_ws_frame

log = logging.getLogger("transformer.server")


async def websocket(ws: WebSocket) -> None:
    """The ``/ws`` route: the connection served with the app's runtime."""
    await serve_websocket(ws, ws.app.state.runtime)


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
    (wsreply.py); a failure after its first frame completes any frame cut short and ends the
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
            if fragmenter is not None:
                fragmenter.replying(True)
            try:
                served = await _ws_serve_one(ws, rt, control, fragmenter)
            finally:
                if fragmenter is not None and not fragmenter.replying(False):
                    served = False  # the server is stopping: this reply was the connection's last
            if not served:
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
    if isinstance(failure, FrameCut):
        await ws.close(code=1011, reason="a reply was cut in the middle of a frame")
        return False
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
