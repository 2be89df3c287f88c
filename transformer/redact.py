"""Keeping the ETL secret out of everything the pod writes: log lines, tracebacks, error bodies.

AIS gives the pod ``AIS_TARGET_URL = <target>/v1/etl/_object/<etl name>/<secret>``; the secret opens
every object of the cluster to whoever holds it, and it travels in the path of every hpull fetch,
chunked-object size check and direct put. Libraries put URLs in their log lines (httpx logs each
request at INFO, httpcore its traces at DEBUG) and in their exceptions' messages, and AIS shows the
pod's log (``ais etl view-logs``) and its error bodies (``ais etl show errors``) to any user of the
cluster. So the secret is masked where text leaves the process, not where URLs are used:

* every log record, when it is made (``install_logging``: the record factory), and again in every
  handler (``RedactFilter``, also in the uvicorn log config of ``wds-transform serve``): the message,
  its arguments, the formatted traceback and stack;
* every error body and ws error reply (``redact`` / ``redact_bytes``, called by ``transformer.server``).

Masked: any ``/v1/etl/_object/<name>/<secret>`` path (``***`` for the secret, whoever's it is), and
the secret of this pod's ``AIS_TARGET_URL`` wherever it appears, escaped or not. Importing this module
changes nothing; ``configure`` and ``install_logging`` do.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from urllib.parse import quote, urlsplit

MASK = "***"
ETL_OBJECT_MARKER = "/v1/etl/_object/"
# <marker><etl name>/<secret>: the segment after the name is the secret (AIS's api/apc/urlpaths.go).
_ETL_PATH = re.compile(r"(/v1/etl/_object/[^/\s?#\"'<>\\]+/)([^/\s?#\"'<>\\]+)")
_ETL_PATH_BYTES = re.compile(_ETL_PATH.pattern.encode())
_MIN_SECRET = 4  # shorter "secrets" (a test URL's last segment) would mask ordinary words

_secrets: tuple[str, ...] = ()
_lock = threading.Lock()


def secret_of(ais_target_url: str) -> str:
    """The ETL secret in an ``AIS_TARGET_URL``: the segment after ``/v1/etl/_object/<name>/``, else the
    last path segment ('' when there is none)."""
    path = urlsplit(ais_target_url.strip()).path.rstrip("/")
    if ETL_OBJECT_MARKER in path:
        pieces = path.split(ETL_OBJECT_MARKER, 1)[1].split("/")
        return pieces[1] if len(pieces) > 1 else ""
    return path.rsplit("/", 1)[-1]


def configure(ais_target_url: str) -> None:
    """Mask the secret of ``ais_target_url`` from now on (added to those already known, never removed)."""
    global _secrets
    secret = secret_of(ais_target_url)
    if len(secret) < _MIN_SECRET:
        return
    forms = {secret, quote(secret, safe=""), quote(quote(secret, safe=""), safe="")}
    with _lock:
        # Longest first: a secret that contains another is masked whole.
        _secrets = tuple(sorted(set(_secrets) | forms, key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every ETL object path's secret and every known secret masked."""
    if ETL_OBJECT_MARKER in text:
        text = _ETL_PATH.sub(lambda m: m.group(1) + MASK, text)
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def redact_bytes(data: bytes) -> bytes:
    """``redact`` for a body: bytes in, bytes out (no decoding, so any body is safe to pass)."""
    if ETL_OBJECT_MARKER.encode() in data:
        data = _ETL_PATH_BYTES.sub(lambda m: m.group(1) + MASK.encode(), data)
    for secret in _secrets:
        encoded = secret.encode()
        if encoded in data:
            data = data.replace(encoded, MASK.encode())
    return data


# ------------------------------------------------------------------------------------------- logging


def redact_record(record: logging.LogRecord) -> None:
    """Mask ``record`` in place: message, arguments (each kept as is unless it shows a secret, so
    formatters that unpack them, such as uvicorn's access log, still work), traceback and stack."""
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    elif record.msg is not None:
        record.msg = _redact_arg(record.msg)
    if isinstance(record.args, tuple):
        record.args = tuple(_redact_arg(arg) for arg in record.args)
    elif isinstance(record.args, dict):
        record.args = {key: _redact_arg(value) for key, value in record.args.items()}
    if record.exc_info and not record.exc_text:
        # Formatted now, masked, and kept: every Formatter uses exc_text instead of formatting again.
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def _redact_arg(arg: object) -> object:
    if arg is None or isinstance(arg, bool | int | float):
        return arg  # may be formatted with %d or %f; holds no URL
    if isinstance(arg, bytes):
        return redact_bytes(arg)
    try:
        shown = arg if isinstance(arg, str) else str(arg)
    except Exception:  # unprintable: the handler reports that, showing nothing of it
        return arg
    masked = redact(shown)
    return arg if masked == shown else masked  # an httpx.URL holding the secret becomes its masked text


class RedactFilter(logging.Filter):
    """A handler filter that masks each record before it is formatted (see ``redact_record``).

    Built without arguments by ``logging.config.dictConfig`` (uvicorn's log config); the secret comes
    from ``configure``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


_base_factory = None


def _factory(*args, **kwargs) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    with contextlib.suppress(Exception):  # a log call must never fail here; the handlers' filter masks again
        redact_record(record)
    return record


def install_logging(ais_target_url: str) -> None:
    """Mask the secret of ``ais_target_url`` in every log record from now on, whichever logger or handler.

    The record factory masks each record as it is made (also those of loggers that do not propagate,
    and of handlers added later); every handler present gets a ``RedactFilter`` as well, for records
    that reach it another way. Warnings and unhandled exceptions of threads are logged, masked, rather
    than printed. Idempotent.
    """
    global _base_factory
    configure(ais_target_url)
    with _lock:
        if _base_factory is None:
            _base_factory = logging.getLogRecordFactory()
            logging.setLogRecordFactory(_factory)
    add_filter_to_handlers()
    logging.captureWarnings(True)  # warnings, too, become (masked) log records
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _log_thread_exception


def add_filter_to_handlers() -> None:
    """A ``RedactFilter`` on every handler of the root logger and of every named logger, once each."""
    loggers = [logging.getLogger()] + [logger for logger in logging.root.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, RedactFilter) for f in handler.filters):
                handler.addFilter(RedactFilter())


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("transformer").error("unhandled exception in thread %s", name,
                                           exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def uvicorn_log_config() -> dict:
    """uvicorn's default log config with a ``RedactFilter`` on each of its handlers (``wds-transform serve``)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact"] = {"()": f"{__name__}.RedactFilter"}
    for handler in config.get("handlers", {}).values():
        handler["filters"] = [*handler.get("filters", []), "redact"]
    return config
