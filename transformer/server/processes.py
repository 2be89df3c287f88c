"""Transform worker processes, the server's side: each shard runs in one, the server only relays its bytes.

Why: a transform thread holds the GIL about a quarter of its time (the per-sample Python around the
decode, the v2 pipeline's bookkeeping, tar headers), so the threads of one process stop scaling near
four cores whatever the node has (docs/performance.md, "Cores"). Here every worker process has its
own GIL and a few transform threads, and the server process, which every shard passes through,
moves input and output chunks: a few system calls per megabyte.

The workers are forked by multiprocessing's fork server, which imports torch and the transforms
once: they share those pages, and a worker can be replaced while the server's threads run (a
threaded process is never forked). A shard is handed to the least busy worker as two file
descriptors over the worker's SEQPACKET control socket: its input (the object's file itself for an
FQN, else a pipe a feeder thread fills) and a stream socket on which the worker sends the output as
frames, then the shard's report (or its error). The worker runs the same ``transform_shard`` the
server runs in-process, so the bytes are the same. A worker that dies fails the shards it held,
each with an error that names it, and the supervisor starts a new one. The worker's side is
``worker.py``.
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
from dataclasses import dataclass
from typing import BinaryIO

from ..engine import ShardReport
from ..errors import Cancelled, InternalError, TransformerError
from ..forkserver import start_fork_server
from ..options import TransformOptions
from .worker import DATA, FEED, HEADER, READY, WorkerConfig, WorkerJob, worker_main

log = logging.getLogger("transformer.server")

_GRACE_SECONDS = 2.0  # past the deadline, the worker's own timeout error (with its counts) is awaited this long
_READY_SECONDS = 300.0  # how long a worker may take to send READY


class ShardProcesses:
    """The worker processes of one server, their supervisor, and the relay of a shard's bytes."""

    def __init__(self, processes: int, config: WorkerConfig, on_restart: Callable[[], None] | None = None):
        self.config, self.on_restart = config, on_restart
        self._context = multiprocessing.get_context("forkserver")
        start_fork_server()  # a no-op when ``serve`` started it already
        self._cond = threading.Condition()
        self._workers: list[_Worker | None] = [None] * processes
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self.restarts = 0
        self._start_error: Exception | None = None  # the last failure to start a worker
        self._decode_paths: dict[int, dict[tuple[str, str], int]] = {}  # per worker pid, its last snapshot
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
                    worker = _Worker.start(self._context, index, self.config)
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
                    self._cond.notify_all()
            with self._cond:
                running = [w for w in self._workers if w is not None]
            ready = multiprocessing.connection.wait([w.process.sentinel for w in running] + [self._wake_r])
            for worker in running:
                if worker.process.sentinel in ready:
                    self._gone(worker)

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
        worker.control.close()
        if not closed:
            log.error("transform worker process %d (pid %d) %s with %d shards in flight; starting a new one",
                      worker.index, worker.process.pid, _exit_text(worker.exitcode), worker.jobs)
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

    def decode_paths(self) -> dict[tuple[str, str], int]:
        """The workers' images by decode path, summed (each worker's count as of its last finished shard)."""
        total: dict[tuple[str, str], int] = {}
        with self._cond:
            snapshots = list(self._decode_paths.values())
        for snapshot in snapshots:
            for key, count in snapshot.items():
                total[key] = total.get(key, 0) + count
        return total

    # ------------------------------------------------------------------ one shard

    def transform(self, stream: BinaryIO, options: TransformOptions, *, shard: str, object_name: str, window: int,
                  limit: int, report: ShardReport, cancel: threading.Event, deadline: float) -> RemoteShard:
        """``engine.transform_shard`` of ``stream`` in a worker process: its chunks, its report, its errors."""
        worker = self._pick(shard, cancel, deadline)
        return RemoteShard(self, worker, stream, WorkerJob(shard, object_name, options, window, limit, deadline),
                           report, cancel)

    def _pick(self, shard: str, cancel: threading.Event, deadline: float) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise TransformerError(f"shard '{shard}': the server is shutting down")
                running = [w for w in self._workers if w is not None and not w.dead.is_set()]
                if running:
                    worker = min(running, key=lambda w: w.jobs)
                    worker.jobs += 1
                    return worker
                if cancel.is_set():
                    raise Cancelled(f"shard '{shard}': caller went away")
                if time.monotonic() > deadline:
                    raise TransformerError(f"shard '{shard}': object timeout exceeded waiting for a transform "
                                           "worker process to start")
                self._cond.wait(0.1)

    def _finished(self, worker: _Worker, paths: dict[tuple[str, str], int] | None) -> None:
        with self._cond:
            worker.jobs -= 1
            if paths is not None and worker.process.pid is not None:
                self._decode_paths[worker.process.pid] = paths


@dataclass(eq=False)
class _Worker:
    """The server's side of one worker process."""

    index: int
    process: multiprocessing.process.BaseProcess
    control: socket.socket
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    jobs: int = 0
    dead: threading.Event = dataclasses.field(default_factory=threading.Event)
    exitcode: int | None = None

    @classmethod
    def start(cls, context, index: int, config: WorkerConfig) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process = context.Process(target=worker_main, args=(theirs, config), name=f"transform worker {index}",
                                  daemon=True)
        try:
            process.start()  # waits for the fork server, which imports torch when it first starts
        finally:
            theirs.close()
        ours.settimeout(_READY_SECONDS)
        try:
            ready = ours.recv(16)
        except OSError:
            ready = b""
        if ready != READY:
            ours.close()
            process.kill()
            process.join(5)
            raise RuntimeError(f"transform worker {index} did not start ({_exit_text(process.exitcode)})")
        ours.settimeout(None)
        return cls(index, process, ours)

    def send(self, job: WorkerJob, fds: list[int]) -> None:
        with self.send_lock:
            socket.send_fds(self.control, [pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)], fds)

    def stop(self) -> None:
        self.control.close()  # the worker's control loop ends at its end of the socket
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class RemoteShard:
    """The output of one shard transformed in a worker: iterate for its chunks; ``bytes_in`` once done."""

    def __init__(self, owner: ShardProcesses, worker: _Worker, stream: BinaryIO, job: WorkerJob, report: ShardReport,
                 cancel: threading.Event):
        self.bytes_in = 0
        self.pid = worker.process.pid  # the worker process transforming it
        self._owner, self._worker, self._job, self._report, self._cancel = owner, worker, job, report, cancel
        self._feeder: _Feeder | None = None
        self._socket: socket.socket | None = None
        self._done = False
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket = ours
            fd = _file_descriptor(stream)
            if fd is None:
                self._feeder = _Feeder(stream, job.shard)
                fd = self._feeder.read_end
            try:
                worker.send(job, [theirs.fileno(), fd])
            except OSError as exc:  # the worker died since it was picked: its control socket is closed
                raise InternalError(f"shard '{job.shard}': the transform worker process (pid "
                                    f"{worker.process.pid}) could not take the shard: {exc}") from None
            finally:
                theirs.close()
                os.close(fd)  # the worker holds its own copies now
            if self._feeder is not None:
                self._feeder.start()
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[memoryview]:
        return self._frames()

    def _frames(self) -> Iterator[memoryview]:
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
                        raise TransformerError(f"shard '{job.shard}': object timeout exceeded after "
                                               f"{self._report.samples_in} samples")
                kind, size = HEADER.unpack(self._receive(HEADER.size))
                payload = self._receive(size)
                if kind == DATA:
                    yield memoryview(payload)
                    continue
                state, self.bytes_in, paths, failure = pickle.loads(payload)
                self._done = True
                _apply_report(self._report, state)
                self._owner._finished(self._worker, paths)
                self._worker = None  # counted off
                if failure is None:
                    return
                raise self._input_error() or _rebuilt(failure)
        finally:
            self.close()

    def _receive(self, size: int) -> bytes:
        """Exactly ``size`` bytes; the worker's end of the connection before that means it died.

        One call as a rule: MSG_WAITALL on a blocking socket returns short only at the end or on a
        signal. recv() allocates the bytes without zero-filling them first, as a bytearray would.
        """
        assert self._socket is not None
        data = self._socket.recv(size, socket.MSG_WAITALL) if size else b""
        if len(data) == size:
            return data
        parts, got = [data], len(data)
        while got < size:
            more = self._socket.recv(size - got, socket.MSG_WAITALL)
            if not more:
                raise self._died()
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def _input_error(self) -> BaseException | None:
        """The input's own failure (the body cut, the fetch refused), which is why the worker saw a short tar."""
        return self._feeder.error if self._feeder is not None else None

    def _died(self) -> TransformerError:
        worker, job = self._worker, self._job
        assert worker is not None
        worker.dead.wait(2.0)  # the supervisor reaps it and knows how it ended
        how = _exit_text(worker.exitcode) if worker.exitcode is not None else "closed its connection"
        return InternalError(
            f"shard '{job.shard}': the transform worker process (pid {worker.process.pid}) {how} after "
            f"{self._report.samples_out} samples; the shard was not completed")

    def close(self) -> None:
        """End the shard: a worker still transforming it sees its connection shut and stops."""
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
            self._socket = None
        if self._worker is not None:
            self._owner._finished(self._worker, None)
            self._worker = None


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


def _rebuilt(state: tuple) -> BaseException:
    cls, args, attributes = state
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


def _exit_text(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (SIGKILL: often the OOM killer at the container's memory limit)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"
