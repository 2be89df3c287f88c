"""Callers that send the whole body before reading the answer (requests, httpx, the SDK's pipeline stages).

Our answer starts streaming after the first sample, while such a caller still sends. Without care both
sides wait on each other once buffers fill; the pod spills output to disk while the body is still
arriving, so these callers get the complete, identical shard.
"""

from __future__ import annotations

import random
import socket
import time

import h11
import httpx

from testbed.shardgen import imagenet_like_members, jpeg_bytes, make_tar, read_tar

from .harness import args_query


def _shard(samples: int) -> bytes:
    """Large in and out: a 256 KB pass-through member per sample makes the body outgrow socket buffers."""
    rng = random.Random(0)
    members = []
    for i in range(samples):
        members.append((f"sample-{i:06d}.jpg", jpeg_bytes(i % 4, size=(320, 240))))
        members.append((f"sample-{i:06d}.bin", rng.randbytes(256 * 1024)))
        members.append((f"sample-{i:06d}.cls", str(i % 4).encode()))
    return make_tar(members)


def test_a_client_that_reads_only_after_sending_gets_the_whole_shard(service):
    shard = _shard(60)  # ~16 MB in, ~52 MB out: far more than the socket buffers between the two
    url = f"{service.url}/bck/half-duplex.tar?" + args_query('{"seed": 5}')
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        # httpx sends the whole request body before it reads any of the response.
        whole = http.put(url, content=shard)
        with http.stream("PUT", url, content=iter([shard])) as streamed:
            streamed_body = b"".join(streamed.iter_raw())
    assert whole.status_code == 200, whole.text[:300]
    assert len(read_tar(whole.content)) == 180
    assert whole.content == streamed_body


def _put_holding_the_end(service, shard: bytes, hold: int, pause: float) -> tuple[str, bytes]:
    """A ``Connection: close`` PUT whose last ``hold`` body bytes are sent only after ``pause`` seconds,
    the response read after that: what a previous pipeline stage does when its own last output comes
    late. Returns how the response ended ("EndOfMessage", or the error's name) and its body's bytes."""
    head, tail = shard[:-hold], shard[-hold:]
    with socket.create_connection(("127.0.0.1", service.port), timeout=60) as sock:
        sock.sendall(b"PUT /bck/held-end.tar HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n" + b"%x\r\n" % len(head) + head + b"\r\n")
        time.sleep(pause)  # the pod has transformed everything it needs by now; the tar's padding is not sent yet
        sock.sendall(b"%x\r\n" % len(tail) + tail + b"\r\n0\r\n\r\n")
        connection = h11.Connection(h11.CLIENT)
        connection.send(h11.Request(method="PUT", target="/", headers=[("Host", "x")]))
        body = b""
        try:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(sock.recv(1 << 16))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return "EndOfMessage", body
        except (OSError, h11.RemoteProtocolError) as exc:
            return type(exc).__name__, body


def test_the_response_ends_only_once_the_whole_body_arrived(service):
    """The pod stops reading at the tar's end-of-archive blocks; the padding after them may still be on the
    way when its answer is complete. Ending a ``Connection: close`` response then makes the kernel reset
    the connection and drop the answer's end still in the send buffer: the pod waits for the body's end
    (and drops what it did not need) before it ends the response."""
    shard = make_tar(imagenet_like_members(4))  # tarfile pads the archive to 10 KB records
    reference = httpx.put(f"{service.url}/bck/held-end.tar", content=shard, timeout=60)
    assert reference.status_code == 200 and len(reference.content) > 2_000_000  # more than the socket buffers
    ending, body = _put_holding_the_end(service, shard, hold=512, pause=2.0)
    assert (ending, len(body)) == ("EndOfMessage", len(reference.content))
    assert body == reference.content
