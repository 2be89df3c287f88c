"""Callers that send the whole body before reading the answer (requests, httpx, the SDK's pipeline stages).

Our answer starts streaming after the first sample, while such a caller still sends. Without care both
sides wait on each other once buffers fill; the pod spills output to disk while the body is still
arriving, so these callers get the complete, identical shard.
"""

from __future__ import annotations

import random

import httpx

from tests.shardgen import jpeg_bytes, make_tar, read_tar

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
