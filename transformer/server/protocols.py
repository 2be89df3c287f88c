"""uvicorn's protocols, subclassed only to expose what a shard response needs (direct.py, wsreply.py).

* ``DirectSendProtocol`` (httptools): each request's ASGI scope also carries the connection's
  transport, so the shard's driver thread may write the body's frames itself (direct send), and the
  protocol, which can hand a request body to a sink as it is parsed (``sink_body``): into the pipe a
  worker process reads, with no ASGI ``receive`` round trip and no copy per chunk in between.
* ``FragmentingWebSocketProtocol`` (websockets, sans-I/O): the ASGI scope carries the protocol, so a
  ws reply can leave as a fragmented message (``wsreply.send_ws_frame``), and the protocol holds the
  pongs it owes while the shard's threads write frames, so none lands inside one.

Why a fragmented ws message: ASGI sends a WebSocket message whole, and AIS wants one message per
object, so a 1,000-image float32 shard would be a 600 MB reply held in memory, then copied twice
by uvicorn. RFC 6455 lets one message travel as several frames (section 5.4) and AIS's reader
(gorilla ``NextReader``) reassembles them. Without these classes (another server, h11,
``ETL_DIRECT_SEND=false``) the service still works: every chunk takes the ASGI path and a ws reply is
sent whole.

These classes read uvicorn's protocol attributes (``scope``, ``transport``, ``conn``, ``writable``);
``pyproject.toml`` pins the uvicorn range they were written for and tests/test_dependency_floors.py
runs the service on its floor.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request

DIRECT_EXTENSION = "transformer.direct_send"
WS_EXTENSION = "transformer.ws_fragments"


class BodySink(Protocol):
    """Where ``DirectSendProtocol.sink_body`` sends a request's body (event loop only)."""

    def feed(self, data: bytes, flow: FlowControl) -> None: ...  # may pause reading until it has room

    def finish(self) -> None: ...  # the body's end

    def fail(self) -> None: ...  # the connection was lost before it


class DirectSendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; each request's scope also carries the connection's transport and the
    protocol itself, whose request body can go to a ``BodySink`` instead of ASGI ``receive``."""

    _sink: BodySink | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._sink = None
        self.scope["extensions"] = {DIRECT_EXTENSION: {"transport": self.transport, "protocol": self}}

    def sink_body(self, sink: BodySink) -> None:
        """From now on this request's body goes to ``sink`` as httptools parses it (event loop), what arrived
        already first. ``receive`` must not be called until the sink heard the body's end (it would resume
        reading the socket whatever the sink's room)."""
        self._sink = sink
        cycle = self.cycle
        data, cycle.body = cycle.body, b""
        self.flow.resume_reading()  # uvicorn pauses with 64 KiB kept for receive: from here the sink decides
        if data:
            sink.feed(data, self.flow)
        if not cycle.more_body:
            sink.finish()

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is None:
            super().on_body(body)
        elif not self.cycle.response_complete:
            sink.feed(body, self.flow)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._sink is not None:
            self._sink.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._sink is not None:
            self._sink.fail()
        super().connection_lost(exc)


def protocol_of(scope: dict) -> DirectSendProtocol | None:
    """The connection's protocol, when it can hand a request body to a sink."""
    extension = (scope.get("extensions") or {}).get(DIRECT_EXTENSION)
    return extension.get("protocol") if extension else None


def transport_of(scope: dict) -> asyncio.Transport | None:
    """The connection's transport when this response may use direct send (a body to send, no TLS)."""
    extension = (scope.get("extensions") or {}).get(DIRECT_EXTENSION)
    if not extension or scope.get("method") == "HEAD":
        return None
    transport = extension.get("transport")
    return None if transport is None or encrypted(transport) else transport


def encrypted(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection is TLS: only the transport's SSL object may write such a socket.

    asyncio's and uvloop's SSL transports name their context and SSL object.
    """
    return transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None


class FragmentingWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets (sans-I/O) protocol that lets a reply be sent frame by frame."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._threads_write = False
        self.lost = False  # the connection is gone: known from asyncio's connection_lost, not uvicorn's state
        self._replying = False  # a request's reply is being made or sent
        self._draining = False  # the server is stopping: close once that reply is out

    def shutdown(self) -> None:
        """The server is stopping (SIGTERM: Kubernetes deleting the pod): a reply in progress goes out whole first,
        then the connection closes with 1012 as uvicorn closes an idle one at once. A drain is not a failure: the
        close would otherwise land in the middle of the reply's message."""
        if self._replying and not self.lost:
            self._draining = True
            self.stop_keepalive()
            return
        super().shutdown()

    def replying(self, active: bool) -> bool:
        """Mark a reply begun or ended (event loop only); False once it ended while the server is stopping: the
        connection is closed, and the session takes no other request."""
        self._replying = active
        if not active and self._draining:
            super().shutdown()
            return False
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        super().connection_lost(exc)

    def threads_write(self, active: bool) -> None:
        """Whether the shard's threads write frames to the socket (direct send; event loop only).

        Meanwhile a pong this protocol owes stays in websockets' outgoing buffer: written now it could
        land inside a frame being written. It goes out with the next frame sent by the event loop (the
        reply's last; control frames may come between fragments, RFC 6455 5.4), or at the end of the
        hold. Reading goes on, so a next request is still read ahead as before.
        """
        self._threads_write = active
        if not active:
            pending = self.conn.data_to_send()
            if pending and not self.transport.is_closing():
                self.transport.write(b"".join(pending))

    def handle_ping(self) -> None:
        if not self._threads_write:
            super().handle_ping()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # only set when the handshake is accepted
        if scope is not None:
            scope["extensions"][WS_EXTENSION] = self


def fragmenter_of(scope: dict) -> FragmentingWebSocketProtocol | None:
    return (scope.get("extensions") or {}).get(WS_EXTENSION)
