"""A shard job's output as the ASGI HTTP response: ``respond_http``, and the abort of a failed body.

The status line waits for the output's first item: a chunk opens a 200 tar body, a ``Failure`` or a
``Final`` is answered whole (an error text, a 204 after a direct put, a next hop's status). After
the first chunk the connection's transport may be offered to the driver thread (direct send). ``End``
ends the body; a ``Failure`` after the status line raises ``StreamAborted`` out of the ASGI call, so
uvicorn drops the connection without the final chunk (the caller sees a broken transfer, never a
cleanly terminated, truncated tar).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..errors import InternalError, StreamAborted, TransformerError
from ..redact import redact_bytes
from .direct import STALL_SECONDS, drained
from .output import Chunk, End, Failure, Final, Output

TAR_CONTENT_TYPE = "application/x-tar"


async def respond_http(output: Output, send: Callable, transport: asyncio.Transport | None,
                       input_received: Callable[[], Awaitable[object]] | None = None) -> None:
    """Send the job's output as the ASGI response; raises ``StreamAborted`` on a failure after the status line.

    ``transport``: the connection's, when direct send may take over after the first chunk.
    ``input_received``: awaited before the response ends (``BodySource.received``).
    """
    item = await output.next()
    match item:
        case Failure(error=error):
            status, body = error_answer(error)
            if input_received is not None:
                await input_received()
            await _send_whole(send, status, body, {})
            return
        case Final(status=status, body=body, headers=headers):
            if input_received is not None:
                await input_received()
            await _send_whole(send, status, body, headers or {})
            return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", TAR_CONTENT_TYPE.encode())]})
    first = True
    while True:
        match item:
            case Chunk(data=data):
                await send({"type": "http.response.body", "body": bytes(data), "more_body": True})
            case End():
                if input_received is not None:
                    await input_received()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            case Failure(error=error):
                foreseen = isinstance(error, TransformerError) and not isinstance(error, InternalError)
                raise StreamAborted(f"aborting the response of shard '{output.shard}' after "
                                    f"{output.bytes_written} bytes: {error}", foreseen) from error
            case Final():
                raise StreamAborted(f"shard '{output.shard}': a complete answer after the body began")
        if first:
            first = False
            # uvicorn wrote the status line and the first chunk: the driver may take the socket.
            ready = transport is not None and await drained(transport, STALL_SECONDS)
            output.go_direct(transport if ready else None)
        item = await output.next()


def error_answer(error: BaseException) -> tuple[int, bytes]:
    if isinstance(error, TransformerError):
        return error.status, error.message.encode()
    return 500, f"internal error: {error!r}".encode()


async def _send_whole(send: Callable, status: int, body: bytes, headers: dict[str, str]) -> None:
    if status >= 400:  # our error, or a next hop's or a destination's relayed: AIS shows it to its users
        body = redact_bytes(body)
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if status != 204:
        raw_headers.append((b"content-type", b"text/plain; charset=utf-8"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": b"" if status == 204 else body})
