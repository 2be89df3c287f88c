"""transformer.redact: the ETL secret masked in text, bodies and log records, whichever logger or handler.

The service run at DEBUG against every path is tests/reliability/test_secret_out_of_logs.py; here are
the pieces: what is masked, that a record keeps what its formatter needs, that tracebacks are masked,
and that records of loggers that do not propagate, and of handlers added later, are masked too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import logging.config
import threading
import warnings
from collections.abc import Iterator

import httpx
import pytest

from transformer import redact

SECRET = "Ab3dEf9hIjK"
TARGET = f"http://10.0.0.5:51081/v1/etl/_object/wds-etl/{SECRET}"


@pytest.fixture
def masking() -> Iterator[None]:
    """``install_logging(TARGET)``, undone afterwards (record factory, thread hook, known secrets)."""
    saved = (logging.getLogRecordFactory(), threading.excepthook, redact._secrets, redact._base_factory)
    redact.install_logging(TARGET)
    try:
        yield
    finally:
        logging.setLogRecordFactory(saved[0])
        logging.captureWarnings(False)
        threading.excepthook = saved[1]
        redact._secrets, redact._base_factory = saved[2], saved[3]
        for logger in [logging.getLogger()] + list(logging.root.manager.loggerDict.values()):
            for handler in getattr(logger, "handlers", []):
                for f in [f for f in handler.filters if isinstance(f, redact.RedactFilter)]:
                    handler.removeFilter(f)


def _captured(name: str, *, propagate: bool = True) -> tuple[logging.Logger, io.StringIO]:
    logger = logging.getLogger(name)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = propagate
    return logger, stream


@pytest.mark.parametrize(("url", "secret"), [
    (TARGET, SECRET),
    (TARGET + "/", SECRET),
    ("https://t:1/v1/etl/_object/name/s3cr3t/extra", "s3cr3t"),
    ("http://127.0.0.1:9/some/path/TokenXYZ", "TokenXYZ"),
    ("http://127.0.0.1:9", ""),
    ("", ""),
])
def test_the_secret_of_a_target_url(url: str, secret: str) -> None:
    assert redact.secret_of(url) == secret


def test_any_etl_object_path_and_the_known_secret_are_masked(masking: None) -> None:
    other = "http://t:1/v1/etl/_object/other-etl/OtherSecret1/ais%2F@%23%2Fb%2Fo"
    assert redact.redact(other) == "http://t:1/v1/etl/_object/other-etl/***/ais%2F@%23%2Fb%2Fo"
    assert redact.redact(f"{TARGET}/ais%2F@%23%2Fb%2Fo?x=1") == \
        "http://10.0.0.5:51081/v1/etl/_object/wds-etl/***/ais%2F@%23%2Fb%2Fo?x=1"
    assert redact.redact(f"url_path%3D%2Fv1%2F{SECRET}%2F") == "url_path%3D%2Fv1%2F***%2F"  # escaped: no marker
    assert redact.redact_bytes(b'{"url_path":"/v1/etl/_object/wds-etl/' + SECRET.encode() + b'/x"}') == \
        b'{"url_path":"/v1/etl/_object/wds-etl/***/x"}'
    assert redact.redact("nothing to hide") == "nothing to hide"


def test_a_short_last_segment_is_not_taken_for_a_secret() -> None:
    saved = redact._secrets
    try:
        redact.configure("http://127.0.0.1:9/v1")
        assert redact.redact("v1 stays") == "v1 stays"
    finally:
        redact._secrets = saved


def test_httpx_request_line_is_masked_and_the_args_keep_their_types(masking: None) -> None:
    logger, stream = _captured("httpx")
    url = httpx.URL(f"{TARGET}/ais%2F@%23%2Fb%2Fo")
    logger.info('HTTP Request: %s %s "%s %d %s"', "GET", url, "HTTP/1.1", 200, "OK")
    assert stream.getvalue() == ('INFO httpx: HTTP Request: GET http://10.0.0.5:51081/v1/etl/_object/wds-etl/***/'
                                 'ais%2F@%23%2Fb%2Fo "HTTP/1.1 200 OK"\n')


def test_tracebacks_are_masked(masking: None) -> None:
    logger, stream = _captured("transformer.server")
    try:
        raise httpx.ConnectError(f"cannot reach {TARGET}/x", request=httpx.Request("GET", f"{TARGET}/x"))
    except httpx.ConnectError:
        logger.exception("shard %s: unexpected error", "b/o")
    text = stream.getvalue()
    assert "Traceback" in text and "ConnectError: cannot reach" in text
    assert SECRET not in text and "/wds-etl/***/x" in text


def test_a_non_propagating_logger_and_a_handler_added_later_are_masked(masking: None) -> None:
    logger, stream = _captured("some.library", propagate=False)  # its handler comes after install_logging
    logger.debug("GET %s", f"{TARGET}/y")
    logger.debug(f"trace: {TARGET}/y")  # pre-formatted, as httpcore's traces are
    assert SECRET not in stream.getvalue() and stream.getvalue().count("/wds-etl/***/y") == 2


def test_uvicorn_log_config_masks_in_its_handlers_and_the_access_formatter_still_works(masking: None) -> None:
    config = redact.uvicorn_log_config()
    stream = io.StringIO()
    for handler in config["handlers"].values():
        handler["stream"] = stream
        assert "redact" in handler["filters"]
    logging.config.dictConfig(config)
    try:
        record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:1", "GET", f"/p?u={TARGET}", "1.1", 200), None)
        # Made directly (not by a logger): only the handler's filter sees it.
        logging.getLogger("uvicorn.access").handle(record)
        text = stream.getvalue()
        assert SECRET not in text and '"GET /p?u=http://10.0.0.5:51081/v1/etl/_object/wds-etl/***' in text
        assert text.rstrip().endswith("200 OK")
    finally:
        for name in ("uvicorn", "uvicorn.access"):
            logging.getLogger(name).handlers = []


def test_an_unhandled_thread_exception_is_logged_masked(masking: None) -> None:
    # install_logging sets this hook when the default one is in place (pytest has its own).
    threading.excepthook = redact._log_thread_exception
    _, stream = _captured("transformer")

    def fail() -> None:
        raise RuntimeError(f"boom {TARGET}")

    thread = threading.Thread(target=fail, name="worker")
    thread.start()
    thread.join()
    text = stream.getvalue()
    assert "unhandled exception in thread worker" in text and "RuntimeError: boom" in text
    assert SECRET not in text


def test_warnings_are_logged_masked(masking: None) -> None:
    _, stream = _captured("py.warnings")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        logging.captureWarnings(True)  # catch_warnings restored the hook install_logging set
        warnings.warn(f"retrying {TARGET}/z", UserWarning, stacklevel=1)
    assert "UserWarning: retrying" in stream.getvalue() and SECRET not in stream.getvalue()


def test_an_unprintable_argument_does_not_break_the_log_call(masking: None) -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    logger, stream = _captured("some.caller", propagate=False)  # (pytest's own handler re-raises)
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        logger.info("value %s and %s", Unprintable(), f"{TARGET}/w")  # the handler reports it, as always
    assert "RuntimeError: no" in errors.getvalue() and "/wds-etl/***/w" in errors.getvalue()
    assert SECRET not in errors.getvalue() + stream.getvalue()
