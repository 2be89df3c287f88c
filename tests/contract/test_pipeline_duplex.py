"""A pipeline of two streaming transformers (each stage PUTs its output to the next) must not deadlock on large shards.

Our pod, as a next stage, answers while it still reads its input. A half-duplex hop (httpx sends the
whole body before reading) deadlocks once both directions' buffers fill; ``duplex.py`` exists for this.
The shard here produces ~36 MB, far beyond loopback socket buffers.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator

import httpx
import pytest

from testbed.service import Service, start_transformer
from testbed.shardgen import make_tar, read_tar

from .conftest import transformer_env
from .harness import args_query


@pytest.fixture(scope="module")
def second_stage(target, disk, logs) -> Iterator[Service]:
    server = start_transformer("transformer-stage2", logs, transformer_env(target, disk, ETL_OBJ_TIMEOUT="60s"))
    yield server
    server.stop()


def _large_shard(samples: int) -> bytes:
    from testbed.shardgen import jpeg_bytes

    members = []
    for i in range(samples):
        members.append((f"sample-{i:06d}.jpg", jpeg_bytes(i % 4, size=(320, 240))))
        members.append((f"sample-{i:06d}.cls", str(i % 4).encode()))
    return make_tar(members)


def test_two_streaming_stages_do_not_deadlock_on_a_large_shard(service, second_stage):
    shard = _large_shard(60)  # 60 x 602,240-byte .npy members: ~36 MB through the hop and back
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        query = args_query('{"seed": 3}')
        response = http.put(f"{service.url}/bck/big.tar?{query}", content=shard,
                            headers={"Ais-Node-Url": second_stage.url})
    assert response.status_code == 200, response.text[:300]
    members = read_tar(response.content)
    assert [n for n, _ in members] == [f"sample-{i:06d}.{ext}" for i in range(60) for ext in ("npy", "cls")]
    assert all(len(data) == 602_240 for name, data in members if name.endswith(".npy"))


def test_a_failure_in_our_stage_is_not_passed_on_as_a_complete_answer(service, second_stage):
    good = _large_shard(40)
    with tarfile.open(fileobj=io.BytesIO(good)) as archive:
        last_jpeg = [m for m in archive.getmembers() if m.name.endswith(".jpg")][-1]
    cut = good[: last_jpeg.offset_data + last_jpeg.size // 2]  # inside the last image: fails after streaming began
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        url = f"{service.url}/bck/cut.tar?" + args_query('{"on_error": "fail"}')
        with pytest.raises(httpx.HTTPError), http.stream("PUT", url, content=cut,
                                                         headers={"Ais-Node-Url": second_stage.url}) as response:
            if response.status_code != 200:  # failing before the first byte is a clean error status
                raise httpx.HTTPError(f"status {response.status_code}")
            for _ in response.iter_raw():
                pass
