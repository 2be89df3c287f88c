"""The link between two transform worker processes: ``Link``, one stream socket used both ways.

The server pairs every two workers (``processes.py``). A shard's leader sends samples over the link to the
other worker, which transforms them and sends back the results; each side reads its end on a thread of its
own. A message is a header (kind, id, metadata length, data length), pickled metadata and data:

* ``OPTIONS`` (leader to worker): a shard's ``TransformOptions``, once per link and shard
  (``FORGET`` when the shard ends);
* ``TASK``: a sample: its members' names and tar fields, and the payloads of those to transform;
* ``RESULT``: the output members: an input member kept as it is, or a new one whose pieces are in the
  worker's arena or inline (small pieces, or the arena full), or the sample's error.

Large payloads cross in shared memory (``arena.py``): a sample's input in the leader's arena, its output
arrays in the worker's. A sample sent over a link is a ``RemoteTask``; should the link be lost, the leader
runs it itself (``RemoteTask.run_here``). Where samples go is ``spread.py``.
"""

from __future__ import annotations

import _thread
import contextlib
import itertools
import logging
import os
import pickle
import socket
import struct
import tarfile
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Protocol

from ..errors import InternalError
from ..options import TransformOptions
from ..pool import Task, TransformPool
from ..samples import member_kind, transform_into, transform_sample
from ..shards import Member, Sample, member_header
from . import arena as arenas
from .ipc import portable, rebuilt, receive_into, send_parts

log = logging.getLogger("transformer.server")

HEADER = struct.Struct("!BQIQ")  # kind, id, metadata length, data length
OPTIONS, FORGET, TASK, RESULT = 1, 2, 3, 4
_BUFFER = 4 << 20  # socket buffers: a sample or an inline result in one go, mostly
_TAR_FIELDS = ("mode", "mtime", "uid", "gid", "uname", "gname")


class RemoteTask:
    """A sample sent to another worker; what the engine uses of a task (``done``, ``result``, ``cancel``)."""

    __slots__ = ("link", "sample", "options", "shard", "object_name", "on_done", "_release", "_finished",
                 "_value", "_error")

    def __init__(self, link: Link, sample: Sample, options: TransformOptions, shard: str, object_name: str,
                 on_done: Callable[[], None] | None, release: Callable[[], None]):
        self.link, self.sample, self.options, self.shard, self.object_name = link, sample, options, shard, object_name
        self.on_done, self._release = on_done, release
        self._finished = _thread.allocate_lock()  # held until the result (or the error) is in
        self._finished.acquire()
        self._value: list[Member] | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return not self._finished.locked()

    def cancel(self) -> None:
        """Nothing to skip: the worker runs it, and the result is dropped (its arena blocks freed with it)."""

    def result(self) -> list[Member]:
        with self._finished:
            pass
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def finish(self, value: list[Member] | None, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self.sample = self.options = None  # the input's bytes go now
        self._release()
        self._finished.release()
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            try:
                on_done()
            except Exception:
                log.exception("a transform task's completion callback failed")

    def run_here(self, pool: TransformPool) -> None:
        """Run the sample on this process's threads (its worker is gone); this task completes with it, or fails
        its shard: a sample adopted from a lost worker is never skipped."""
        assert self.sample is not None
        key = self.sample.key
        local = Task(transform_sample, (self.sample, self.options, self.shard, self.object_name),
                     lambda: self._adopt(local, key))
        try:
            pool.run(local)
        except RuntimeError as exc:  # this process is stopping: its pool takes no more
            self.finish(None, InternalError(f"shard '{self.shard}': sample '{key}' was lost with its transform "
                                            f"worker and could not run again here: {exc}"))

    def _adopt(self, local: Task, key: str) -> None:
        try:
            value = local.result()
        except CancelledError:  # this process's pool is shutting down
            self.finish(None, InternalError(f"shard '{self.shard}': sample '{key}' was lost with its transform "
                                            "worker, and its run here was cancelled"))
        except BaseException as exc:
            self.finish(None, exc)
        else:
            self.finish(value, None)


class Peers(Protocol):
    """What a link needs of the worker it belongs to (``spread.Peers``)."""

    arena: arenas.Arena  # this worker's: our samples' inputs, its results' outputs
    pool: TransformPool  # this worker's threads

    def lost(self, link: Link, reason: str) -> None: ...

    def count_served(self) -> None: ...


class Link:
    """The connection to one other worker process, both ways."""

    _idents = itertools.count(1)

    def __init__(self, peers: Peers, index: int, pid: int, sock: socket.socket, arena_fd: int):
        self.peers, self.index, self.pid, self.sock = peers, index, pid, sock
        self.ident = next(self._idents)  # this link's blocks in our arena
        self.arena = arenas.attach(arena_fd)  # the other worker's arena: its pieces of our samples
        os.close(arena_fd)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _BUFFER)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.sent: dict[int, RemoteTask] = {}  # our samples it holds, by task id
        self._ids = itertools.count(1)
        self.dead = False
        self._options: dict[int, TransformOptions] = {}  # its shards' options, by its id
        self._running: dict[int, Task] = {}  # its samples on our threads
        self._thread = threading.Thread(target=self._read, name=f"link to worker {index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def outstanding(self) -> int:
        return len(self.sent)

    def send(self, kind: int, ident: int, meta: bytes, data: list) -> None:
        header = HEADER.pack(kind, ident, len(meta), sum(len(piece) for piece in data))
        with self._send_lock:
            send_parts(self.sock, [header, meta, *data])

    # ---------------------------------------------------------------- leading: our samples there

    def submit(self, task: RemoteTask, options_id: int) -> bool:
        """Send ``task``'s sample; False when the link is gone (the caller runs it elsewhere).

        The members to transform travel in our arena when it has room (the worker decodes them there),
        else inline; the others travel as their names and tar fields only.
        """
        sample = task.sample
        assert sample is not None
        options, arena = task.options, self.peers.arena
        members, data = [], []
        for member, extension in zip(sample.members, sample.extensions):
            info = member.info
            place = None
            if _transforms(extension, options):
                offset = arena.put(self.ident, member.pieces) if arena.fits(info.size) else None
                if offset is None:
                    place = ("i",)
                    data.extend(member.pieces)
                else:
                    place = ("a", offset)
            members.append((info.name, info.size, *(getattr(info, f) for f in _TAR_FIELDS), place))
        meta = pickle.dumps((options_id, task.shard, task.object_name, sample.key, sample.extensions, members),
                            protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self.dead:
                return False
            ident = next(self._ids)
            self.sent[ident] = task
        try:
            self.send(TASK, ident, meta, data)
        except OSError:
            self.peers.lost(self, "a sample could not be sent")
        return True

    def share(self, options_id: int, options: TransformOptions) -> bool:
        try:
            self.send(OPTIONS, options_id, pickle.dumps(options, protocol=pickle.HIGHEST_PROTOCOL), [])
            return True
        except OSError:
            self.peers.lost(self, "a shard's options could not be sent")
            return False

    def forget(self, options_id: int) -> None:
        try:
            self.send(FORGET, options_id, b"", [])
        except OSError:
            self.peers.lost(self, "a shard's end could not be sent")

    def _result(self, ident: int, meta: bytes, data: bytearray) -> None:
        with self._lock:
            task = self.sent.pop(ident, None)
        if task is None:
            return
        try:
            members = self._members(task, meta, data)
        except BaseException as exc:  # a result that cannot be read must still end its task, never hang the shard
            log.exception("shard %s: the result of a sample from transform worker %d could not be read",
                          task.shard, self.index)
            task.finish(None, InternalError(f"shard '{task.shard}': a sample's result from transform worker "
                                            f"{self.index} could not be read: {exc!r}"))
            return
        if isinstance(members, BaseException):
            task.finish(None, members)
        else:
            task.finish(members, None)

    def _members(self, task: RemoteTask, meta: bytes, data: bytearray) -> list[Member] | BaseException:
        """The output members a result describes (their pieces in the worker's arena or in ``data``), or its error."""
        status, body = pickle.loads(meta)
        if status != "ok":
            return rebuilt(body)
        view, sample, members = memoryview(data), task.sample, []
        assert sample is not None
        for entry in body:
            if isinstance(entry, int):
                members.append(sample.members[entry])
                continue
            name, size, header, places = entry
            pieces = []
            for place in places:
                if place[0] == "a":
                    pieces.append(arenas.lease(self.arena, place[1], place[2]))
                else:
                    pieces.append(view[:place[1]])
                    view = view[place[1]:]
            info = tarfile.TarInfo(name)
            info.size = size
            members.append(Member(info=info, pieces=pieces, header=header))
        return members

    # ---------------------------------------------------------------- serving: its samples here

    def _task(self, ident: int, meta: bytes, data: bytearray) -> None:
        options_id, shard, object_name, key, extensions, specs = pickle.loads(meta)
        options = self._options.get(options_id)
        view, members = memoryview(data), []
        for name, size, *fields, place in specs:
            info = tarfile.TarInfo(name)
            info.size = size
            for field, value in zip(_TAR_FIELDS, fields):
                setattr(info, field, value)
            pieces: list = []
            if place is not None and size:
                if place[0] == "a":
                    pieces = [arenas.lease(self.arena, place[1], size)]  # decoded where it lies
                else:
                    pieces = [bytearray(view[:size])]  # the decoders read a bytearray in place
                    view = view[size:]
            members.append(Member(info=info, pieces=pieces))
        sample = Sample(key, members, extensions)
        if options is None:  # never: a shard's options precede its samples on the link
            error = InternalError(f"shard '{shard}': sample '{key}' arrived before its options")
            self._reply(ident, sample, None, error)
            return
        outputs = _Outputs(self.peers.arena)
        task = Task(transform_into, (outputs, sample, options, shard, object_name),
                    lambda: self._finished(ident, sample, task, outputs))
        with self._lock:
            self._running[ident] = task
        self.peers.pool.run(task)

    def _finished(self, ident: int, sample: Sample, task: Task, outputs: _Outputs) -> None:
        with self._lock:
            self._running.pop(ident, None)
        try:
            members = task.result()
        except CancelledError:
            members, error = None, None  # its leader is gone
        except BaseException as exc:
            members, error = None, exc
        else:
            error = None
        try:
            if members is not None or error is not None:
                self._reply(ident, sample, members, error, outputs)
        finally:
            outputs.done(self.ident)

    def _reply(self, ident: int, sample: Sample, members: list[Member] | None, error: BaseException | None,
               outputs: _Outputs | None = None) -> None:
        if self.dead:
            return  # its leader is gone
        data: list = []
        if error is not None:
            meta = pickle.dumps(("error", portable(error)), protocol=pickle.HIGHEST_PROTOCOL)
        else:
            assert members is not None
            body: list = []
            arena = self.peers.arena
            for member in members:
                index = next((i for i, source in enumerate(sample.members) if source is member), None)
                if index is not None:
                    body.append(index)
                    continue
                places = []
                for piece in member.pieces:
                    size = len(piece)
                    offset = outputs.used(piece) if outputs is not None else None
                    if offset is None and arena.fits(size):
                        offset = arena.put(self.ident, [piece])
                    if offset is None:
                        places.append(("i", size))
                        data.append(piece)
                    else:
                        places.append(("a", offset, size))
                # Its tar header made here, on the thread that transformed it: not on the leader's, which writes
                # every sample of the shard in turn.
                body.append((member.info.name, member.info.size, member_header(member), places))
            meta = pickle.dumps(("ok", body), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.send(RESULT, ident, meta, data)
        except OSError:
            self.peers.lost(self, "a result could not be sent")
        else:
            self.peers.count_served()

    # ---------------------------------------------------------------- both

    def _read(self) -> None:
        reader, reason = _Reader(self.sock), "it closed the link"
        try:
            while True:
                header = reader.take(HEADER.size)
                if header is None:
                    break
                kind, ident, meta_size, data_size = HEADER.unpack(header)
                meta = reader.take(meta_size)
                data = reader.take_into(bytearray(data_size)) if data_size else bytearray()
                if meta is None or data is None:
                    break
                if kind == TASK:
                    self._task(ident, meta, data)
                elif kind == RESULT:
                    self._result(ident, meta, data)
                elif kind == OPTIONS:
                    self._options[ident] = pickle.loads(meta)
                elif kind == FORGET:
                    self._options.pop(ident, None)
        except OSError as exc:
            reason = f"the link failed ({exc})"
        except Exception:
            log.exception("the link to transform worker %d failed", self.index)
            reason = "the link failed"
        self.peers.lost(self, reason)

    def close(self) -> list[RemoteTask]:
        """End the link: our samples still there (to run elsewhere); its samples here are skipped."""
        with self._lock:
            if self.dead:
                return []
            self.dead = True
            sent, self.sent = list(self.sent.values()), {}
            running, self._running = list(self._running.values()), {}
        for task in running:
            task.cancel()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.peers.arena.release(self.ident)
        return sent


class _Reader:
    """A link's incoming bytes, read in large pieces: a message's header and metadata come from one buffer
    (one system call for many small messages), its data straight into its own buffer when large."""

    _SIZE = 256 * 1024

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray(self._SIZE)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    def _fill(self) -> bool:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == self._SIZE:  # a partial message at the end: to the front
            left = self._end - self._start
            self._buffer[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        got = self.sock.recv_into(self._view[self._end:])
        self._end += got
        return got > 0

    def take(self, size: int) -> bytes | None:
        """The next ``size`` bytes (at most the buffer's size); None at the end of the link."""
        while self._end - self._start < size:
            if not self._fill():
                return None
        data = bytes(self._view[self._start:self._start + size])
        self._start += size
        return data

    def take_into(self, data: bytearray) -> bytearray | None:
        """Fill ``data``: what the buffer holds first, then straight from the socket."""
        have = min(len(data), self._end - self._start)
        data[:have] = self._view[self._start:self._start + have]
        self._start += have
        return data if receive_into(self.sock, memoryview(data)[have:]) else None


class _Outputs:
    """A sample's output arrays, allocated in this worker's arena as it is transformed (``transform_into``):
    those its result sends are lent to the leader's link, the others freed."""

    __slots__ = ("arena", "_blocks", "_used")

    def __init__(self, arena: arenas.Arena):
        self.arena = arena
        self._blocks: list[int] = []
        self._used: list[int] = []

    def __call__(self, size: int) -> memoryview | None:
        if not self.arena.fits(size):
            return None
        taken = self.arena.allocate(size)
        if taken is None:
            return None
        self._blocks.append(taken[0])
        return taken[1]

    def used(self, piece) -> int | None:
        """The block ``piece`` lies in, if it is one of ours; it goes with the result."""
        if not self._blocks or not self.arena.fits(len(piece)):
            return None
        offset = self.arena.locate(piece)
        if offset is None or offset not in self._blocks or offset in self._used:
            return None
        self._used.append(offset)
        return offset

    def done(self, link: int) -> None:
        """The result was sent (or not): its blocks are the leader's to release, the rest free now."""
        if self._used:
            self.arena.lend(link, self._used)
        for offset in self._blocks:
            if offset not in self._used:
                self.arena.free(offset)
        self._blocks, self._used = [], []


def _transforms(extension: str | None, options: TransformOptions) -> bool:
    return member_kind(extension, options) != "other"
