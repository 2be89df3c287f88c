"""A shard led by a worker process, as the server sees it: ``RemoteShard``.

The server hands the worker the shard's input (the object's file itself, or a pipe a ``_Feeder`` fills)
and a stream socket, relays the frames that come back until the first chunk started the response, then
hands over the caller's connection (``offer``) and waits for the shard's end: its report, its error, or
the worker's death, which fails the shard by name (a ws frame the worker left cut is completed first).
The supervisor of the workers is ``processes.py``; the worker's side is ``worker.py``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.process
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
from typing import BinaryIO, Protocol

from ..engine import ShardReport
from ..errors import Cancelled, FrameCut, InternalError, TransformerError, WorkerGone
from .direct import FrameLog, bytes_written, socket_of
from .ipc import rebuilt, receive_exact
from .worker import DATA, FEED, HEADER, NO_OFFER, OFFER_HTTP, OFFER_WS, RAW, WorkerJob

log = logging.getLogger("transformer.server")

_GRACE_SECONDS = 2.0  # past the deadline, the worker's own timeout error (with its counts) is awaited this long


class Leader(Protocol):
    """What a remote shard needs of the worker process leading it (``processes._Worker``)."""

    process: multiprocessing.process.BaseProcess
    dead: threading.Event  # set once the supervisor reaped it
    killed: str | None  # why the supervisor killed it
    exitcode: int | None

    def send(self, message: tuple, fds: list[int]) -> None: ...


class RemoteShard:
    """One shard led by a worker: iterate for its frames (``bytes`` to send, ``Raw`` to write as is).

    ``bytes_in``, ``send_path`` and ``direct_bytes`` (what the worker wrote to the connection itself) are
    set once the worker reported the end."""

    def __init__(self, worker: Leader, stream: BinaryIO | None, job: WorkerJob,
                 report: ShardReport, cancel: threading.Event, input_fd: int | None = None,
                 input_error: Callable[[], BaseException | None] | None = None):
        self.bytes_in = 0
        self.send_path = "loop"
        self.direct_bytes = 0
        self.pid = worker.process.pid  # the worker process leading it
        self._worker, self._job, self._report, self._cancel = worker, job, report, cancel
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
        how = worker.killed or (exit_text(worker.exitcode) if worker.exitcode is not None
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


def exit_text(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (SIGKILL: often the OOM killer at the container's memory limit)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"
