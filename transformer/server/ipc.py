"""Messages between the pod's processes: framed writes and exact reads on stream sockets, and exceptions
that cross a process boundary with their fields.

Only the server and the worker processes it started hold these sockets (socket pairs, passed as
file descriptors), so pickle is safe on them.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Sequence

from ..errors import InternalError

Buffer = bytes | bytearray | memoryview


def send_parts(sock: socket.socket, parts: Sequence[Buffer]) -> None:
    """Write ``parts`` back to back with ``sendmsg`` (no join: the buffers go to the socket as they are)."""
    pending = [part for part in parts if len(part)]
    while pending:
        drop_sent(pending, sock.sendmsg(pending))


def drop_sent(parts: list[Buffer], sent: int) -> None:
    """Remove the first ``sent`` bytes from a ``sendmsg`` buffer list, in place (a partial send)."""
    while sent:
        first = len(parts[0])
        if sent >= first:
            sent -= first
            parts.pop(0)
        else:
            parts[0] = memoryview(parts[0])[sent:]
            sent = 0


def receive_exact(sock: socket.socket, size: int) -> bytes | None:
    """Exactly ``size`` bytes, or None when the peer closed the connection before them.

    One call as a rule: MSG_WAITALL on a blocking socket returns short only at the end or on a signal.
    """
    if not size:
        return b""
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) == size:
        return data
    if not data:
        return None
    parts, got = [data], len(data)
    while got < size:
        more = sock.recv(size - got, socket.MSG_WAITALL)
        if not more:
            return None
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def receive_into(sock: socket.socket, buffer: memoryview) -> bool:
    """Fill ``buffer`` from the socket; False when the peer closed the connection first."""
    while buffer:
        got = sock.recv_into(buffer, len(buffer), socket.MSG_WAITALL)
        if not got:
            return False
        buffer = buffer[got:]
    return True


def portable(exc: BaseException) -> tuple:
    """An exception as (class, args, attributes): our errors take several arguments, which pickle cannot replay."""
    state = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))
    try:
        pickle.loads(pickle.dumps(state))
    except Exception:
        message = f"internal error: {exc!r}"
        return (InternalError, (message,), {"message": message})
    return state


def rebuilt(state: tuple) -> BaseException:
    """The exception ``portable`` described, with its class, arguments and attributes."""
    cls, args, attributes = state
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc
