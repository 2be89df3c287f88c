"""Direct send: a response's frames written from the shard's own threads (``FrameWriter``, frame builders).

Through ASGI every chunk crosses to the event loop, which frames it (uvicorn joins the chunk-size
line, the array and the CRLF into a new bytes object) and writes it holding the GIL, while the
transform threads wait for it. So once the first chunk went out through uvicorn and its write buffer
is empty, the shard's threads write the rest of the body: ``sendmsg`` on a duplicate of the socket,
the GIL released, no copy in Python. The end goes back to the event loop, so uvicorn's or websockets'
state (keep-alive, the final chunk, the frame with FIN, the abort on failure) stays exactly theirs. A
frame that stays unwritten for ``STALL_SECONDS`` while the body is still arriving goes to uvicorn's
transport and the output returns to the event loop's path (a half-duplex caller).
docs/design.md measures both choices.

**Never over TLS**: only the transport's SSL object may write a TLS connection's socket, so such a
connection always takes the event loop's path (``encrypted``).
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
from collections.abc import Callable

from ..engine import Write
from ..errors import Cancelled
from .ipc import drop_sent
from .protocols import encrypted

STALL_SECONDS = 0.2  # a frame not accepted by the socket for this long, with the body still arriving
_POLL = 0.05  # how often a blocked send checks for cancellation and stalls
HOLD = 64 * 1024  # chunks smaller than this may wait for the next one (FrameWriter.send)
_HOLD_COUNT = 64  # and at most this many (sendmsg takes at most IOV_MAX = 1024 buffers)


async def drained(transport: asyncio.Transport, timeout: float) -> bool:
    """Wait until uvicorn's transport has written everything it holds; False after ``timeout``.

    Also False, at once, for a TLS connection: its socket is never written to directly.
    """
    if encrypted(transport):
        return False
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while transport.get_write_buffer_size():
        if transport.is_closing() or loop.time() > end:
            return False
        await asyncio.sleep(0.001)
    return not transport.is_closing()


def chunked_frame(size: int) -> tuple[bytes, bytes]:
    """HTTP/1.1 chunked encoding (RFC 9112 7.1): the size line before the data, CRLF after."""
    return b"%x\r\n" % size, b"\r\n"


def ws_continuation_frame(size: int) -> tuple[bytes, bytes]:
    """A WebSocket continuation frame's header, FIN clear, unmasked (server to client; RFC 6455 5.2).

    Written here because websockets builds a frame by copying its payload into one bytes object
    (``Frame.serialize``), which is the copy direct send exists to avoid; tests/server/test_direct.py
    checks these headers against websockets' own for every length encoding.
    """
    if size < 126:
        return bytes((0x00, size)), b""
    if size < 1 << 16:
        return struct.pack("!BBH", 0x00, 126, size), b""
    return struct.pack("!BBQ", 0x00, 127, size), b""


def socket_of(transport: asyncio.Transport) -> int:
    """A duplicate of the connection's socket descriptor, for a thread or a worker process to write frames to.

    A duplicate: uvloop may close its own when the peer goes away while we write. Raises ``OSError`` for
    a TLS connection (only its transport may write to the socket) or a closed one.
    """
    if encrypted(transport):
        raise OSError("a TLS connection: only its transport may write to the socket")
    raw = transport.get_extra_info("socket")
    if raw is None or raw.fileno() < 0:
        raise OSError("the connection has no open socket")
    return os.dup(raw.fileno())


class FrameWriter:
    """Writes a response's frames to the connection's socket from the shard's own threads (module docstring).

    ``fd`` is the writer's own descriptor of the socket (closed by ``close``). ``fallback`` takes bytes
    that must reach the connection through whoever else writes it, in order: the rest of a frame when
    the socket stalled while the body is still arriving, or the rest of a ws frame cut short by a
    failure (the server's event loop; from a worker process, the server). ``frame`` gives the bytes
    around a frame's data: HTTP chunked encoding (the default), or WebSocket continuation frames.
    ``protocol_ends_message``: the server's protocol sends the message's last frame (websockets: the
    frame with FIN, after a failure carrying the error text), so ``take_tail`` hands it the held chunks
    and ``close`` completes a frame cut short.
    """

    def __init__(self, fd: int, fallback: Callable[[bytes], None], frame: Callable[[int], tuple[bytes, bytes]] =
                 chunked_frame, protocol_ends_message: bool = False,
                 on_frame: Callable[[int, bytes], None] | None = None):
        self._fallback, self._wrap = fallback, frame
        self._protocol_ends_message = protocol_ends_message
        # Told where each frame ends (bytes of frames so far) and its header before any of its bytes go out:
        # whoever writes the connection after a writer that died can complete a frame it cut (``FrameLog``).
        self._on_frame, self._framed = on_frame, 0
        self._sock = socket.socket(fileno=fd)
        # Non-blocking, as the event loop needs it; a full socket is waited for with poll(), and only
        # then (a socket with a timeout polls before every send: a system call per frame for nothing).
        self._sock.setblocking(False)
        self._writable = select.poll()
        self._writable.register(self._sock.fileno(), select.POLLOUT)
        # Small chunks (tar headers, labels, padding: what the engine gathers between two arrays) wait
        # here and go out in one frame, and one sendmsg, with the next array.
        self._held: list[bytes | memoryview] = []
        self._held_bytes = 0
        # What try_send could not write (the socket was full), written first by the next send or flush;
        # or a frame cut short by a cancel (see close).
        self._unsent: list[bytes | memoryview] = []

    def send(self, chunk: bytes | memoryview, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        """Write one frame. False: the socket stalled and the rest went to the transport (use ASGI now).

        ``cancel`` raises if the job must stop; ``stalled`` says whether waiting longer could deadlock.
        A chunk under ``HOLD`` bytes may be held and written with the next one (``flush`` writes it).
        """
        if not chunk:
            return True  # an empty frame would end the body
        if self._held_bytes + len(chunk) < HOLD and len(self._held) < _HOLD_COUNT:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            return True
        return self._write(chunk, cancel, stalled)

    def try_send(self, chunk: bytes | memoryview) -> Write:
        """``send`` that never waits, for a transform thread (``Output.try_write``): ``Write.OK`` when the
        frame was written or the chunk held, ``Write.FULL`` when the socket took part of it (the rest
        goes first with the next ``send`` or ``flush``, which the shard's driver makes)."""
        if self._unsent and not self._send_nowait(self._unsent):
            return Write.REFUSED  # a frame is still unfinished: the driver's blocking send finishes it
        if not chunk:
            return Write.OK
        if self._held_bytes + len(chunk) < HOLD and len(self._held) < _HOLD_COUNT:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            return Write.OK
        parts = self._frame(chunk)
        if not self._send_nowait(parts):
            self._unsent = parts
            return Write.FULL
        return Write.OK

    def _send_nowait(self, parts: list[bytes | memoryview]) -> bool:
        """One non-blocking ``sendmsg``; drops what was sent from ``parts``; whether all of it went."""
        try:
            sent = self._sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError as exc:  # EPIPE, ECONNRESET: the caller went away
            raise Cancelled(f"caller went away while receiving ({exc.strerror or exc})") from None
        drop_sent(parts, sent)
        return not parts

    def flush(self, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        """Write what ``send`` held back (the end of a body); False as for ``send``."""
        return self._write(b"", cancel, stalled) if self._held_bytes or self._unsent else True

    def take_tail(self) -> bytes:
        """At the end of the output: the held chunks, for the protocol's last frame (``protocol_ends_message``).

        Otherwise nothing: ``flush`` writes them.
        """
        if not self._protocol_ends_message:
            return b""
        held, self._held, self._held_bytes = self._held, [], 0
        return b"".join(held)

    def _frame(self, chunk: bytes | memoryview) -> list[bytes | memoryview]:
        """The held pieces and ``chunk`` as one frame (nothing when both are empty)."""
        held, self._held, size = self._held, [], self._held_bytes + len(chunk)
        self._held_bytes = 0
        if not size:
            return []
        prefix, suffix = self._wrap(size)
        if self._on_frame is not None:
            self._framed += len(prefix) + size + len(suffix)
            self._on_frame(self._framed, prefix)
        return [prefix, *held, chunk, suffix] if suffix else [prefix, *held, chunk]

    def _write(self, chunk: bytes | memoryview, cancel: Callable[[], None], stalled: Callable[[], bool]) -> bool:
        parts, self._unsent = [*self._unsent, *self._frame(chunk)], []
        waited = 0.0
        try:
            while parts:
                try:
                    sent = self._sock.sendmsg(parts)
                except BlockingIOError:
                    writable = self._writable.poll(_POLL * 1000)
                    cancel()  # also when poll() says writable and the socket still refuses: never spin unchecked
                    if writable:
                        continue  # (or failed: the next sendmsg says how)
                    waited += _POLL
                    if waited >= STALL_SECONDS and stalled():
                        self._to_transport(parts)
                        return False
                    continue
                except OSError as exc:  # EPIPE, ECONNRESET: the caller went away
                    parts.clear()  # nobody will read the rest of the frame
                    raise Cancelled(f"caller went away while receiving ({exc.strerror or exc})") from None
                waited = 0.0
                drop_sent(parts, sent)
        finally:
            self._unsent = parts  # a frame cut short by ``cancel`` (object timeout): see ``close``
        return True

    def _to_transport(self, parts: list[bytes | memoryview]) -> None:
        """The rest of a frame goes to whoever writes the connection next (``fallback``), in order."""
        if parts:
            self._fallback(b"".join(parts))
            parts.clear()

    def close(self) -> None:
        """Stop writing. With ``protocol_ends_message``, the rest of a frame cut short goes to the transport.

        A ws reply that fails mid-message is ended by the websockets protocol with a last frame that
        carries the error text, through the transport: a frame (or a pong) inside a frame's payload
        would be read as payload, so the frame is completed first. An HTTP response that fails is cut
        off by uvicorn instead, so a cut frame stays cut.
        """
        if self._protocol_ends_message:
            self._to_transport(self._unsent)
        self._unsent = []
        self._sock.close()



class FrameLog:
    """The last frames a worker process began on a ws connection: where each ends and its header, in shared memory.

    Why: a worker that dies (the OOM killer) may leave a frame cut on the connection, and a ws
    connection must stay usable (AIS never dials it again): the server completes that frame, the
    rest of its header as it was and its payload as ``FILLER``, before the reply's last frame carries
    the error. A writer begins a frame only once the one before the previous is complete, so three
    entries always hold the boundary at or before what reached the socket.
    """

    SLOTS, SLOT = 3, 32  # per entry: the frame's end (8 bytes), its header's length (1), the header (<= 14)
    FILLER = b"\xff"  # no tar header nor end-of-archive block is made of these

    def __init__(self, fd: int | None = None):
        import mmap

        size = self.SLOTS * self.SLOT
        if fd is None:
            fd = os.memfd_create("wds-transform-frames", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)

    def record(self, end: int, header: bytes) -> None:
        """A new frame (writer's side): the oldest entry makes room."""
        self._map.move(0, self.SLOT, (self.SLOTS - 1) * self.SLOT)
        entry = struct.pack("!QB", end, len(header)) + header
        at = (self.SLOTS - 1) * self.SLOT
        self._map[at:at + len(entry)] = entry

    def rest(self, written: int) -> bytes | None:
        """What completes the frame cut after ``written`` bytes of frames (server's side, the writer gone);
        None when the log cannot tell (then only closing the connection is safe)."""
        entries = []
        for index in range(self.SLOTS):
            end, length = struct.unpack_from("!QB", self._map, index * self.SLOT)
            header = self._map[index * self.SLOT + 9:index * self.SLOT + 9 + length]
            entries.append((end, header))
        if entries[0][0] and written < entries[0][0]:
            return None  # before the oldest boundary the log keeps: never, as the writer works
        start = entries[0][0]
        for end, header in entries[1:] if entries[0][0] else entries:
            if written < end and written >= start:
                into = written - start
                if into == 0:
                    return b""  # at a frame's start: nothing of it went out
                head = header[into:] if into < len(header) else b""
                return head + self.FILLER * (end - max(written, start + len(header)))
            start = end
        return b""

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


def bytes_written(sock: socket.socket) -> int | None:
    """Bytes the application has handed to a TCP socket so far: acknowledged by the peer plus still queued.

    ``TCP_INFO``'s ``tcpi_bytes_acked`` (Linux 4.1+) and ``SIOCOUTQ``; None where either is missing.
    """
    import array
    import fcntl
    import termios

    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < 128:
            return None
        queued = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
    except OSError:
        return None
    return struct.unpack_from("=Q", info, 120)[0] + queued[0]
