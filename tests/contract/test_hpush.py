"""hpush: ``PUT /<bucket>/<obj>`` with the shard as body or as ``etl_fqn`` (ext/etl/communicator.go)."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from testbed.fake_ais import AisDisk, FakeTarget
from testbed.ports import free_port
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, jpeg_bytes, make_tar, read_tar

from .conftest import transformer_env
from .harness import args_query, fqn_query, uname
from .outputs import (
    ERROR_MANIFEST,
    assert_transformed,
    error_manifest,
    image_shard,
    npy,
    output_name,
    plain_members,
    segmentation_members,
    truncated,
)


def test_hpush_body_shard_becomes_npy_members(client: httpx.Client) -> None:
    inputs = imagenet_like_members(4)
    response = client.put("/train/shard-000.tar", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    members = assert_transformed(inputs, response.content)
    array = npy(dict(members)["sample-000000.npy"])
    # ImageNet-normalized: values centred near zero, inside the range the mean/std map [0, 1] to.
    assert -2.2 < array.min() < 0 < array.max() < 2.7
    assert abs(float(array.mean())) < 1.0
    assert ERROR_MANIFEST not in dict(members)  # no failures, no manifest


def test_hpush_fqn_is_double_decoded(client: httpx.Client, disk: AisDisk) -> None:
    # Every AIS FQN contains '%ob'; a name with a space and '%' proves exactly one extra unquote.
    inputs = imagenet_like_members(3)
    fqn = disk.put("train", "dir/shard 100%.tar", make_tar(inputs))
    assert "%ob" in fqn
    response = client.put(f"/train/dir/shard 100%.tar?{fqn_query(fqn)}", headers={"Content-Length": "0"})
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)


def test_hpush_fqn_and_body_give_the_same_output(client: httpx.Client, disk: AisDisk) -> None:
    shard = image_shard(3)
    fqn = disk.put("train", "same.tar", shard)
    by_fqn = client.put(f"/train/same.tar?{fqn_query(fqn)}", content=b"")
    by_body = client.put("/train/same.tar", content=shard)
    assert by_fqn.status_code == by_body.status_code == 200
    assert by_fqn.content == by_body.content  # imagenet-val is deterministic


def test_hpush_fqn_ignores_the_empty_body(client: httpx.Client, disk: AisDisk) -> None:
    # FQN mode always comes with Content-Length: 0; the FQN, not the body, is the input.
    inputs = plain_members(2, "fqn")
    fqn = disk.put("docs", "only-fqn.tar", make_tar(inputs))
    response = client.put(f"/docs/only-fqn.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 200, response.text
    assert read_tar(response.content) == inputs


def test_hpush_passes_non_image_members_byte_exact_in_order(client: httpx.Client) -> None:
    inputs = imagenet_like_members(2) + plain_members(3) + [("README", b"no extension at all")]
    response = client.put("/mixed/shard.tar", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)


def test_hpush_masks_get_the_same_geometry_as_their_image(client: httpx.Client) -> None:
    inputs = segmentation_members()
    response = client.put("/pets/shard.tar", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    members = dict(assert_transformed(inputs, response.content))
    trimap = npy(members["pet-0001.trimap.npy"])
    assert set(np.unique(trimap)) <= {1, 2, 3}  # nearest-neighbour: no interpolated class values
    assert members["pet-0001.cls"] == b"1"


@pytest.mark.parametrize(
    ("etl_args", "dtype", "shape"),
    [
        ({"dtype": "uint8"}, "uint8", (3, 224, 224)),
        ({"dtype": "float16"}, "float16", (3, 224, 224)),
        ({"layout": "HWC"}, "float32", (224, 224, 3)),
        ({"dtype": "uint8", "layout": "HWC", "preset": "resize-224"}, "uint8", (224, 224, 3)),
    ],
)
def test_hpush_etl_args_are_passed_through(client: httpx.Client, etl_args: dict, dtype: str, shape: tuple) -> None:
    inputs = imagenet_like_members(2)
    response = client.put(f"/train/args.tar?{args_query(json.dumps(etl_args))}", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    members = assert_transformed(inputs, response.content, dtype=dtype, shape=shape)
    if dtype == "uint8":  # uint8 is not normalized: raw pixel values
        assert npy(members[0][1]).max() > 100


def test_hpush_etl_args_with_fqn_are_passed_through(client: httpx.Client, disk: AisDisk) -> None:
    inputs = imagenet_like_members(2)
    fqn = disk.put("train", "args-fqn.tar", make_tar(inputs))
    response = client.put(f"/train/args-fqn.tar?{fqn_query(fqn, json.dumps({'dtype': 'uint8'}))}", content=b"")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content, dtype="uint8")


@pytest.mark.parametrize(
    ("etl_args", "field"),
    [
        ('{"dtype": "int7"}', "dtype"),
        ('{"layout": "NCHW"}', "layout"),
        ('{"on_error": "ignore"}', "on_error"),
        ('{"bogus": 1}', "bogus"),
        ('{"preset": "no-such-preset"}', "preset"),
        ("not json", "etl_args"),
    ],
)
def test_hpush_invalid_etl_args_is_400_naming_the_field(client: httpx.Client, etl_args: str, field: str) -> None:
    response = client.put(f"/train/bad-args.tar?{args_query(etl_args)}", content=image_shard(1))
    assert response.status_code == 400
    assert field in response.text


def test_hpush_same_seed_same_output_for_random_preset(client: httpx.Client) -> None:
    shard = image_shard(2)
    query = args_query(json.dumps({"preset": "imagenet-train", "seed": 7}))
    first = client.put(f"/train/seeded.tar?{query}", content=shard)
    second = client.put(f"/train/seeded.tar?{query}", content=shard)
    other_epoch = client.put(
        f"/train/seeded.tar?{args_query(json.dumps({'preset': 'imagenet-train', 'seed': 7, 'epoch': 1}))}",
        content=shard,
    )
    assert first.status_code == second.status_code == other_epoch.status_code == 200
    assert first.content == second.content
    assert first.content != other_epoch.content


def _shard_with_corrupt_sample(position: int, samples: int = 4) -> tuple[list[tuple[str, bytes]], str]:
    members = imagenet_like_members(samples, extra=False)
    key = f"sample-{position:06d}"
    members = [(n, jpeg_bytes(position)[:300] if n == f"{key}.jpg" else d) for n, d in members]
    return members, key


def test_hpush_on_error_skip_drops_the_sample_and_lists_it(client: httpx.Client) -> None:
    inputs, bad = _shard_with_corrupt_sample(1)
    query = args_query('{"on_error": "skip"}')
    response = client.put(f"/train/skip.tar?{query}", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    names = [n for n, _ in read_tar(response.content)]
    assert not any(n.startswith(bad) for n in names)
    assert names[-1] == ERROR_MANIFEST  # the manifest is the last member
    manifest = error_manifest(response.content)
    assert [e["key"] for e in manifest["errors"]] == [bad]
    kept = [(n, d) for n, d in inputs if not n.startswith(bad)]
    assert [n for n in names[:-1]] == [output_name(n) for n, _ in kept]


def test_hpush_on_error_passthrough_keeps_the_original_members(client: httpx.Client) -> None:
    inputs, bad = _shard_with_corrupt_sample(2)
    query = args_query('{"on_error": "passthrough"}')
    response = client.put(f"/train/pass.tar?{query}", content=make_tar(inputs))
    assert response.status_code == 200, response.text
    members = dict(read_tar(response.content))
    assert members[f"{bad}.jpg"] == dict(inputs)[f"{bad}.jpg"]  # kept byte-exact, not converted
    assert [e["key"] for e in error_manifest(response.content)["errors"]] == [bad]


def test_hpush_on_error_fail_is_422_naming_shard_and_sample(client: httpx.Client) -> None:
    inputs, bad = _shard_with_corrupt_sample(0)  # first sample: nothing streamed yet, a status is possible
    query = args_query('{"on_error": "fail"}')
    response = client.put(f"/train/fail-me.tar?{query}", content=make_tar(inputs))
    assert response.status_code == 422
    assert bad in response.text and "fail-me.tar" in response.text


def test_hpush_unreadable_shard_is_422(client: httpx.Client) -> None:
    response = client.put("/train/not-a-tar.tar", content=b"this is not a tar archive" * 100)
    assert response.status_code == 422
    assert "not-a-tar.tar" in response.text


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_hpush_error_after_streaming_started_aborts_the_connection(client: httpx.Client, on_error: str) -> None:
    # 25 samples = 50 members; the 50th is cut mid-payload. Earlier samples already streamed, so the
    # status is long sent: the only honest signal left is an aborted chunked body, never a clean tar.
    shard = truncated(make_tar(imagenet_like_members(25, extra=False)), 49)
    query = args_query(json.dumps({"on_error": on_error}))
    received = bytearray()
    with pytest.raises(httpx.TransportError), client.stream("PUT", f"/train/cut.tar?{query}", content=shard) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            received += chunk
    assert len(received) > 600_000  # at least the first .npy went out before the abort


def test_hpush_error_mid_stream_under_fail_aborts_the_connection_logged_as_one_line(service: Service,
                                                                                    client: httpx.Client) -> None:
    """A sample failing under on_error=fail after the body began cuts the response (the connection is
    aborted), and that documented outcome is one log line naming the shard, the sample and the reason; no
    traceback, no "Exception in ASGI application"."""
    inputs, key = _shard_with_corrupt_sample(20, samples=24)
    start = len(service.log_path.read_bytes())
    query = args_query('{"on_error": "fail"}')
    with pytest.raises(httpx.TransportError), client.stream("PUT", f"/train/logged.tar?{query}",
                                                              content=make_tar(inputs)) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            pass
    new = service.log_path.read_bytes()[start:].decode(errors="replace")  # written before the cut
    lines = [line for line in new.splitlines() if line.strip()]
    assert len(lines) == 1, new
    assert "shard 'train/logged.tar'" in lines[0] and f"sample '{key}'" in lines[0], lines[0]
    assert "not a decodable image" in lines[0], lines[0]


# A real bug after the body began: the transformed shard's third chunk raises an exception nothing
# anticipates. Its traceback stays in the log, and so does the server's record of the cut response.
_BUGGY_SERVER = """
import sys

import transformer.server.jobs as jobs
from transformer.cli import main

transform_shard = jobs.transform_shard


def buggy(*args, **kwargs):
    for count, chunk in enumerate(transform_shard(*args, **kwargs)):
        if count == 2:
            raise KeyError("a planted bug")
        yield chunk


jobs.transform_shard = buggy
sys.exit(main(["serve", "--host", "127.0.0.1", "--port", sys.argv[1]]))
"""


def test_a_bug_mid_stream_keeps_its_traceback(target: FakeTarget, disk: AisDisk, logs: Path) -> None:
    port = free_port()
    # The bug is planted in this process's jobs.transform_shard, so the shard runs on its threads.
    server = Service("transformer-buggy", [sys.executable, "-c", _BUGGY_SERVER, str(port)],
                     transformer_env(target, disk, ETL_PROCESSES="0"), logs, port).wait_healthy(90)
    try:
        with pytest.raises(httpx.TransportError), httpx.stream(
                "PUT", f"{server.url}/train/buggy.tar", content=make_tar(imagenet_like_members(24, extra=False)),
                timeout=60) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                pass
        log = server.log_path.read_text(errors="replace")
        assert "shard train/buggy.tar: unexpected error" in log and "KeyError: 'a planted bug'" in log, log
        assert "Exception in ASGI application" in log and "StreamAborted" in log, log
    finally:
        server.stop()


def _stray_file(disk: AisDisk) -> str:
    stray = disk.root / "not-ais-layout.tar"
    stray.write_bytes(image_shard(1))
    return str(stray)


@pytest.mark.parametrize("fqn", [
    pytest.param(lambda disk: "/etc/passwd", id="outside-the-allowed-roots"),
    pytest.param(lambda disk: disk.fqn("train", "../../../../../../etc/passwd"), id="escaping-the-root-with-dotdot"),
    pytest.param(_stray_file, id="outside-the-ais-layout"),
])
def test_hpush_fqn_that_is_no_ais_object_is_403(client: httpx.Client, disk: AisDisk,
                                                fqn: Callable[[AisDisk], str]) -> None:
    response = client.put(f"/train/x.tar?{fqn_query(fqn(disk))}", content=b"")
    assert response.status_code == 403


def test_hpush_missing_fqn_is_404_naming_it(client: httpx.Client, disk: AisDisk) -> None:
    fqn = disk.fqn("train", "never-written.tar")
    response = client.put(f"/train/never-written.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 404
    assert "never-written.tar" in response.text


def test_hpush_empty_output_is_200_not_204(client: httpx.Client) -> None:
    # An inline 204 is an error for AIS (ais/tgtetl.go): only a direct put may answer 204.
    response = client.put("/train/empty.tar", content=make_tar([]))
    assert response.status_code == 200
    assert read_tar(response.content) == []


def test_hpush_fqn_of_a_chunked_object_reads_the_whole_object(client: httpx.Client, disk: AisDisk,
                                                              target: FakeTarget) -> None:
    # For a chunked AIS object only chunk #1 lives at the FQN (core/ufest.go): the file is
    # shorter than the object. The service must notice (the target knows the size) and not
    # transform a truncated shard.
    inputs = imagenet_like_members(4)
    shard = make_tar(inputs)
    fqn = disk.put("train", "chunked.tar", shard[: len(shard) // 2])
    target.objects[uname("train", "chunked.tar")] = shard
    response = client.put(f"/train/chunked.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)


def test_hpush_reply_nobody_reads_ends_at_the_object_timeout(impatient: Service, disk: AisDisk) -> None:
    # A caller that keeps the connection open but stops reading: at the object timeout (2 s here) the
    # shard's thread gives up and its window is released; the response can only end broken.
    jpeg = imagenet_like_members(1)[0][1]
    fqn = disk.put("train", "unread.tar",
                   make_tar([m for i in range(120) for m in ((f"u-{i:04d}.jpg", jpeg), (f"u-{i:04d}.cls", b"1"))]))
    request = (f"PUT /train/unread.tar?{fqn_query(fqn)} HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", impatient.port), timeout=10) as sock:
        sock.sendall(request)
        time.sleep(3.5)  # not reading, past the object timeout
        metrics = httpx.get(impatient.url + "/metrics", timeout=5).text
        assert re.search(r"^etl_inflight_shards 0(\.0)?$", metrics, re.M), "still in flight while nobody reads"
        received = b""
        while chunk := sock.recv(1 << 20):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert not received.endswith(b"\r\n0\r\n\r\n"), "a shard nobody read ended as a complete response"


def test_hpush_question_mark_in_the_name_is_400_not_a_transform_without_etl_args(client: httpx.Client,
                                                                                 disk: AisDisk) -> None:
    # AIS joins the raw name into the URL: "q?x=1.tar" makes "x" a parameter holding the rest, etl_args included.
    fqn = disk.put("src", "q?x=1.tar", make_tar(imagenet_like_members(1)))
    args = json.dumps({"dtype": "uint8"})
    response = client.put(f"/src/q?x=1.tar?{fqn_query(fqn, args)}", content=b"")
    assert response.status_code == 400, response.text
    assert "shard 'src/q'" in response.text and "'?'" in response.text and "hpull or ws" in response.text
