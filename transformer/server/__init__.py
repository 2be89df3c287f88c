"""The AIS ETL service: ``create_app()``, the ASGI app built from the environment.

``wds-transform serve`` (transformer/serve.py) runs it under uvicorn (``uvicorn --factory
transformer.server:create_app`` does the same, without the direct-send protocols and the service's
log config, ``logs.serve_log_config``: the host's logging is the runner's). Importing this package
builds nothing: ``transformer.server.app`` is built on first access, for ``uvicorn
transformer.server:app``.
"""

from __future__ import annotations

from typing import Any

from .service import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "app":  # built when asked for, once: reading the settings is no side effect of an import
        app = globals()["app"] = create_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
