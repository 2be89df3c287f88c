"""The ETL secret, checked last: every line of every pod's whole log, and every error body the tests received.

AIS gives each ETL pod ``AIS_TARGET_URL = <target>/v1/etl/_object/<etl name>/<secret>``; the secret opens
every object of the cluster, and AIS shows the pod's log and its error bodies to every user. A check made
right after a request reads only what was logged by then; this one runs when a package's tests are done
and reads each pod's whole log file (deleted pods too) and every error body kept by ``BodyRecorder``,
for each pod's raw secret and its full ``AIS_TARGET_URL``. A log that was never written at DEBUG
proves little, so ``check_last`` also requires DEBUG lines in every pod that used the secret (its log
holds a masked ETL object URL) and, of pods that served objects (for each ETL asked for), one that used it.
"""

from __future__ import annotations

import functools
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

MASKED_URL = re.compile(r"/v1/etl/_object/[^/\s]+/\*\*\*")
DEBUG_LINE = re.compile(r" DEBUG \S+: ")  # the service's format: "<date> <time> DEBUG <logger>: <message>"
SERVED = re.compile(r'"(?:GET|PUT|POST) /(?!health\b)\S* HTTP/[\d.]+" \d{3}|"WebSocket /')  # uvicorn's access log
_SECRET = re.compile(r"[\w.~-]{6,}")  # shorter would match ordinary words; AIS's are 8+ characters


@dataclass(frozen=True)
class PodLog:
    """One pod (or service process) and its whole log file."""

    name: str
    path: Path
    target_url: str  # its AIS_TARGET_URL; '' when it had none
    level: str = "info"  # its ETL_LOG_LEVEL
    etl: str = ""  # the ETL it served

    @property
    def secret(self) -> str:
        """The last path segment of ``target_url`` ('' without one)."""
        return urlsplit(self.target_url).path.rstrip("/").rsplit("/", 1)[-1] if self.target_url else ""

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.is_file() else ""


@dataclass
class Body:
    """An error body as a test received it (all its chunks), and where it came from."""

    source: str
    data: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True)
class Leak:
    """A line that holds a secret: in which log or body, which line (1-based), whose secret."""

    where: str
    line: int
    what: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}, line {self.line}: {self.what}: {self.text[:400]}"


def needles(logs: Iterable[PodLog]) -> dict[str, str]:
    """What must appear nowhere -> whose it is: each pod's secret and full ``AIS_TARGET_URL``."""
    found: dict[str, str] = {}
    for log in logs:
        if not log.target_url:
            continue
        if not _SECRET.fullmatch(log.secret):
            raise ValueError(f"pod {log.name}: AIS_TARGET_URL {log.target_url!r} has no secret to look for")
        found.setdefault(log.secret, f"the ETL secret of pod {log.name}")
        found.setdefault(log.target_url, f"the AIS_TARGET_URL of pod {log.name}")
    return found


def _lines_with(text: str, where: str, looked_for: dict[str, str]) -> Iterator[Leak]:
    if not any(needle in text for needle in looked_for):
        return
    for number, line in enumerate(text.splitlines(), 1):
        for needle, what in looked_for.items():
            if needle in line:
                yield Leak(where, number, what, line)


def leaks(logs: Sequence[PodLog], bodies: Iterable[Body], looked_for: dict[str, str] | None = None) -> list[Leak]:
    """Every line of every log and body that holds any pod's secret or ``AIS_TARGET_URL``."""
    looked_for = needles(logs) if looked_for is None else looked_for
    found: list[Leak] = []
    for log in logs:
        found += _lines_with(log.text(), f"log of pod {log.name} ({log.path})", looked_for)
    for body in bodies:
        found += _lines_with(bytes(body.data).decode("utf-8", "replace"), f"error body of {body.source}", looked_for)
    return found


def debug_gaps(logs: Sequence[PodLog], etls: Iterable[str] = (), other_levels: Iterable[str] = ()) -> list[str]:
    """What makes the check weak: a pod that used the secret (a masked ETL object URL in its log) without
    running at DEBUG (unless its ETL is in ``other_levels``: one registered as a user would) or without a
    DEBUG line; pods that served objects (``etls``: those of each ETL given) none of which used the secret
    at DEBUG."""
    gaps = []
    served: set[str | None] = set()
    used: set[str | None] = set()
    for log in logs:
        text = log.text()
        if SERVED.search(text):
            served |= {None, log.etl}
        if not MASKED_URL.search(text):
            continue
        if log.level.lower() != "debug":
            if log.etl not in other_levels:
                gaps.append(f"pod {log.name} used the secret at ETL_LOG_LEVEL={log.level}, not debug ({log.path})")
        elif not DEBUG_LINE.search(text):
            gaps.append(f"pod {log.name} runs at debug but logged no DEBUG line ({log.path})")
        else:
            used |= {None, log.etl}
    gaps += [f"{'pods of ' + etl if etl else 'pods'} served objects, none used the secret at DEBUG (no masked "
             "ETL object URL in a DEBUG log)" for etl in [None, *etls] if etl in served and etl not in used]
    return gaps


def planted_is_found(logs: Sequence[PodLog]) -> str:
    """The check on a copy of a real log with a line holding its pod's secret planted in the middle: '' when
    it reports that pod, that file and that line, else what went wrong."""
    log = next((log for log in logs if log.target_url and log.text()), None)
    if log is None:
        return "no pod with a secret logged anything"
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "log"
        shutil.copyfile(log.path, copy)
        lines = copy.read_text(errors="replace").splitlines()
        at = len(lines) // 2
        lines.insert(at, f"planted: GET {log.target_url}/x")
        copy.write_text("\n".join(lines) + "\n")
        planted = PodLog(log.name, copy, log.target_url, log.level, log.etl)
        found = leaks([planted], [], needles(logs))
        if not any(leak.line == at + 1 and str(copy) in leak.where and log.name in leak.where for leak in found):
            return (f"a secret planted at line {at + 1} of a copy of {log.path} ({copy}: {len(planted.text())} "
                    f"characters read back) was not reported: {found}")
    return ""


def check_last(logs: Sequence[PodLog], bodies: Sequence[Body], etls: Iterable[str] = (),
               other_levels: Iterable[str] = ()) -> None:
    """Raise ``AssertionError`` naming every leak (pod or body, line), every gap of ``debug_gaps``, and a
    checker that misses a planted secret."""
    problems = [str(leak) for leak in leaks(logs, bodies)]
    problems += debug_gaps(logs, etls, other_levels)
    problems += [p for p in [planted_is_found(logs)] if p]
    summary = f"{len(logs)} pod logs and {len(bodies)} error bodies checked for {len(needles(logs))} secrets and URLs"
    assert not problems, summary + ":\n" + "\n".join(problems)


class BodyRecorder:
    """Keeps every error body (HTTP status >= 400, and ws text replies) the test process receives, where
    the tests receive them: urllib3's responses (``requests``, the aistore SDK and the client),
    ``httpx`` responses (sync and async) and ``websockets``' sync connections. Raw sockets are not seen."""

    def __init__(self) -> None:
        self.bodies: list[Body] = []
        self._undo: list[Callable[[], None]] = []

    def _body_of(self, response: object, source: Callable[[], str]) -> Body:
        body = getattr(response, "_secret_check_body", None)
        if body is None:
            try:
                where = source()
            except Exception:  # noqa: BLE001 (recording must never break the test it watches)
                where = f"a {type(response).__name__} whose URL is unknown"
            body = Body(where)
            response._secret_check_body = body  # type: ignore[attr-defined]
            self.bodies.append(body)
        return body

    def _patch(self, owner: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, functools.wraps(original)(wrap(original)))
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> BodyRecorder:
        import httpx
        import urllib3.response
        from websockets.sync.client import ClientConnection
        from websockets.sync.connection import Connection

        def urllib3_source(response) -> str:
            url, pool = response.url or "?", getattr(response, "_pool", None)
            if url.startswith("/") and pool is not None:
                url = f"{pool.scheme}://{pool.host}:{pool.port}{url}"
            return f"{url} (HTTP {response.status})"

        def httpx_source(response) -> str:
            return f"{response.request.method} {response.request.url} (HTTP {response.status_code})"

        def ws_source(connection) -> str:
            try:
                host, port = connection.remote_address[:2]
                peer = f"{host}:{port}"
            except OSError:  # the peer closed already
                peer = "?"
            return f"ws reply from {peer}{connection.request.path if connection.request else ''}"

        def urllib3_read(original):
            def read(response, *args, **kwargs):
                data = original(response, *args, **kwargs)
                if data and response.status >= 400:
                    self._body_of(response, lambda: urllib3_source(response)).data += data
                return data
            return read

        def urllib3_chunks(original):
            def read_chunked(response, *args, **kwargs):
                for data in original(response, *args, **kwargs):
                    if data and response.status >= 400:
                        self._body_of(response, lambda: urllib3_source(response)).data += data
                    yield data
            return read_chunked

        def httpx_iter(original):
            def iter_bytes(response, *args, **kwargs):
                for data in original(response, *args, **kwargs):
                    if data and response.status_code >= 400:
                        self._body_of(response, lambda: httpx_source(response)).data += data
                    yield data
            return iter_bytes

        def httpx_aiter(original):
            async def aiter_bytes(response, *args, **kwargs):
                async for data in original(response, *args, **kwargs):
                    if data and response.status_code >= 400:
                        self._body_of(response, lambda: httpx_source(response)).data += data
                    yield data
            return aiter_bytes

        def ws_recv(original):
            def recv(connection, *args, **kwargs):
                message = original(connection, *args, **kwargs)
                if isinstance(message, str) and isinstance(connection, ClientConnection):
                    self.bodies.append(Body(ws_source(connection), bytearray(message.encode())))
                return message
            return recv

        self._patch(urllib3.response.HTTPResponse, "read", urllib3_read)
        self._patch(urllib3.response.HTTPResponse, "read_chunked", urllib3_chunks)
        self._patch(httpx.Response, "iter_bytes", httpx_iter)
        self._patch(httpx.Response, "aiter_bytes", httpx_aiter)
        self._patch(Connection, "recv", ws_recv)
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
