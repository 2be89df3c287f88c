"""A transform worker process's side: ``worker_main`` takes shards from the server and streams them back.

The server (``processes.ShardProcesses``) hands each shard over the worker's SEQPACKET control socket
as a pickled ``WorkerJob`` and two file descriptors: its input, and a stream socket on which the
worker sends the output as frames (``HEADER``: kind, length), then the shard's report, or its error,
pickled (``DONE``/``FAILED``). Only the server and the workers it started hold these sockets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass

from ..engine import ShardReport, transform_shard
from ..errors import InternalError, TransformerError
from ..options import TransformOptions
from ..pool import TransformPool
from ..redact import install_logging
from ..samples import decode_paths
from .logs import LOG_FORMAT
from .sources import Counting

log = logging.getLogger("transformer.server")

HEADER = struct.Struct("!BQ")  # frame kind, payload length
DATA, DONE, FAILED = 1, 2, 3
_FRAME = 4 << 20  # output gathered into frames of about this size: one relay step per frame in the server
_FLUSH_SECONDS = 0.05
FEED = 1 << 20  # input read and piped in pieces of this size when it is not a file
READY = b"ready"  # a worker's first message, once its transform threads run
_REPORT_SKIP = frozenset({"bytes_out", "first_byte", "started"})  # kept by the server's own job


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs to know; passed once when it starts."""

    threads: int
    max_inflight: int
    log_level: str
    ais_target_url: str  # its secret is masked in the worker's log lines too


@dataclass(frozen=True)
class WorkerJob:
    """One shard for a worker, sent with its two descriptors (input, output socket)."""

    shard: str
    object_name: str
    options: TransformOptions
    window: int
    limit: int  # ETL_MAX_SHARD_BYTES, counted as the worker reads
    deadline: float  # time.monotonic() is one clock for every process of the host


def report_state(report: ShardReport) -> dict:
    return {f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name not in _REPORT_SKIP}


def portable(exc: BaseException) -> tuple:
    """An exception as (class, args, attributes): our errors take several arguments, which pickle cannot replay."""
    state = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))
    try:
        pickle.loads(pickle.dumps(state))
    except Exception:
        message = f"internal error: {exc!r}"
        return (InternalError, (message,), {"message": message})
    return state



def worker_main(control: socket.socket, config: WorkerConfig) -> None:
    """A worker process: take shards from ``control`` until the server closes it; each on a thread of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the server's to act on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    install_logging(config.ais_target_url)
    pool = TransformPool(config.threads, config.max_inflight)
    control.send(READY)
    try:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
            except OSError:
                return
            if not message:
                return  # the server closed its end
            job = pickle.loads(message)
            threading.Thread(target=_serve, args=(job, fds, pool), name=f"shard {job.shard}", daemon=True).start()
    finally:
        pool.shutdown()


def _serve(job: WorkerJob, fds: list[int], pool: TransformPool) -> None:
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fds[0])
    stream = open(fds[1], "rb", buffering=FEED)
    cancel = threading.Event()
    threading.Thread(target=_watch, args=(out, cancel), name=f"watch {job.shard}", daemon=True).start()
    report = ShardReport(job.shard, job.object_name, job.options.on_error)
    counted = Counting(stream, job.shard, job.limit)
    try:
        chunks = transform_shard(counted, job.options, pool, shard=job.shard, object_name=job.object_name,
                                 window=job.window, report=report, cancel=cancel, deadline=job.deadline)
        with contextlib.closing(chunks):
            # The first chunk goes at once (the caller's time to first byte); then frames of _FRAME bytes, or
            # what waited _FLUSH_SECONDS (a slow transform still streams). The newest chunk is held back, so
            # the shard's last chunk (the end marker and end-of-archive blocks, small) is a frame of its own,
            # as in-process: a ws reply's last frame then carries it with FIN.
            pending: list[bytes | memoryview] = []
            size, oldest, first = 0, 0.0, True
            held: bytes | memoryview | None = None
            for chunk in chunks:
                if first:
                    _send(out, DATA, [chunk], len(chunk))
                    first = False
                    continue
                if held is not None:
                    if not pending:
                        oldest = time.monotonic()
                    pending.append(held)
                    size += len(held)
                held = chunk
                if pending and (size >= _FRAME or time.monotonic() - oldest >= _FLUSH_SECONDS):
                    _send(out, DATA, pending, size)
                    pending, size = [], 0
            if pending:
                _send(out, DATA, pending, size)
            if held is not None:
                _send(out, DATA, [held], len(held))
        end = pickle.dumps((report_state(report), counted.count, decode_paths(), None))
        _send(out, DONE, [end], len(end))
    except BaseException as exc:
        if not isinstance(exc, (TransformerError, OSError)):
            log.exception("shard %s: unexpected error in a transform worker", job.shard)
        if not isinstance(exc, OSError) or not cancel.is_set():  # else the server shut the connection: no one reads
            with contextlib.suppress(OSError):
                end = pickle.dumps((report_state(report), counted.count, decode_paths(), portable(exc)))
                _send(out, FAILED, [end], len(end))
    finally:
        stream.close()
        with contextlib.suppress(OSError):
            out.shutdown(socket.SHUT_RD)  # wakes the watcher
        out.close()


def _watch(out: socket.socket, cancel: threading.Event) -> None:
    """The server shut the shard's connection (its caller went away, or the shard ended): stop the work."""
    with contextlib.suppress(OSError):
        out.recv(1)
    cancel.set()


def _send(out: socket.socket, kind: int, pieces: list[bytes | memoryview], size: int) -> None:
    parts: list[bytes | memoryview] = [HEADER.pack(kind, size), *pieces]
    while parts:
        sent = out.sendmsg(parts)  # the pieces go from the transform's buffers to the socket: no copy here
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if sent:
            parts[0] = memoryview(parts[0])[sent:]
