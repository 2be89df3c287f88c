"""A fake of the AIS target's side of ``ws://``: one session of connections, driven the way the Go target drives them.

What it models (AIS 5.0, ``ext/etl/websocket_comm.go``):

* ``createSession`` dials the session's connections once (gorilla's ``DefaultDialer``: no subprotocol,
  no compression; a 16 GiB read limit) and never dials again: 2 for the inline session, 8 per
  offline job by default. ``dials`` counts them; nothing here reconnects.
* ``writeLoop``: for each request a Binary JSON control message ``{"pipeline", "etl_args", "fqn",
  "path"}`` (Go's field order, every field omitted when empty, ``fqn`` = ``url.PathEscape(FQN)``),
  then the object's bytes as a Binary message only when there is no ``fqn``. Requests are pipelined:
  the next one goes out without waiting for the reply to the last.
* ``readLoop``: every message from the pod answers the oldest unanswered request on that connection
  (exactly one reply per request, FIFO). A Text message means "delivered by direct put" (its content
  is ignored); a Binary message is the object's bytes.
* When a connection ends (the pod closed it, whatever the code), its ``readLoop`` ends: a reply cut
  short fails that one request, and every request still queued on that connection is never answered
  (the target's ``task.wg.Wait()`` has no timeout; only the end of the session releases them). The
  session goes on with its other connections.

Where it differs: requests go to the connection the test names, or round robin over the live ones,
where the target's ``writeLoop`` goroutines take them from one shared channel (a free connection
takes the next). A message with no request waiting for it is recorded as ``unexpected`` (the
target would block); ``send_raw`` sends what the target never would (for protocol violations).

Every wait is bounded: ``Request.result`` raises after its timeout instead of hanging, and
``pending_after`` tells a test that a request stayed unanswered for a while.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from testbed.fake_ais import go_path_escape

REPLY_TIMEOUT = 60.0
MAX_MESSAGE = 16 * 2**30  # the target's conn.SetReadLimit(maxMsgSize)


@dataclass
class Reply:
    """One message from the pod, as the target's ``readLoop`` takes it."""

    binary: bool  # False: a Text message, "delivered by direct put"
    data: bytes  # a Binary message's bytes (a Text message's, UTF-8, for the failure messages)
    frames: int  # how many frames carried it

    @property
    def delivered(self) -> bool:
        return not self.binary


@dataclass
class Closed:
    """How a connection ended: the pod's close code and reason (1006: no close frame)."""

    code: int
    reason: str


class Request:
    """One object sent on a connection; answered by the next unclaimed reply there, or never."""

    def __init__(self, path: str, connection: int):
        self.path, self.connection = path, connection
        self.sent_at = time.monotonic()
        self.reply: Reply | None = None
        self.failure: str | None = None  # the connection ended inside this request's reply
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _answer(self, reply: Reply | None, failure: str | None = None) -> None:
        self.reply, self.failure = reply, failure
        self._done.set()

    def result(self, timeout: float = REPLY_TIMEOUT) -> Reply:
        """The reply, waiting at most ``timeout`` seconds; AssertionError if none came or it was cut short."""
        if not self._done.wait(timeout):
            raise AssertionError(f"request {self.path!r} on connection {self.connection}: no reply within "
                                 f"{timeout:.0f} s (the target would wait forever)")
        if self.reply is None:
            raise AssertionError(f"request {self.path!r} on connection {self.connection}: {self.failure}")
        return self.reply

    def pending_after(self, seconds: float) -> bool:
        """Whether the request is still unanswered after waiting ``seconds``."""
        return not self._done.wait(seconds)


class Connection:
    """One dialed connection: a writer thread (the ``writeLoop``) and a reader thread (the ``readLoop``)."""

    def __init__(self, index: int, ws: ClientConnection):
        self.index, self.ws = index, ws
        self.closed: Closed | None = None
        self.unexpected: list[Reply] = []  # messages that answered no request
        self._outbox: queue.Queue[tuple[Request | None, list[bytes | str]] | None] = queue.Queue()
        self._queued: deque[Request] = deque()  # sent, not yet answered: the target's transformCh
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name=f"fake-ws-write-{index}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"fake-ws-read-{index}", daemon=True)
        self._writer.start()
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()

    @property
    def queued(self) -> list[Request]:
        """The requests sent on this connection and not answered (yet, or ever once it ended)."""
        with self._lock:
            return list(self._queued)

    def send(self, request: Request | None, messages: list[bytes | str]) -> None:
        """Queue ``messages`` for the writer (which never makes the caller wait); ``request`` awaits a reply."""
        self._outbox.put((request, messages))

    def wait_closed(self, timeout: float) -> Closed | None:
        """How the connection ended, once it did (within ``timeout``), else None."""
        self._ended.wait(timeout)
        return self.closed

    def _write_loop(self) -> None:
        broken = False
        while (item := self._outbox.get()) is not None:
            request, messages = item
            if request is not None:
                with self._lock:  # before sending: the reader must find it when the reply arrives
                    self._queued.append(request)
            if broken:
                continue  # handed to this connection after it ended: queued for good, as on the target
            try:
                for message in messages:
                    self.ws.send(message)
            except ConnectionClosed:
                broken = True  # the reader records the end; the request stays queued, as on the target

    def _read_loop(self) -> None:
        try:
            while True:
                fragments = self.ws.recv_streaming()
                first = next(fragments)  # the start of the next message
                with self._lock:
                    request = self._queued.popleft() if self._queued else None
                parts = [first]
                try:
                    parts.extend(fragments)
                except ConnectionClosed as closed:
                    if request is not None:
                        request._answer(None, f"the connection ended inside the reply ({_closed(closed)})")
                    raise
                binary = isinstance(first, bytes)
                data = b"".join(parts) if binary else "".join(parts).encode()
                reply = Reply(binary=binary, data=data, frames=len(parts))
                if request is None:
                    self.unexpected.append(reply)
                else:
                    request._answer(reply)
        except ConnectionClosed as closed:
            self.closed = _closed(closed)
        finally:
            self._ended.set()

    def close(self, timeout: float) -> None:
        self._outbox.put(None)
        self.ws.close()
        self._writer.join(timeout)
        self._reader.join(timeout)


def _closed(exc: ConnectionClosed) -> Closed:
    return Closed(exc.rcvd.code, exc.rcvd.reason) if exc.rcvd is not None else Closed(1006, "no close frame")


def control_message(path: str, fqn: str | None = None, etl_args: str | None = None,
                    pipeline: str | None = None) -> bytes:
    """The target's control message: Go's field order, empty fields omitted, ``fqn`` path-escaped once."""
    message = {"pipeline": pipeline, "etl_args": etl_args, "fqn": go_path_escape(fqn) if fqn else None,
               "path": path}
    return json.dumps({k: v for k, v in message.items() if v}).encode()


class FakeWsSession:
    """``connections`` ws connections to the pod at ``url`` (``ws://host:port/ws``), dialed once."""

    def __init__(self, url: str, connections: int = 2, open_timeout: float = 10.0):
        self.url = url
        self.dials = 0
        self.connections: list[Connection] = []
        self._next = 0
        try:
            for index in range(connections):
                # Entered as a context manager, which is how websockets wants a connection used.
                ws = connect(url, max_size=MAX_MESSAGE, compression=None, open_timeout=open_timeout,
                             close_timeout=5, ping_interval=None).__enter__()  # the target sends no pings
                self.dials += 1
                self.connections.append(Connection(index, ws))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FakeWsSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, path: str, *, fqn: str | None = None, content: bytes | None = None,
               etl_args: str | None = None, pipeline: str | None = None, connection: int | None = None) -> Request:
        """Send one object's request (control message, then ``content`` unless ``fqn``); returns at once.

        ``connection``: the index of the connection to use; None: the next live one, round robin.
        """
        if (fqn is None) == (content is None):
            raise ValueError("give either fqn or content")
        target = self.connections[connection] if connection is not None else self._next_alive()
        request = Request(path, target.index)
        message = control_message(path, fqn, etl_args, pipeline)
        target.send(request, [message] if content is None else [message, content])
        return request

    def send_raw(self, connection: int, data: bytes | str) -> None:
        """A message the target never sends (a protocol violation), on connection ``connection``."""
        self.connections[connection].send(None, [data])

    def _next_alive(self) -> Connection:
        for _ in range(len(self.connections)):
            candidate = self.connections[self._next % len(self.connections)]
            self._next += 1
            if candidate.alive:
                return candidate
        raise AssertionError("every connection of the session has ended (the target would queue forever)")

    def close(self, timeout: float = 10.0) -> None:
        """End the session (the target's ``Finish``): close every connection, bounded."""
        for conn in self.connections:
            conn.close(timeout)
