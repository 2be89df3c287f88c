"""Transform worker processes, the server's side: start and watch them, pair them, and hand each shard to one.

Why: a transform thread holds the GIL about a quarter of its time (the per-sample Python around the
decode, the v2 pipeline's bookkeeping, tar headers), so the threads of one process stop scaling near
four cores whatever the node has (docs/design.md, "Cores"). Here every worker process has its
own GIL and a few transform threads, and the server process, which every request reaches, only
starts each shard and ends its response.

A shard goes to the worker leading the fewest (``_pick``), as a ``WorkerJob`` and two file
descriptors over the worker's SEQPACKET control socket: its input (the object's file itself for an
FQN, else a pipe a feeder thread fills) and a stream socket to this process. That worker leads it:
it reads it, spreads its samples over every worker (``spread.py``), and sends the output. The first
chunk comes here and starts the response; then the worker is handed the caller's connection and
writes the rest itself; the end (the last chunk, the ws frame with FIN, an abort) comes back here
(``remote.RemoteShard``). The worker runs the same ``transform_shard`` the server runs in-process, so
the bytes are the same.

The workers are forked by multiprocessing's fork server, which imports torch and the transforms
once: they share those pages, and a worker can be replaced while the server's threads run (a
threaded process is never forked). Every worker writes a heartbeat on the shared ``Board``; the
supervisor kills one whose heartbeat is older than ``stall`` seconds (a stopped process, a hang in
native code) and starts another. A worker that dies fails the shards it led, each with an error that
names it; the samples it held for other shards run again in their leaders. A worker whose heartbeat
is late gets no new shard meanwhile (the board holds every threshold). The server ends a worker with
``STOP``; should the server die instead, every worker goes with it (``worker.py``, the worker's side).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from ..engine import ShardReport
from ..errors import Cancelled, TransformerError
from ..forkserver import start_fork_server
from ..options import TransformOptions
from .board import Board
from .remote import RemoteShard, exit_text
from .worker import (
    READY,
    STOP,
    WorkerConfig,
    WorkerJob,
    worker_main,
)

log = logging.getLogger("transformer.server")

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
            raise RuntimeError(f"transform worker {index} did not start ({exit_text(process.exitcode)})")
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
            how = worker.killed or exit_text(worker.exitcode)
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
        return RemoteShard(worker, stream, job, report, cancel, input_fd, input_error)

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
