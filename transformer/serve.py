"""The pod's start, ``wds-transform serve``: fork server first, then the settings, then uvicorn.

The ETL secret is masked, the workers' fork server started before torch is imported, the settings
checked (a bad one written to the termination log), and uvicorn run with the service's options.

Nothing of the service is imported before the fork server runs: it imports torch in a process of its
own while this one does the same (forkserver.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import TransformerError


def serve(host: str | None = None, port: int | None = None) -> int:
    """Run the service under uvicorn until it stops, on ``host``:``port`` (AIS's 0.0.0.0:8000 unless given)."""
    from .config import HOST, KEEPALIVE_SECONDS, PORT, Settings, write_termination_log
    from .redact import configure, install_logging, redact

    configure(os.environ.get("AIS_TARGET_URL", ""))  # before anything is written: the ETL secret stays out
    if worker_processes_likely(os.environ):
        from .forkserver import start_fork_server

        start_fork_server()  # it imports torch in a process of its own while this one does the same
    try:
        settings = Settings.from_env()  # fail fast, before binding the port, on a bad setting
    except TransformerError as exc:
        # Kubernetes shows the termination log in the container status; AIS prints it when init fails.
        write_termination_log(redact(f"wds-transform serve: {exc.message}"))
        raise
    install_logging(settings.ais_target_url)

    import uvicorn

    from .server.logs import serve_log_config
    from .server.protocols import DirectSendProtocol, FragmentingWebSocketProtocol

    uvicorn.run(
        "transformer.server:create_app",
        factory=True,
        host=host or HOST,
        port=port or PORT,
        # Above the AIS target's 6 s idle timeout, so the target never reuses a connection we closed
        # (AIS does not retry a PUT that failed with EOF; ext/etl/communicator.go).
        timeout_keep_alive=KEEPALIVE_SECONDS,
        # uvicorn's httptools protocol, which also hands the connection's transport to shard responses
        # so the shard's driver thread can write the output itself (server/direct.py).
        http=DirectSendProtocol,
        # uvicorn's websockets (sans-I/O) protocol, which can also send a reply frame by frame
        # (server/wsreply.py). AIS sends up to 16 GiB per message and a shard sent as content is one
        # message, held in memory whole: the shard limit caps it (the 1 MiB floor keeps room for
        # control messages).
        ws=FragmentingWebSocketProtocol,
        ws_max_size=min(16 * 2**30, max(settings.max_shard_bytes, 2**20)),
        ws_ping_interval=None,  # the target never answers pings' purpose; AIS itself sends none
        ws_ping_timeout=None,
        # No permessage-deflate: AIS's gorilla dialer never asks for it, float arrays barely compress,
        # and deflating 600 MB per shard would cost more CPU than transforming it. (Direct send writes
        # uncompressed frames, so it also stays off with a compressing client.)
        ws_per_message_deflate=False,
        log_level=settings.log_level,
        # uvicorn's own, with the ETL secret masked in each handler, and the root logger in the pod's format
        log_config=serve_log_config(settings.log_level),
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=int(settings.obj_timeout),
    )
    return 0


def worker_processes_likely(env: Mapping[str, str]) -> bool:
    """Whether the settings will ask for transform worker processes, read without torch (a bad value: no; the
    settings then say why)."""
    from .config import cores

    try:
        return cores(env)[1] > 0
    except TransformerError:
        return False
