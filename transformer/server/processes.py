"""Transform worker processes, the server's side: start and watch them, pair them, and hand each shard to one.

Why: a transform thread holds the GIL about a quarter of its time (the per-sample Python around the
decode, the v2 pipeline's bookkeeping, tar headers), so the threads of one process stop scaling near
four cores whatever the node has (docs/performance.md, "Cores"). Here every worker process has its
own GIL and a few transform threads, and the server process, which every request reaches, only
starts each shard and ends its response.

A shard goes to the worker leading the fewest (``_pick``), as a ``WorkerJob`` and two file
descriptors over the worker's SEQPACKET control socket: its input (the object's file itself for an
FQN, else a pipe a feeder thread fills) and a stream socket to this process. That worker leads it:
it reads it, spreads its samples over every worker (``spread.py``), and sends the output. The first
chunk comes here and starts the response; then the worker is handed the caller's connection and
writes the rest itself (``RemoteShard.offer``); the end (the last chunk, the ws frame with FIN, an
abort) comes back here. The worker runs the same ``transform_shard`` the server runs in-process, so
the bytes are the same.

The workers are forked by multiprocessing's fork server, which imports torch and the transforms
once: they share those pages, and a worker can be replaced while the server's threads run (a
threaded process is never forked). Every worker writes a heartbeat on the shared ``Board``; the
supervisor kills one whose heartbeat is older than ``stall`` seconds (a stopped process, a hang in
native code) and starts another. A worker that dies fails the shards it led, each with an error that
names it; the samples it held for other shards run again in their leaders. A worker whose heartbeat
is late gets no new shard meanwhile. The worker's side is ``worker.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ..engine import ShardReport
from ..errors import Cancelled, FrameCut, InternalError, TransformerError, WorkerGone
from ..forkserver import start_fork_server
from ..options import TransformOptions
from .board import Board
from .direct import FrameLog, bytes_written, socket_of
from .ipc import rebuilt, receive_exact
from .worker import (
    DATA,
    FEED,
    HEADER,
    NO_OFFER,
    OFFER_HTTP,
    OFFER_WS,
    RAW,
    READY,
    STOP,
    WorkerConfig,
    WorkerJob,
    worker_main,
)

log = logging.getLogger("transformer.server")

_GRACE_SECONDS = 2.0  # past the deadline, the worker's own timeout error (with its counts) is awaited this long
_READY_SECONDS = 300.0  # how long a worker may take to send READY
_WATCH_SECONDS = 0.5  # how often the supervisor reads the heartbeats


class ShardProcesses:
    """The worker processes of one server, their supervisor, and the start and end of each shard."""

    def __init__(self, processes: int, config: WorkerConfig, on_restart: Callable[[], None] | None = None,
                 target: Callable[[socket.socket, WorkerConfig], None] = worker_main):
        self.config, self.on_restart, self._target = config, on_restart, target
        self.stall = config.stall
        self._context = multiprocessing.get_context("forkserver")
        start_fork_server()  # a no-op when ``serve`` started it already
        self.board = Board(processes, config.stall)
        self._cond = threading.Condition()
        self._workers: list[_Worker | None] = [None] * processes
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self.restarts = 0
        self._start_error: Exception | None = None  # the last failure to start a worker
        self._decode_paths: dict[int, dict[tuple[str, str], int]] = {}  # per worker pid, its last snapshot
        self._spread: dict[int, int] = {}  # per worker pid: samples it transformed for another worker's shard
        self._spread_gone = 0  # the same, of workers that ended
        self._supervisor = threading.Thread(target=self._supervise, name="transform worker supervisor", daemon=True)
        self._supervisor.start()

    # ------------------------------------------------------------------ supervision

    def _supervise(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                missing = [i for i, w in enumerate(self._workers) if w is None]
            for index in missing:
                try:
                    worker = self._start(index)
                except Exception as exc:  # the fork server itself failed: try again shortly, keep serving what runs
                    log.exception("could not start transform worker %d", index)
                    with self._cond:
                        self._start_error = exc
                        self._cond.notify_all()
                    time.sleep(1.0)
                    continue
                with self._cond:
                    if self._closed:
                        worker.stop()
                        return
                    self._workers[index] = worker
                    others = [w for w in self._workers if w is not None and w is not worker]
                    self._cond.notify_all()
                for other in others:
                    self._pair(worker, other)
            with self._cond:
                running = [w for w in self._workers if w is not None]
            waitables = [w.process.sentinel for w in running] + [w.control for w in running if not w.hung_up]
            waitables.append(self._wake_r)
            ready = multiprocessing.connection.wait(waitables, _WATCH_SECONDS)
            for worker in running:
                if worker.control in ready:
                    self._message(worker)
                if worker.process.sentinel in ready:
                    self._gone(worker)
            self._check_heartbeats(running)

    def _start(self, index: int) -> _Worker:
        self.board.reset(index)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = dataclasses.replace(self.config, index=index, processes=self.board.workers)
        process = self._context.Process(target=self._target, args=(theirs, config), name=f"transform worker {index}",
                                        daemon=True)
        try:
            process.start()  # waits for the fork server, which imports torch when it first starts
        finally:
            theirs.close()
        ours.settimeout(_READY_SECONDS)
        arena = -1
        try:
            socket.send_fds(ours, [pickle.dumps(("board",))], [self.board.fd])
            ready, fds, _, _ = socket.recv_fds(ours, 16, 1)
            arena = fds[0] if fds else -1
        except OSError:
            ready = b""
        if ready != READY or arena < 0:
            ours.close()
            if arena >= 0:
                os.close(arena)
            process.kill()
            process.join(5)
            raise RuntimeError(f"transform worker {index} did not start ({_exit_text(process.exitcode)})")
        ours.settimeout(None)
        return _Worker(index, process, ours, arena)

    def _pair(self, a: _Worker, b: _Worker) -> None:
        """A link between two workers (spread.py): each gets its end and the other's arena."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for worker, end, other in ((a, ours, b), (b, theirs, a)):
                with contextlib.suppress(OSError):  # a worker that died meanwhile: the other hears of it
                    worker.send(("peer", other.index, other.process.pid), [end.fileno(), other.arena])
        finally:
            ours.close()
            theirs.close()

    def _message(self, worker: _Worker) -> None:
        try:
            message = worker.control.recv(1 << 20)
        except OSError:
            message = b""
        if not message:
            worker.hung_up = True  # it is ending: its sentinel says how
        else:
            kind, *rest = pickle.loads(message)
            if kind == "stats" and worker.process.pid is not None:
                with self._cond:
                    self._decode_paths[worker.process.pid] = rest[0]
                    self._spread[worker.process.pid] = rest[1]

    def _check_heartbeats(self, running: list[_Worker]) -> None:
        now = time.monotonic()
        for worker in running:
            if worker.killed is not None or worker.dead.is_set():
                continue
            if self.board.stalled(worker.index, now):
                age = self.board.age(worker.index, now)
                worker.killed = (f"stopped answering for {age:.0f} s (over ETL_WORKER_TIMEOUT, {self.stall:.0f} s: "
                                 "stopped, or stuck in a sample) and was killed")
                log.error("transform worker process %d (pid %d) %s with %d shards in flight", worker.index,
                          worker.process.pid, worker.killed, self._leading(worker))
                with contextlib.suppress(OSError):
                    worker.process.kill()

    def _leading(self, worker: _Worker) -> int:
        return worker.sent - self.board.slots[worker.index].finished

    def _gone(self, worker: _Worker) -> None:
        worker.process.join()
        worker.exitcode = worker.process.exitcode
        worker.dead.set()
        with self._cond:
            closed = self._closed
            if self._workers[worker.index] is worker:
                self._workers[worker.index] = None
            if not closed:
                self.restarts += 1
            if worker.process.pid is not None:
                self._decode_paths.pop(worker.process.pid, None)
                self._spread_gone += self._spread.pop(worker.process.pid, 0)
        worker.close()
        if not closed:
            how = worker.killed or _exit_text(worker.exitcode)
            log.error("transform worker process %d (pid %d) %s with %d shards in flight; starting a new one",
                      worker.index, worker.process.pid, how, max(0, self._leading(worker)))
            if self.on_restart is not None:
                self.on_restart()

    def wait_ready(self, timeout: float) -> None:
        """Until every worker process runs; ``RuntimeError`` after ``timeout`` seconds, or at once when none
        could start (the pod then exits at start-up, for Kubernetes to report)."""
        end = time.monotonic() + timeout
        with self._cond:
            while any(w is None for w in self._workers):
                if self._start_error is not None and all(w is None for w in self._workers):
                    raise RuntimeError(f"no transform worker process could start: {self._start_error!r}")
                if time.monotonic() > end:
                    started = sum(w is not None for w in self._workers)
                    raise RuntimeError(f"{started} of {len(self._workers)} transform worker processes started in "
                                       f"{timeout:.0f} s")
                self._cond.wait(0.2)

    def shutdown(self) -> None:
        """Stop the workers: they finish the shards they hold (none, once the server drained) and exit."""
        with self._cond:
            self._closed = True
            workers = [w for w in self._workers if w is not None]
            self._cond.notify_all()
        os.write(self._wake_w, b"x")
        self._supervisor.join(10)
        for worker in workers:
            worker.stop()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def pids(self) -> list[int]:
        with self._cond:
            return [w.process.pid for w in self._workers if w is not None and w.process.pid is not None]

    def leading(self) -> dict[int, int]:
        """Shards each worker (by pid) was given and has not finished: what ``_pick`` balances."""
        with self._cond:
            return {w.process.pid: self._leading(w) for w in self._workers
                    if w is not None and w.process.pid is not None}

    def spread(self) -> int:
        """Samples transformed in a worker other than the one leading their shard (as last reported)."""
        with self._cond:
            return self._spread_gone + sum(self._spread.values())

    def decode_paths(self) -> dict[tuple[str, str], int]:
        """The workers' images by decode path, summed (each worker's latest count)."""
        total: dict[tuple[str, str], int] = {}
        with self._cond:
            snapshots = list(self._decode_paths.values())
        for snapshot in snapshots:
            for key, count in snapshot.items():
                total[key] = total.get(key, 0) + count
        return total

    # ------------------------------------------------------------------ one shard

    def transform(self, stream: BinaryIO | None, options: TransformOptions, *, shard: str, object_name: str,
                  window: int, limit: int, report: ShardReport, cancel: threading.Event, deadline: float,
                  offer: bool = False, body: bool = False, input_fd: int | None = None,
                  input_error: Callable[[], BaseException | None] | None = None, fetch: str = "",
                  origin: bool = False, check: str = "", path: str = "") -> RemoteShard:
        """``engine.transform_shard`` of ``stream`` led by a worker process: its frames, its report, its errors.

        ``offer``: the caller's connection is offered after the first chunk (``RemoteShard.offer``); ``body``:
        the input is the caller's request body. ``input_fd`` (owned from here on) replaces ``stream``: a pipe
        someone else fills, whose failure ``input_error`` tells. ``fetch``: no stream, the worker fetches the
        input from this URL itself (``origin``: a /download origin's). ``check``: ``stream`` is an FQN's file
        (``path``), whose size the worker checks against the object's at this URL first.
        """
        try:
            worker = self._pick(shard, cancel, deadline)
        except BaseException:
            if input_fd is not None:
                os.close(input_fd)
            raise
        job = WorkerJob(shard, object_name, options, window, limit, deadline, offer=offer, body=body, fetch=fetch,
                        origin=origin, check=check, path=path)
        return RemoteShard(self, worker, stream, job, report, cancel, input_fd, input_error)

    def _pick(self, shard: str, cancel: threading.Event, deadline: float) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise TransformerError(f"shard '{shard}': the server is shutting down")
                now = time.monotonic()
                board = self.board
                running = [w for w in self._workers if w is not None and not w.dead.is_set() and w.killed is None
                           and not board.suspect(w.index, now)]
                if running:
                    worker = min(running, key=lambda w: (board.late(w.index, now), self._leading(w),
                                                         board.slots[w.index].busy))
                    worker.sent += 1
                    return worker
                if cancel.is_set():
                    raise Cancelled(f"shard '{shard}': caller went away")
                if time.monotonic() > deadline:
                    raise TransformerError(f"shard '{shard}': object timeout exceeded waiting for a transform "
                                           "worker process to answer")
                self._cond.wait(0.1)


@dataclass(eq=False)
class _Worker:
    """The server's side of one worker process."""

    index: int
    process: multiprocessing.process.BaseProcess
    control: socket.socket
    arena: int  # the worker's arena (its memory file): given to the workers paired with it
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0  # shards given to it (the board counts those it finished)
    dead: threading.Event = field(default_factory=threading.Event)
    exitcode: int | None = None
    killed: str | None = None  # why the supervisor killed it
    hung_up: bool = False  # its control socket reached its end

    def send(self, message: tuple, fds: list[int]) -> None:
        with self.send_lock:
            socket.send_fds(self.control, [pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)], fds)

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # a worker that died meanwhile: nothing to tell
            self.send((STOP,), [])
        self.control.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.close()

    def close(self) -> None:
        self.control.close()
        if self.arena >= 0:
            os.close(self.arena)
            self.arena = -1


class RemoteShard:
    """One shard led by a worker: iterate for its frames (``bytes`` to send, ``Raw`` to write as is).

    ``bytes_in``, ``send_path`` and ``direct_bytes`` (what the worker wrote to the connection itself) are
    set once the worker reported the end."""

    def __init__(self, owner: ShardProcesses, worker: _Worker, stream: BinaryIO | None, job: WorkerJob,
                 report: ShardReport, cancel: threading.Event, input_fd: int | None = None,
                 input_error: Callable[[], BaseException | None] | None = None):
        self.bytes_in = 0
        self.send_path = "loop"
        self.direct_bytes = 0
        self.pid = worker.process.pid  # the worker process leading it
        self._owner, self._worker, self._job, self._report, self._cancel = owner, worker, job, report, cancel
        self._feeder: _Feeder | None = None
        self._input_failure = input_error
        self._socket: socket.socket | None = None
        self._frame_log: FrameLog | None = None  # a ws reply's frames, as the worker began them
        self._connection: socket.socket | None = None  # that reply's connection, to count what reached it
        self._written: int | None = None  # bytes written to it before the worker took it
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket = ours
            fd, input_fd = input_fd, None
            if fd is None and not job.fetch:
                assert stream is not None
                fd = _file_descriptor(stream)
                if fd is None:
                    self._feeder = _Feeder(stream, job.shard)
                    fd = self._feeder.read_end
            try:
                worker.send(("job", job), [theirs.fileno()] + ([fd] if fd is not None else []))
            except OSError as exc:  # the worker died since it was picked: its control socket is closed
                raise InternalError(f"shard '{job.shard}': the transform worker process (pid "
                                    f"{worker.process.pid}) could not take the shard: {exc}") from None
            finally:
                theirs.close()
                if fd is not None:
                    os.close(fd)  # the worker holds its own copies now
            if self._feeder is not None:
                self._feeder.start()
        except BaseException:
            if input_fd is not None:
                os.close(input_fd)
            self.close()
            raise

    def offer(self, transport, ws: bool) -> bool:
        """After the first chunk went out: hand the worker the caller's connection (None: keep relaying).

        A ws connection comes with a ``FrameLog``: should the worker die in the middle of a frame, the
        frame is completed here (``_cut_frame``) and the connection stays usable.
        """
        sock = self._socket
        assert sock is not None
        fd = -1
        if transport is not None:
            try:
                fd = socket_of(transport)
            except OSError:
                fd = -1
        try:
            if fd < 0:
                sock.send(NO_OFFER)
            elif ws:
                self._frame_log = FrameLog()
                self._connection = socket.socket(fileno=os.dup(fd))
                self._written = bytes_written(self._connection)
                socket.send_fds(sock, [OFFER_WS], [fd, self._frame_log.fd])
            else:
                socket.send_fds(sock, [OFFER_HTTP], [fd])
        except OSError:
            return False  # the worker is gone: its frames' end says how
        finally:
            if fd >= 0:
                os.close(fd)
        return fd >= 0

    def _cut_frame(self) -> bytes | None:
        """After the worker died: what completes a ws frame it left cut (b"": none), or None when that cannot be
        known (the connection must then be closed)."""
        if self._frame_log is None or self._connection is None:
            return b""
        now = bytes_written(self._connection)
        if now is None or self._written is None:
            return None
        return self._frame_log.rest(now - self._written)

    def __iter__(self) -> Iterator[bytes | Raw]:
        return self._frames()

    def _frames(self) -> Iterator[bytes | Raw]:
        sock, job = self._socket, self._job
        assert sock is not None
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        try:
            while True:
                # Wait in short steps: the caller may go away, and a stuck worker must not outlast the deadline.
                while not poller.poll(100):
                    if self._cancel.is_set():
                        raise Cancelled(f"shard '{job.shard}': caller went away")
                    if time.monotonic() > job.deadline + _GRACE_SECONDS:  # the worker is stuck
                        message = (f"shard '{job.shard}': object timeout exceeded after "
                                   f"{self._report.samples_in} samples")
                        # A ws frame it may be writing cannot be completed while it still could write: close.
                        raise FrameCut(message) if self._frame_log is not None else TransformerError(message)
                try:
                    kind, size = HEADER.unpack(self._receive(HEADER.size))
                    payload = self._receive(size)
                except WorkerGone:
                    cut = self._cut_frame()
                    if cut:
                        log.warning("shard %s: its worker died in the middle of a ws frame; %d bytes complete the "
                                    "frame before the reply's error", job.shard, len(cut))
                        yield Raw(cut)  # the frame the worker left cut, completed: the ws connection stays usable
                    raise self._died(frame_cut=cut is None) from None
                if kind == DATA:
                    yield payload
                    continue
                if kind == RAW:
                    yield Raw(payload)
                    continue
                state, self.bytes_in, self.send_path, self.direct_bytes, failure = pickle.loads(payload)
                _apply_report(self._report, state)
                if failure is None:
                    return
                raise self._input_error() or rebuilt(failure)
        finally:
            self.close()

    def _receive(self, size: int) -> bytes:
        """Exactly ``size`` bytes; the worker's end of the connection before that means it died."""
        assert self._socket is not None
        data = receive_exact(self._socket, size)
        if data is None:
            raise WorkerGone()
        return data

    def _input_error(self) -> BaseException | None:
        """The input's own failure (the body cut, the fetch refused), which is why the worker saw a short tar."""
        if self._input_failure is not None:
            return self._input_failure()
        return self._feeder.error if self._feeder is not None else None

    def _died(self, frame_cut: bool = False) -> TransformerError:
        worker, job = self._worker, self._job
        worker.dead.wait(2.0)  # the supervisor reaps it and knows how it ended
        how = worker.killed or (_exit_text(worker.exitcode) if worker.exitcode is not None
                                else "closed its connection")
        message = (f"shard '{job.shard}': the transform worker process (pid {worker.process.pid}) {how} after "
                   f"{self._report.samples_out} samples; the shard was not completed")
        return FrameCut(message) if frame_cut else InternalError(message)

    def close(self) -> None:
        """End the shard: a worker still transforming it sees its connection shut and stops."""
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
            self._socket = None
        if self._frame_log is not None:
            self._frame_log.close()
            self._frame_log = None
        if self._connection is not None:
            self._connection.close()
            self._connection = None


@dataclass(frozen=True, slots=True)
class Raw:
    """Bytes for the caller's connection as they are: the rest of a frame the worker had begun."""

    data: bytes


class _Feeder:
    """Copies a stream that is no file (a request body, an HTTP fetch, bytes) into a pipe for the worker."""

    def __init__(self, stream: BinaryIO, shard: str):
        self.stream, self.shard = stream, shard
        self.read_end, self._write_end = os.pipe()
        with contextlib.suppress(OSError):  # fewer, larger writes; the pipe's default is 64 KiB
            import fcntl

            fcntl.fcntl(self._write_end, fcntl.F_SETPIPE_SZ, FEED)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"feed {shard}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                chunk = self.stream.read(FEED)
                if not chunk:
                    return
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self._write_end, view):]
        except (BrokenPipeError, OSError) as exc:
            if not isinstance(exc, BrokenPipeError) or self.error is not None:
                self.error = self.error or exc
            # BrokenPipeError: the worker stopped reading; its own report or error says why
        except BaseException as exc:  # the source's failure: the reason the worker's input ends short
            self.error = exc
        finally:
            os.close(self._write_end)


def _file_descriptor(stream: BinaryIO) -> int | None:
    """A duplicate of ``stream``'s descriptor when it is a regular file read from its start, else None."""
    if not isinstance(stream, io.BufferedReader):
        return None
    try:
        fd = stream.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or stream.tell() != os.lseek(fd, 0, os.SEEK_CUR):
            return None
    except (OSError, ValueError):
        return None
    return os.dup(fd)


def _apply_report(report: ShardReport, state: dict) -> None:
    for name, value in state.items():
        setattr(report, name, value)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (SIGKILL: often the OOM killer at the container's memory limit)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"
