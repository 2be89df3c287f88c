"""Where the output goes after this pod: ``Ais-Node-Url`` parsing, direct put, the next ETL stage.

Grammar (AIS's api/apc/etl.go, ais/tgtobj.go): a comma-separated list; an entry **with a URL path** is the
destination target (direct put, always last), an entry **without a path** is the next ETL stage.
We classify by that rule and never by response body length, so an empty output is still correct.

Object paths: a destination entry's path is used escaped exactly as it arrived (one segment, AIS's
``PathEscape(uname)``); the path sent to a next stage is escaped here from the decoded object path
(``stage_path``), so the stage decodes back the very path this pod was called with, whatever the
object name holds (spaces, ``#``, ``?``, ``%``, non-ASCII).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

from ..errors import RequestError, TransformerError, UpstreamError
from ..redact import redact

HEADER_NODE_URL = "Ais-Node-Url"
HEADER_DIRECT_PUT_LENGTH = "Ais-Direct-Put-Length"
HEADER_RETRY_REASON = "Ais-Etl-Retry-Reason"
RETRY_REASON_TRANSIENT = "direct-put-transient"

# Connection-level failures before the destination answered: worth another attempt.
TRANSIENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                    httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)
# TLS errors that are a connection cut short, not a refusal (those may pass on another attempt).
_TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
            ssl.SSLWantWriteError)


@dataclass(frozen=True)
class DirectPutTarget:
    """The destination target: the output is PUT there and this pod answers 204 on its 200."""

    url: str


@dataclass(frozen=True)
class EtlStage:
    """The next ETL of a pipeline: it gets the output as its input, with the rest of the list."""

    url: str
    remaining: str  # value of Ais-Node-Url for the next stage ('' = omit the header)


NextHop = DirectPutTarget | EtlStage


def parse_node_url(value: str | None, object_path: str, etl_args: str, ais_target_url: str) -> NextHop | None:
    """The first hop of an ``Ais-Node-Url`` list, or ``None`` when there is none.

    ``object_path`` is the decoded path this pod was called with (``<bucket>/<obj>`` for hpush, the
    uname for hpull, the object name for ws); a next stage gets it escaped (``stage_path``) and
    decodes back the same path.
    """
    if value is None or value == "":
        return None
    entries = [entry.strip() for entry in value.split(",")]
    if any(not entry for entry in entries):
        raise RequestError(f"malformed {HEADER_NODE_URL} header {value!r}: empty entry")
    first, rest = entries[0], entries[1:]
    parts = urlsplit(first)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RequestError(f"malformed {HEADER_NODE_URL} entry {first!r}: expected http(s)://host:port[/path]")
    if parts.path not in ("", "/"):
        if rest:
            raise RequestError(f"malformed {HEADER_NODE_URL} header: destination {first!r} is not the last entry")
        if not ais_target_url:
            raise RequestError("direct put requested but AIS_TARGET_URL is not set in this pod", status=500)
        target = urlsplit(ais_target_url)
        # Keep the entry's path escaped exactly as received (one segment: the escaped uname).
        query = "&".join(q for q in (parts.query, _encoded_args(etl_args)) if q)
        url = f"{target.scheme}://{parts.netloc}{target.path}{parts.path}" + (f"?{query}" if query else "")
        return DirectPutTarget(url=url)
    query = _encoded_args(etl_args)
    url = f"{parts.scheme}://{parts.netloc}/{stage_path(object_path)}" + (f"?{query}" if query else "")
    return EtlStage(url=url, remaining=",".join(rest))


def stage_path(object_path: str) -> str:
    """The decoded object path as the request-target path of a next-stage PUT (after its leading '/').

    Escaped as the aistore SDK's server does (``quote(path, safe="/@")``): every byte outside the
    unreserved set, '/' and '@' is percent-encoded (UTF-8 for non-ASCII), so ``%`` ``#`` ``?`` and
    spaces survive and the stage's one percent-decode gives the path back. A leading '/' (an object
    name that starts with one) is written ``%2F``, so the URL does not begin with '//'.
    """
    try:
        escaped = quote(object_path, safe="/@")
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a ws control message's "\ud800"
        raise RequestError(f"object path {object_path!r} is not valid Unicode") from None
    return "%2F" + escaped[1:] if escaped.startswith("/") else escaped


def _encoded_args(etl_args: str) -> str:
    return str(httpx.QueryParams({"etl_args": etl_args})) if etl_args else ""


@dataclass
class HopResult:
    """What the next hop answered: 204 (delivered) or 200 with a body stream to relay."""

    status: int
    body: Iterator[bytes] | None = None
    delivered_bytes: int = 0


def put_stream(
    client: httpx.Client,
    url: str,
    make_body: Callable[[], Iterable[bytes | memoryview]],
    *,
    headers: dict[str, str],
    deadline: float,
    replayable: bool,
) -> httpx.Response:
    """PUT a streamed body, retrying transient failures until ``deadline``; returns an open response.

    A body that has not started is always re-sendable; once bytes went out, another attempt needs a
    fresh body (``make_body`` re-reads and re-transforms the input), so it is tried only when the
    input is ``replayable`` (a local file or an hpull fetch, not a one-shot request body).
    """
    attempt = 0
    failed: Exception | None = None  # the previous attempt's failure
    while True:
        attempt += 1
        consumed = False

        def body() -> Iterator[bytes]:
            nonlocal consumed
            for chunk in make_body():
                consumed = True
                yield bytes(chunk) if isinstance(chunk, memoryview) else chunk

        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _gave_up(url, attempt - 1, failed)
        timeout = httpx.Timeout(remaining, connect=min(5.0, remaining))
        try:
            request = client.build_request("PUT", url, content=body(), headers=headers, timeout=timeout)
            response = client.send(request, stream=True)
        except TransformerError:
            # The body's own failure. Re-transforming for a retry that the object timeout cut short
            # fails on that deadline; what the caller must fix is why the earlier attempts failed.
            if failed is not None and time.monotonic() >= deadline:
                raise _gave_up(url, attempt, failed) from None
            raise
        except TRANSIENT_ERRORS as exc:
            if tls_refused(exc):  # a certificate refused: the same on every attempt
                raise UpstreamError(f"PUT {_short(url)}: {exc.__class__.__name__}: {exc}{https_hint(url, exc)}",
                                    502, transient=False) from None
            error: Exception = exc
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"PUT {_short(url)}: timed out ({exc.__class__.__name__})", 504) from None
        else:
            if response.status_code < 500 or response.status_code == 507:
                return response
            response.read()
            response.close()
            error = UpstreamError(f"PUT {_short(url)}: {response.status_code} {redact(response.text)[:300]}",
                                  response.status_code, response.content)
        if consumed and not replayable:
            raise _transient(url, error)
        delay = min(0.25 * 2 ** (attempt - 1), 4.0)
        if time.monotonic() + delay >= deadline:
            raise _transient(url, error)
        failed = error
        time.sleep(delay)


def _gave_up(url: str, attempts: int, failed: Exception | None) -> UpstreamError:
    """The object timeout ended the retries: the last attempt's failure, which says what to fix, and that."""
    timeout = f"object timeout exceeded after {attempts} attempt(s)"
    if failed is None:
        return UpstreamError(f"PUT {_short(url)}: {timeout}", 504)
    last = _transient(url, failed)
    return UpstreamError(f"{last.message} ({timeout})", last.status, last.body, last.transient)


def _transient(url: str, error: Exception) -> UpstreamError:
    if isinstance(error, UpstreamError):
        return error
    return UpstreamError(f"PUT {_short(url)}: {error.__class__.__name__}: {error}{https_hint(url, error)}", 502)


def tls_refused(exc: BaseException) -> bool:
    """Whether TLS itself refused the connection (a certificate or an alert), found in the exception's chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLError) and not isinstance(current, _TLS_CUT):
            return True
        current = current.__cause__ or current.__context__
    return False


def https_hint(url: str, exc: BaseException) -> str:
    """What to check after a failed https call to an AIS target ('' for http or an ordinary failure).

    A target that requires a client certificate and gets none may just close the connection after the
    handshake (TLS 1.3 checks the client's certificate only then), which alone reads as a dropped
    connection.
    """
    if not url.startswith("https://"):
        return ""
    if tls_refused(exc):
        return " (TLS refused: check AIS_CLIENT_CA or AIS_SKIP_VERIFY_CRT, and AIS_CRT + AIS_CRT_KEY if the target " \
               "requires a client certificate)"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.ConnectError):
        return " (over https: does the target require a client certificate, AIS_CRT + AIS_CRT_KEY, that it did " \
               "not get or does not accept?)"
    return ""


def no_secret(url: str) -> str:
    """A URL fit for logs and error bodies: the ETL secret in an AIS target's ETL object path is masked.

    ``<marker><etl name>/<secret>/<uname>``: the secret opens every object of the cluster
    (``transformer.redact``, which also masks it in every log line and error body).
    """
    return redact(url)


def _short(url: str) -> str:
    """The URL for logs and error bodies: no query, and no ETL secret (``no_secret``)."""
    parts = urlsplit(no_secret(url))
    return f"{parts.scheme}://{parts.netloc}{parts.path}"
