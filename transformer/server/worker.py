"""A transform worker process's side: ``worker_main`` leads the shards the server hands it and transforms
samples for the other workers' shards.

The server (``processes.ShardProcesses``) talks to a worker over its SEQPACKET control socket: first
the ``Board`` (shared memory: heartbeats and loads), then shards (a pickled ``WorkerJob`` with two
file descriptors: its input, and a stream socket to the server) and links to the other workers
(``spread.Peers``). The worker answers ``READY`` with its ``Arena``'s memory file once its threads
run, and sends its decode-path counts now and then.

Leading a shard: ``transform_shard`` reads it and spreads its samples over this worker's threads and
the others' (``spread.SpreadPool``), and ``Reply`` sends the output. The first chunk goes to the
server as a frame (``HEADER``: kind, length), which starts the response; then the server hands over
the caller's connection, and this process writes the rest of the body to it (``direct.FrameWriter``),
as the threads design does from the server's threads. Without that hand-over (TLS, a direct put or
a next stage, ``ETL_DIRECT_SEND=false``) every chunk goes to the server in frames. The shard ends with
its report (``DONE``) or its error (``FAILED``), pickled.

A heartbeat thread writes the board every ``BEAT_SECONDS``, unless a sample has been running longer
than the stall bound (``Board.beat``): the server kills a worker whose heartbeat stops (stopped, or hung in native
code) and starts another.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

from ..config import Settings
from ..engine import ShardReport, Write, transform_shard
from ..errors import Cancelled, TransformerError
from ..options import TransformOptions
from ..pool import TransformPool
from ..redact import install_logging
from ..samples import decode_paths
from .arena import Arena
from .board import BEAT_SECONDS, Board
from .direct import FrameLog, FrameWriter, ws_continuation_frame
from .ipc import portable, send_parts
from .logs import LOG_FORMAT
from .sources import Counting, HttpSource, checked_file, origin_client, target_client
from .spread import Peers, SpreadPool

log = logging.getLogger("transformer.server")

HEADER = struct.Struct("!BQ")  # frame kind, payload length
DATA, DONE, FAILED, RAW = 1, 2, 3, 4  # RAW: bytes for the connection as they are (a frame's rest)
OFFER_HTTP, OFFER_WS, NO_OFFER = b"H", b"W", b"N"  # the server's answer after the first chunk
_FRAME = 4 << 20  # relayed output gathered into frames of about this size: one relay step per frame
_FLUSH_SECONDS = 0.05
FEED = 1 << 20  # input read and piped in pieces of this size when it is not a file
READY = b"ready"  # a worker's first message, once its transform threads run
STOP = "stop"  # the server's last message: finish and exit (its control socket closing without it: the server died)
_PR_SET_PDEATHSIG = 1  # prctl(2)
OOM_SCORE_ADJ = 500  # added to the server's: the kernel's OOM killer takes a worker before the server
_STATS_SECONDS = 2.0
_REPORT_SKIP = frozenset({"bytes_out", "first_byte", "started"})  # kept by the server's own job


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs to know; passed once when it starts."""

    threads: int
    max_inflight: int
    log_level: str
    ais_target_url: str  # its secret is masked in the worker's log lines too
    index: int = 0  # its slot on the board
    processes: int = 1  # slots on the board
    stall: float = 20.0  # a sample running longer stops the heartbeat (ETL_WORKER_TIMEOUT)
    settings: Settings | None = None  # for the worker's own fetches (hpull, /download): TLS, timeouts


@dataclass(frozen=True)
class WorkerJob:
    """One shard for a worker to lead, sent with its two descriptors (input, the stream to the server)."""

    shard: str
    object_name: str
    options: TransformOptions
    window: int
    limit: int  # ETL_MAX_SHARD_BYTES, counted as the worker reads
    deadline: float  # time.monotonic() is one clock for every process of the host
    offer: bool = False  # the server offers the caller's connection after the first chunk (answers either way)
    body: bool = False  # the input is the caller's request body (a caller that is not reading may be sending)
    fetch: str = ""  # the input is fetched by the worker from this URL (no input descriptor is sent)
    origin: bool = False  # ... a /download origin's (else an AIS target's)
    check: str = ""  # the input is an FQN's file: the object's URL on the target, to check its size first
    path: str = ""  # that file's path (for messages)


def report_state(report: ShardReport) -> dict:
    return {f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name not in _REPORT_SKIP}


def worker_main(control: socket.socket, config: WorkerConfig) -> None:
    """A worker process: lead the shards the server sends, serve the other workers' samples, until the server
    says ``STOP``. Should the server die instead (its end of ``control`` closes without it), the process exits
    at once: a shard whose server is gone is cut, never completed by an orphan."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the server's to act on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    install_logging(config.ais_target_url)
    _raise_oom_score()
    message, fds, _, _ = socket.recv_fds(control, 1024, 1)
    if not message or not fds:
        return  # the server went away before it finished starting us
    board = Board.attach(fds[0], config.processes, config.stall)
    slot = board.slots[config.index]
    slot.threads, slot.pid = config.threads, os.getpid()
    pool = TransformPool(config.threads, config.max_inflight, on_load=lambda busy: setattr(slot, "busy", busy))
    arena = Arena()
    peers = Peers(config.index, board, pool, arena)
    worker = _Worker(control, config, board, pool, peers)
    slot.beat = time.monotonic()
    threading.Thread(target=worker.beat, name="heartbeat", daemon=True).start()
    socket.send_fds(control, [READY], [arena.fd])
    try:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
            except OSError:
                message = b""
            if not message:
                _orphaned(config)
            kind, *rest = pickle.loads(message)
            if kind == STOP:
                return
            if kind == "job":
                threading.Thread(target=worker.lead, args=(rest[0], fds), name=f"shard {rest[0].shard}",
                                 daemon=True).start()
            elif kind == "peer":
                index, pid = rest
                peers.add(index, pid, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fds[0]), fds[1])
            else:
                for fd in fds:
                    os.close(fd)
    finally:
        peers.close()
        pool.shutdown()


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent, the fork server, ends: a stopped worker, which reads
    no end of ``control``, still goes with its server.

    The fork server exits once every copy of its liveness pipe's write end is closed. multiprocessing gives one
    to each process it forks, for processes that start their own; a worker starts none, and its copy would keep
    the fork server, and so every worker, alive after the server died: closed here.
    """
    fork_server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(fork_server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        with contextlib.suppress(OSError):
            os.close(alive)
        fork_server._forkserver_alive_fd = None  # type: ignore[union-attr]
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _orphaned(config: WorkerConfig) -> NoReturn:
    """The server process is gone (``control`` ended without ``STOP``): exit now. The shards this worker leads
    are cut where they stand (their connections close with the process), and nothing is run to completion."""
    log.error("transform worker %d (pid %d): the server process is gone; exiting, the shards it leads cut",
              config.index, os.getpid())
    logging.shutdown()
    os._exit(70)


def _raise_oom_score() -> None:
    """Make this process the OOM killer's first choice over the server: losing a worker fails its shards,
    losing the server loses the pod (and AIS then aborts the ETL). Raising one's own score needs no
    privilege; where /proc cannot be written it stays as it is."""
    path = "/proc/self/oom_score_adj"
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            current = int(f.read().strip() or 0)
        with open(path, "w") as f:
            f.write(str(min(1000, current + OOM_SCORE_ADJ)))


class _Worker:
    """One worker process's state: the board, its threads, its links, and the shards it leads."""

    def __init__(self, control: socket.socket, config: WorkerConfig, board: Board, pool: TransformPool,
                 peers: Peers):
        self.control, self.config, self.board, self.pool, self.peers = control, config, board, pool, peers
        self.slot = board.slots[config.index]
        self._finished_lock = threading.Lock()
        self._clients: dict[bool, object] = {}  # fetches: to the target (False), to /download origins (True)
        self._clients_lock = threading.Lock()

    def beat(self) -> None:
        """Heartbeats (unless a sample runs past the stall bound) and, now and then, the decode-path counts and the
        samples transformed for other workers' shards."""
        sent: tuple = ({}, 0)
        next_stats = time.monotonic() + _STATS_SECONDS
        stalled_logged = False
        while True:
            now = time.monotonic()
            oldest = self.pool.oldest()
            if not self.board.beat(self.config.index, now, oldest) and not stalled_logged:
                log.error("transform worker %d (pid %d): a sample has run for %.0f s, over the %.0f s bound "
                          "(ETL_WORKER_TIMEOUT); stopping the heartbeat so the server replaces this process",
                          self.config.index, os.getpid(), now - oldest, self.board.stall)
                stalled_logged = True
            if now >= next_stats:
                next_stats = now + _STATS_SECONDS
                stats = (decode_paths(), self.peers.served)
                if stats != sent:
                    try:
                        self.control.send(pickle.dumps(("stats", *stats)))
                    except OSError:
                        return
                    sent = stats
            time.sleep(BEAT_SECONDS)

    def lead(self, job: WorkerJob, fds: list[int]) -> None:
        """Transform one shard, spreading its samples, and send its output (``Reply``)."""
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fds[0])
        stream = _Input(None if job.fetch or job.check else open(fds[1], "rb", buffering=FEED))
        reply = Reply(out, job, stream)
        report = ShardReport(job.shard, job.object_name, job.options.on_error)
        counted = Counting(stream, job.shard, job.limit)
        spread = SpreadPool(self.peers, job.options)
        with self._finished_lock:
            self.slot.leading += 1
        try:
            with self._fetched(job, fds) as fetched:
                if fetched is not None:
                    stream.attach(fetched)
                chunks = transform_shard(counted, job.options, spread,  # type: ignore[arg-type]
                                         shard=job.shard, object_name=job.object_name, window=job.window,
                                         report=report, cancel=reply.cancel, deadline=job.deadline,
                                         writer=reply.try_write if job.offer else None)
                with contextlib.closing(chunks):
                    for chunk in chunks:
                        reply.write(chunk)
            reply.end(report, counted.count)
        except BaseException as exc:
            if not isinstance(exc, (TransformerError, OSError)):
                log.exception("shard %s: unexpected error in a transform worker", job.shard)
            reply.fail(exc, report, counted.count)
        finally:
            spread.close()
            stream.close()
            reply.close()
            with self._finished_lock:
                self.slot.leading -= 1
                self.slot.finished += 1

    def _fetched(self, job: WorkerJob, fds: list[int]) -> contextlib.AbstractContextManager:
        """The input this worker opens itself: fetched from its URL (hpull from the target, ``/download`` from an
        origin), or an FQN's file checked against the target's size of the object; None: the descriptor."""
        if not job.fetch and not job.check:
            return contextlib.nullcontext(None)
        with self._clients_lock:
            client = self._clients.get(job.origin)
            if client is None:
                assert self.config.settings is not None
                make = origin_client if job.origin else target_client
                client = self._clients[job.origin] = make(self.config.settings)
        if job.fetch:
            return HttpSource(client, job.fetch, job.deadline).open()
        return _checked(fds[1], job, client)


@contextlib.contextmanager
def _checked(fd: int, job: WorkerJob, client):
    """An FQN's file, or the object fetched instead when the target's size of it differs (a chunked object)."""
    with open(fd, "rb", buffering=FEED) as file, checked_file(file, job.path, client, job.check, job.deadline) as read:
        yield read


class _Input:
    """The shard's input, remembering whether its end was read (a body still arriving may block its caller)."""

    def __init__(self, stream):
        self._stream, self.ended = stream, False

    def attach(self, stream) -> None:
        """The stream, once opened (a fetch)."""
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        if not data and size != 0:
            self.ended = True
        return data

    def readinto(self, buffer) -> int:
        count = self._stream.readinto(buffer)
        if not count and len(buffer):
            self.ended = True
        return count

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


class Reply:
    """The output of a shard this worker leads: frames to the server, then the caller's connection itself.

    One owner for the shard's bytes (the engine's ``writer`` role decides which thread writes): the
    driver thread's ``write`` may wait, a transform thread's ``try_write`` never does. After the first
    chunk the driver waits for the server's answer (``WorkerJob.offer``): the connection's descriptor
    (HTTP or ws framing), or none. A frame the caller does not take for ``direct.STALL_SECONDS`` while
    its request body is still arriving goes back to the server (``RAW``), and so does everything after
    it (``DATA``, which the server parks on disk while it must: a caller that reads only after sending).
    """

    def __init__(self, out: socket.socket, job: WorkerJob, stream: _Input):
        self.out, self.job, self.stream = out, job, stream
        self.cancel = threading.Event()
        self._answer = threading.Event()
        self._offer: tuple[list[int], bytes] | None = None  # the connection (and a ws reply's FrameLog)
        self._frames: FrameLog | None = None
        self._awaiting = job.offer  # after the first chunk, the driver waits for the server's answer
        self._writer: FrameWriter | None = None
        self._send_lock = threading.Lock()
        self.send_path = "loop"  # as the server names it: loop, direct, direct_then_loop
        self.direct_bytes = 0  # written to the connection here (the server counts what it relays)
        self._pending: list[bytes | memoryview] = []
        self._size = 0
        self._oldest = 0.0
        self._first = True
        self._held: bytes | memoryview | None = None
        self._watcher = threading.Thread(target=self._watch, name=f"watch {job.shard}", daemon=True)
        self._watcher.start()

    # -- the server's side of the stream

    def _watch(self) -> None:
        """The server's messages: its answer after the first chunk; the end of the stream is a cancel."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.out, 1, 2)
            except OSError:
                message, fds = b"", []
            if not message:
                self.cancel.set()  # the caller went away, or the server gave up on the shard
                self._answer.set()
                return
            if message in (OFFER_HTTP, OFFER_WS) and fds:
                self._offer = (fds, message)
            else:
                for fd in fds:
                    os.close(fd)
            self._answer.set()

    def _frame(self, kind: int, parts: list[bytes | memoryview], size: int) -> None:
        with self._send_lock:
            send_parts(self.out, [HEADER.pack(kind, size), *parts])

    # -- the engine's writer

    def try_write(self, chunk: bytes | memoryview) -> Write:
        writer = self._writer
        if writer is None:
            return Write.REFUSED
        done = writer.try_send(chunk)
        if done is not Write.REFUSED:
            self.direct_bytes += len(chunk)
        return done

    def write(self, chunk: bytes | memoryview) -> None:
        writer = self._writer
        if writer is not None:
            self.direct_bytes += len(chunk)
            if not writer.send(chunk, self._check, self._stalled):
                self._leave_direct()
            return
        if self._first:
            # The first chunk goes at once (the caller's time to first byte) and starts the response.
            self._first = False
            self._frame(DATA, [chunk], len(chunk))
            if self._awaiting:
                self._awaiting = False
                self._take_connection()
            return
        # Relayed: frames of _FRAME bytes, or what waited _FLUSH_SECONDS (a slow transform still streams).
        # The newest chunk is held back, so the shard's last chunk (the end marker and end-of-archive
        # blocks, small) is a frame of its own: a ws reply's last frame then carries it with FIN.
        if self._held is not None:
            if not self._pending:
                self._oldest = time.monotonic()
            self._pending.append(self._held)
            self._size += len(self._held)
        self._held = chunk
        if self._pending and (self._size >= _FRAME or time.monotonic() - self._oldest >= _FLUSH_SECONDS):
            self._flush_relay()

    def _flush_relay(self) -> None:
        if self._pending:
            self._frame(DATA, self._pending, self._size)
            self._pending, self._size = [], 0

    def _take_connection(self) -> None:
        while not self._answer.wait(0.1):
            self._check()
        self._check()
        offer, self._offer = self._offer, None
        if offer is None:
            return
        fds, kind = offer
        if kind == OFFER_WS:
            if len(fds) > 1:
                self._frames = FrameLog(fds[1])
            self._writer = FrameWriter(fds[0], self._back_to_server, frame=ws_continuation_frame,
                                       protocol_ends_message=True,
                                       on_frame=self._frames.record if self._frames is not None else None)
        else:
            self._writer = FrameWriter(fds[0], self._back_to_server)
        self.send_path = "direct"

    def _back_to_server(self, data: bytes) -> None:
        """A frame's rest the server must write to the connection before anything else (``FrameWriter``)."""
        self._frame(RAW, [data], len(data))

    def _leave_direct(self) -> None:
        log.info("shard %s: caller is not reading yet; leaving direct send", self.job.shard)
        self.send_path = "direct_then_loop"
        self._close_writer()

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled(f"shard '{self.job.shard}': caller went away")
        if time.monotonic() > self.job.deadline:
            raise TransformerError(f"shard '{self.job.shard}': object timeout exceeded while the caller was not "
                                   "reading the output")

    def _stalled(self) -> bool:
        """Whether waiting for the caller could deadlock: it may still be sending the body we read."""
        return self.job.body and not self.stream.ended

    # -- the end

    def end(self, report: ShardReport, bytes_in: int) -> None:
        writer = self._writer
        if writer is not None:
            tail = writer.take_tail()  # a ws reply's held chunks: the server sends them with FIN
            if not writer.flush(self._check, self._stalled):
                self._leave_direct()
            self._close_writer()
            if tail:
                self.direct_bytes -= len(tail)
                self._frame(DATA, [tail], len(tail))
        else:
            self._flush_relay()
            if self._held is not None:
                self._frame(DATA, [self._held], len(self._held))
                self._held = None
        state = pickle.dumps((report_state(report), bytes_in, self.send_path, self.direct_bytes, None))
        self._frame(DONE, [state], len(state))

    def fail(self, exc: BaseException, report: ShardReport, bytes_in: int) -> None:
        # The connection is ours no more before the server hears of the failure: an HTTP reply it cuts
        # must end at once, and a ws frame cut short goes to it first (RAW) to be completed.
        self._close_writer()
        if isinstance(exc, OSError) and self.cancel.is_set():
            return  # the server shut the stream: no one reads
        with contextlib.suppress(OSError):
            state = pickle.dumps((report_state(report), bytes_in, self.send_path, self.direct_bytes, portable(exc)))
            self._frame(FAILED, [state], len(state))

    def close(self) -> None:
        self._close_writer()
        if self._offer is not None:  # an answer that came after the shard ended
            for fd in self._offer[0]:
                os.close(fd)
            self._offer = None
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        with contextlib.suppress(OSError):
            self.out.shutdown(socket.SHUT_RD)  # wakes the watcher
        self.out.close()
