"""server/logs.py: the root logger of ``wds-transform serve`` (the pod's line format, masked) and the filter that
leaves a foreseen abort's traceback out of uvicorn's error log."""

from __future__ import annotations

import logging
import logging.config
import sys

from transformer.errors import StreamAborted, TransformerError
from transformer.server.logs import ForeseenAbortFilter, quiet_foreseen_aborts, serve_log_config


def test_serve_log_config_gives_the_root_logger_the_pod_format_at_the_level_masked(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    config = serve_log_config("debug")
    assert config["root"] == {"level": "DEBUG", "handlers": ["service"]}
    assert config["handlers"]["service"]["filters"] == ["redact"]
    try:
        logging.config.dictConfig(config)
        logging.getLogger("transformer.server").info("ready: %s", "GET /v1/etl/_object/wds-etl/s3cr3tvalue/x")
        err = capsys.readouterr().err
    finally:
        root.handlers, root.level = saved
        for name in ("uvicorn", "uvicorn.access"):
            logging.getLogger(name).handlers = []
    assert " INFO transformer.server: ready: GET /v1/etl/_object/wds-etl/***/x" in err and "s3cr3tvalue" not in err


def _record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (),
                                 sys.exc_info())


def test_only_a_foreseen_abort_is_left_out() -> None:
    keep = ForeseenAbortFilter()
    assert not keep.filter(_record(StreamAborted("cut", foreseen=True)))
    assert keep.filter(_record(StreamAborted("a bug")))
    assert keep.filter(_record(TransformerError("other")))
    assert keep.filter(logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "started", (), None))


def test_the_filter_is_added_once() -> None:
    logger = logging.getLogger("tests.server.quiet")
    quiet_foreseen_aborts(logger)
    quiet_foreseen_aborts(logger)
    assert sum(isinstance(f, ForeseenAbortFilter) for f in logger.filters) == 1
