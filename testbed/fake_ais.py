"""Fakes of what an ETL pod talks to: the AIS target's ETL object endpoint and disk, and a next ETL stage.

``FakeTarget`` behaves like ``/v1/etl/_object/<etl>/<secret>/<PathEscape(uname)>`` on an AIS target
(AIS's ais/tgtetl.go): hpull fetches (GET) and size checks (HEAD) are served from an
in-memory dict, direct puts (PUT) are recorded in full and answered ``200`` with an empty body. The uname must arrive as
**one** path segment, so the raw path is read from ``scope["raw_path"]`` (the decoded ``path`` would
hide a pod that unescaped ``%2F``). ``FakeStage`` is the next ETL of a pipeline: it records the PUT
it gets and answers ``200`` + bytes or ``204``. ``AisDisk`` is a target mountpath on local disk, where
objects lie as AIS stores them, for the FQN path.

Both can be told to misbehave per object (uname) or per path: answer a status, stall, or drop the
connection after part of the body. Each runs under uvicorn in a background thread on a free
127.0.0.1 port; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qsl, unquote

import uvicorn
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .aisnames import ETL_OBJECT_PREFIX, go_path_escape


@dataclass
class Fault:
    """How to misbehave for one object or path. Fields combine: stall first, then the rest."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    stall: float = 0.0  # seconds to wait before answering
    drop_after: int | None = None  # close the connection after this many body bytes (mid-body reset)
    reset: bool = False  # abort the connection instead of answering (after reading the request)
    times: int | None = None  # misbehave for the first N matching requests only; None = always


@dataclass
class Recorded:
    """One request as the fake saw it."""

    method: str
    raw_path: str  # exactly as on the wire, escaping kept
    query: str  # raw query string
    headers: dict[str, str]  # lower-case names
    body: bytes
    received_at: float  # time.monotonic() when the request arrived
    answered_at: float = 0.0  # time.monotonic() when the answer's first byte was sent

    @property
    def query_pairs(self) -> list[tuple[str, str]]:
        return parse_qsl(self.query, keep_blank_values=True)

    @property
    def query_dict(self) -> dict[str, str]:
        return dict(self.query_pairs)


class _Recorder:
    """Shared bookkeeping: the request log and the fault table, safe across threads; the server it runs on."""

    _served: _Served

    @property
    def port(self) -> int:
        return self._served.port

    @property
    def base_url(self) -> str:
        return self._served.base_url

    def start(self) -> Self:
        self._served.start()
        return self

    def stop(self) -> None:
        self._served.stop()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.faults: dict[str, Fault] = {}

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faults.clear()

    def set_fault(self, key: str, fault: Fault) -> None:
        """``key`` is a uname (target) or a raw path (stage); ``"*"`` applies to everything else."""
        with self._lock:
            self.faults[key] = fault

    def fault_for(self, key: str) -> Fault | None:
        """The fault for this request, counting it against ``times``."""
        with self._lock:
            fault = self.faults.get(key, self.faults.get("*"))
            if fault is None or fault.times is None:
                return fault
            if fault.times <= 0:
                return None
            fault.times -= 1
            return fault

    def record(self, entry: Recorded) -> None:
        with self._lock:
            self.requests.append(entry)

    def recorded(self, method: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if method is None or r.method == method]

    def wait_for(self, count: int, method: str | None = None, timeout: float = 10.0) -> list[Recorded]:
        """The recorded requests once at least ``count`` of them were answered (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            done = [r for r in self.recorded(method) if r.answered_at]
            if len(done) >= count or time.monotonic() > deadline:
                return done
            time.sleep(0.02)

    async def answer(self, send: Send, entry: Recorded, fault: Fault | None, status: int, body: bytes,
                     headers: dict[str, str] | None = None, size: int | None = None,
                     receive: Receive | None = None) -> None:
        """Send ``status`` + ``body`` unless ``fault`` says otherwise; stall, drop or reset as told.

        ``size`` is the Content-Length of a HEAD answer (which has no body).
        """
        if fault is not None:
            if fault.stall:
                await asyncio.sleep(fault.stall)
            if fault.reset and receive is not None:
                # ASGI has no "drop the connection"; uvicorn's receive is a bound method of the
                # request cycle, which holds the transport. Aborting it is a reset without an answer.
                entry.answered_at = time.monotonic()
                receive.__self__.transport.abort()
                return
            if fault.status != 200 or fault.body or fault.headers:
                status, body, headers, size = fault.status, fault.body, fault.headers, None
        length = len(body) if size is None else size
        # RFC 9110: no Content-Length (and no body) on 204.
        header_list = [] if status == 204 else [(b"content-length", str(length).encode())]
        header_list += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        entry.answered_at = time.monotonic()
        await send({"type": "http.response.start", "status": status, "headers": header_list})
        if fault is not None and fault.drop_after is not None:
            # Returning with the promised Content-Length unmet makes uvicorn close the connection:
            # the client sees the body end early (a reset from its point of view).
            await send({"type": "http.response.body", "body": body[: fault.drop_after], "more_body": True})
            return
        await send({"type": "http.response.body", "body": b"" if status == 204 else body})


async def _read_request(scope: Scope, receive: Receive) -> Recorded:
    request = Request(scope, receive)
    body = bytearray()
    async for chunk in request.stream():  # de-chunked by uvicorn; records chunked bodies in full
        body += chunk
    return Recorded(
        method=scope["method"],
        raw_path=scope["raw_path"].decode("latin-1"),
        query=scope["query_string"].decode("latin-1"),
        headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]},
        body=bytes(body),
        received_at=time.monotonic(),
    )


class _Served:
    """Runs an ASGI app under uvicorn in a daemon thread on a fresh 127.0.0.1 port.

    ``tls``: uvicorn's ``ssl_*`` options, to serve over https (e.g. a target that requires a client
    certificate: ``ssl_ca_certs`` and ``ssl_cert_reqs=ssl.CERT_REQUIRED``).
    """

    def __init__(self, app: Callable, **tls: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.scheme = "https" if tls else "http"
        config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False,
                                timeout_graceful_shutdown=1, timeout_keep_alive=30, **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake server on port {self.port} did not start within {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()


class FakeTarget(_Recorder):
    """The AIS target's pod-facing ETL object endpoint (``AIS_TARGET_URL``).

    Also serves ``GET /origin/<name>`` without a secret: an ordinary HTTP origin for ``/download``.
    """

    def __init__(self, etl_name: str = "wds-etl", secret: str = "Sec4et9XyZ") -> None:
        super().__init__()
        self.etl_name = etl_name
        self.secret = secret
        self.objects: dict[str, bytes] = {}  # uname -> bytes
        self.origin: dict[str, bytes] = {}  # name -> bytes, for /origin/<name>
        self._served = _Served(self)

    @property
    def etl_path(self) -> str:
        return f"{ETL_OBJECT_PREFIX}/{self.etl_name}/{self.secret}"

    @property
    def ais_target_url(self) -> str:
        """What AIS puts in the pod's ``AIS_TARGET_URL``."""
        return self.base_url + self.etl_path

    def reset(self) -> None:
        super().reset()
        self.objects.clear()
        self.origin.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        entry = await _read_request(scope, receive)
        self.record(entry)
        raw = entry.raw_path
        if raw.startswith("/origin/"):
            name = unquote(raw[len("/origin/"):])
            fault = self.fault_for(name)
            if name not in self.origin:
                await self.answer(send, entry, fault, 404, f"origin: {name} not found".encode())
            else:
                await self.answer(send, entry, fault, 200, self.origin[name])
            return
        parts = raw.split("/")  # ['', 'v1', 'etl', '_object', etl, secret, <escaped uname>...]
        if raw.startswith(ETL_OBJECT_PREFIX + "/") and len(parts) >= 7:
            if parts[5] != self.secret:  # ais/tgtetl.go: the ETL secret guards pod->target object I/O
                await self.answer(send, entry, None, 403, b"invalid ETL secret")
                return
            if len(parts) != 7 or not parts[6]:
                # AIS parses the rest as one escaped uname; an unescaped '/' means the pod broke it.
                await self.answer(send, entry, None, 400, f"uname is not one path segment: {raw}".encode())
                return
            uname = unquote(parts[6])
            fault = self.fault_for(uname)
            if entry.method in ("GET", "HEAD"):
                if uname not in self.objects:
                    await self.answer(send, entry, fault, 404, f"object {uname} does not exist".encode())
                elif entry.method == "HEAD":  # the object's size from metadata, no body
                    await self.answer(send, entry, fault, 200, b"", size=len(self.objects[uname]))
                else:
                    await self.answer(send, entry, fault, 200, self.objects[uname], receive=receive)
                return
            if entry.method == "PUT":
                # Success = 200 with an empty body (section 4.2).
                await self.answer(send, entry, fault, 200, b"", receive=receive)
                return
            await self.answer(send, entry, None, 405, b"method not allowed")
            return
        await self.answer(send, entry, None, 404, f"no route {raw}".encode())


class FakeStage(_Recorder):
    """The next ETL stage of a pipeline: records ``PUT /<bucket>/<obj>`` and answers as configured.

    ``reply`` is ``"echo"`` (``200`` + ``prefix`` + the body it got), ``"bytes"`` (``200`` +
    ``payload``) or ``"delivered"`` (``204``, as after its own direct put).
    """

    def __init__(self) -> None:
        super().__init__()
        self.reply = "echo"
        self.prefix = b"stage:"
        self.payload = b""
        self._served = _Served(self)

    def reset(self) -> None:
        super().reset()
        self.reply, self.prefix, self.payload = "echo", b"stage:", b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        entry = await _read_request(scope, receive)
        self.record(entry)
        fault = self.fault_for(entry.raw_path)
        if entry.method != "PUT":
            await self.answer(send, entry, fault, 405, b"stage accepts PUT only")
        elif self.reply == "delivered":
            await self.answer(send, entry, fault, 204, b"", {"Ais-Direct-Put-Length": str(len(entry.body))},
                              receive=receive)
        elif self.reply == "bytes":
            await self.answer(send, entry, fault, 200, self.payload, receive=receive)
        else:
            await self.answer(send, entry, fault, 200, self.prefix + entry.body, receive=receive)



class AisDisk:
    """A target mountpath on local disk: ``put`` stores an object where AIS would and returns its FQN."""

    def __init__(self, root: Path):
        self.root = root
        self.mountpath = root / "mp1"

    def fqn(self, bucket: str, name: str, provider: str = "ais") -> str:
        return str(self.mountpath / f"@{provider}" / bucket / "%ob" / name)

    def put(self, bucket: str, name: str, data: bytes, provider: str = "ais") -> str:
        path = Path(self.fqn(bucket, name, provider))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return str(path)


__all__ = ["AisDisk", "FakeStage", "FakeTarget", "Fault", "Recorded", "go_path_escape"]
