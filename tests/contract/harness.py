"""Build requests exactly as an AIS target does, and start the SDK's reference server to compare against.

The helpers encode ``etl_fqn`` and unames the way AIS does (Go's ``url.PathEscape``, then the query encoded
again: AIS's ext/etl/communicator.go). The service under test starts through ``testbed.service``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlencode

from testbed.fake_ais import go_path_escape
from testbed.ports import free_port
from testbed.service import Service


def fqn_query(fqn: str, etl_args: str | None = None) -> str:
    """``etl_fqn`` as AIS sends it over HTTP: PathEscape(fqn), then URL-encoded again (double-encoded)."""
    params = {"etl_fqn": go_path_escape(fqn)}
    if etl_args:
        params["etl_args"] = etl_args
    return urlencode(params)


def args_query(etl_args: str) -> str:
    return urlencode({"etl_args": etl_args})


def uname(bucket: str, name: str, provider: str = "ais") -> str:
    """``<provider>/@#/<bucket>/<name>``: AIS's global-namespace uname (cmn/bck.go)."""
    return f"{provider}/@#/{bucket}/{name}"


def escaped_uname(bucket: str, name: str) -> str:
    """The one path segment AIS uses for hpull and direct put: ``PathEscape(uname)``."""
    return go_path_escape(uname(bucket, name))


def start_reference(log_dir: Path, env: dict[str, str], timeout: float = 60.0) -> Service:
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.contract.reference_server:app", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    return Service("reference", command, env, log_dir, port).wait_healthy(timeout)
