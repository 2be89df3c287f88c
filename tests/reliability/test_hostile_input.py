"""Hostile and broken input through the real service.

For each input the expected status or per-sample outcome is written in the test, the message
names the shard, the sample and the reason, and the service keeps serving (``still_serving``
checks ``/health`` after every test). Shard-level failures are answered before the first byte
(4xx + short text); sample-level failures follow ``on_error`` and are listed in
``__etl__/errors.json``.
"""

from __future__ import annotations

import io
import json
import tarfile

import httpx
import numpy as np
import pytest

from testbed import inputs
from testbed.fake_ais import AisDisk
from testbed.service import Service
from testbed.shardgen import make_tar, read_tar
from tests.contract.harness import fqn_query

from .conftest import MAX_MEMBER_BYTES, MAX_SHARD_BYTES, wait_until

MANIFEST = "__etl__/errors.json"


def put(client: httpx.Client, path: str, body: bytes, etl_args: dict | str | None = None, **kwargs) -> httpx.Response:
    params = {}
    if etl_args is not None:
        params["etl_args"] = etl_args if isinstance(etl_args, str) else json.dumps(etl_args)
    return client.put(path, content=body, params=params, **kwargs)


def manifest_of(output: bytes) -> dict | None:
    members = dict(read_tar(output))
    return json.loads(members[MANIFEST]) if MANIFEST in members else None


def npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


# ------------------------------------------------------------------------------------ broken shards


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda shard: inputs.cut_inside_header(shard, 2), "corrupt or truncated tar (truncated header at offset"),
        (lambda shard: inputs.cut_inside_member(shard, 2), "truncated inside member 's00001.jpg'"),
        (lambda shard: b"this is not a tar archive, just text\n" * 40, "not a tar archive"),
        (lambda shard: b"", "not a tar archive (empty file)"),
    ],
    ids=["cut-inside-a-header", "cut-inside-a-member", "not-a-tar", "empty-body"],
)
def test_unreadable_shard_is_a_422_naming_shard_and_reason(make, reason: str, client: httpx.Client,
                                                           still_serving: Service) -> None:
    shard = make(make_tar(inputs.good_members(3)))
    response = put(client, "/train/broken-7.tar", shard)
    assert response.status_code == 422, response.text
    assert response.text.startswith("shard 'train/broken-7.tar': ")
    assert reason in response.text


def test_shard_without_images_passes_through_byte_exact(client: httpx.Client, still_serving: Service) -> None:
    members = [("a.cls", b"1"), ("a.json", b'{"x": 1}'), ("b.txt", b"hello"), ("README", b"no key")]
    response = put(client, "/train/plain.tar", make_tar(members))
    assert response.status_code == 200, response.text
    assert read_tar(response.content) == members


def test_member_over_the_limit_fails_the_shard(client: httpx.Client, still_serving: Service) -> None:
    big = MAX_MEMBER_BYTES + 1
    shard = make_tar(inputs.good_members(1) + [("s00000.bin", b"\0" * big)])
    response = put(client, "/train/big-member.tar", shard)
    assert response.status_code == 422, response.text
    assert response.text == (f"shard 'train/big-member.tar': member 's00000.bin' is {big} bytes, over the limit "
                             f"of {MAX_MEMBER_BYTES} (ETL_MAX_MEMBER_BYTES)")


def test_body_over_the_shard_limit_is_refused_before_reading(client: httpx.Client, still_serving: Service) -> None:
    body = b"\0" * (MAX_SHARD_BYTES + 1)
    response = put(client, "/train/huge.tar", body)
    assert response.status_code == 413
    assert "shard 'train/huge.tar'" in response.text and "ETL_MAX_SHARD_BYTES" in response.text


def test_fqn_over_the_shard_limit_is_refused(client: httpx.Client, disk: AisDisk, still_serving: Service) -> None:
    fqn = disk.put("train", "huge-fqn.tar", b"\0" * (MAX_SHARD_BYTES + 1))
    response = client.put(f"/train/huge-fqn.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 413, response.text
    assert "ETL_MAX_SHARD_BYTES" in response.text


def test_chunked_body_over_the_shard_limit_never_completes(client: httpx.Client, still_serving: Service) -> None:
    # Without Content-Length the limit is met while streaming: after the status line was sent the only
    # honest answer is a broken transfer, never a cleanly terminated (truncated) tar.
    payload = b"\1" * (MAX_MEMBER_BYTES // 2)  # a multiple of 512: no padding
    count = MAX_SHARD_BYTES // len(payload) + 2

    def body():
        for i in range(count):  # one long run of members, never an end marker
            info = tarfile.TarInfo(f"m{i:04d}.bin")
            info.size = len(payload)
            yield info.tobuf(format=tarfile.USTAR_FORMAT) + payload

    try:
        response = client.put("/train/endless.tar", content=body())
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        return  # the transfer was cut (a close, or a reset while the body was still unread): correct
    assert response.status_code == 413, response.status_code
    assert "ETL_MAX_SHARD_BYTES" in response.text


def test_gzip_compressed_shard_is_read(client: httpx.Client, still_serving: Service) -> None:
    members = inputs.good_members(2)
    response = put(client, "/train/packed.tar.gz", inputs.gzip_tar(members))
    assert response.status_code == 200, response.text
    assert [n for n, _ in read_tar(response.content)] == ["s00000.npy", "s00000.cls", "s00001.npy", "s00001.cls"]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu-longname", "pax-path"])
def test_long_member_names_survive(fmt: int, client: httpx.Client, still_serving: Service) -> None:
    name = "d" * 90 + "/" + "k" * 200 + ".jpg"
    response = put(client, "/train/long.tar", inputs.long_name_tar(fmt, name, inputs.photo_jpeg()))
    assert response.status_code == 200, response.text
    ((out_name, data),) = read_tar(response.content)
    assert out_name == name[:-4] + ".npy"
    assert npy(data).shape == (3, 224, 224)


def test_hostile_names_are_carried_over(client: httpx.Client, still_serving: Service) -> None:
    jpeg = inputs.photo_jpeg()
    names = ["../../etc/x.jpg", "/abs/y.jpg", "a.b.c.jpg"]
    response = put(client, "/train/names.tar", make_tar([(n, jpeg) for n in names]))
    assert response.status_code == 200, response.text
    assert [n for n, _ in read_tar(response.content)] == ["../../etc/x.npy", "/abs/y.npy", "a.b.c.npy"]


def test_non_utf8_member_name_over_http(client: httpx.Client, still_serving: Service) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as archive:
        info = tarfile.TarInfo("\xe9t\xe9.jpg")
        jpeg = inputs.photo_jpeg()
        info.size = len(jpeg)
        archive.addfile(info, io.BytesIO(jpeg))
    response = put(client, "/train/latin1.tar", buffer.getvalue())
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content), encoding="utf-8", errors="surrogateescape") as archive:
        names = [m.name.encode("utf-8", "surrogateescape") for m in archive.getmembers()]
    assert names == [b"\xe9t\xe9.npy", b"__etl__/end.json"]


# ----------------------------------------------------------------------------------- broken samples


@pytest.mark.parametrize(
    ("member", "data", "reason"),
    [
        ("s00001.jpg", inputs.truncated_jpeg(), "not a decodable image: image file is truncated"),
        ("s00001.jpg", inputs.garbage_jpeg(), "not a decodable image: cannot identify image file"),
        ("s00001.jpg", b"", "empty image member (0 bytes)"),
        ("s00001.png", inputs.png_bomb(), "image is 30000x30000 = 900000000 pixels, over the limit of 100000000"),
        ("s00001.jpg", inputs.jpeg_bomb(), "image is 30000x30000 = 900000000 pixels, over the limit of 100000000"),
    ],
    ids=["truncated-jpeg", "garbage-jpeg", "zero-byte-image", "png-bomb", "jpeg-bomb"],
)
def test_bad_sample_is_skipped_and_listed(member: str, data: bytes, reason: str, client: httpx.Client,
                                          still_serving: Service) -> None:
    members = inputs.good_members(1) + [(member, data), ("s00001.cls", b"1")] + inputs.good_members(1, start=2)
    response = put(client, "/train/bad-sample.tar", make_tar(members))
    assert response.status_code == 200, response.text
    out = read_tar(response.content)
    assert [n for n, _ in out] == ["s00000.npy", "s00000.cls", "s00002.npy", "s00002.cls", MANIFEST]
    manifest = manifest_of(response.content)
    assert manifest["shard"] == "train/bad-sample.tar" and manifest["policy"] == "skip"
    (error,) = manifest["errors"]
    assert (error["key"], error["member"], error["action"]) == ("s00001", member, "skipped")
    assert reason in error["reason"]


def test_bad_first_sample_under_fail_is_a_422_naming_shard_sample_and_reason(client: httpx.Client,
                                                                            still_serving: Service) -> None:
    members = [("s00001.jpg", inputs.truncated_jpeg())] + inputs.good_members(1, start=2)
    response = put(client, "/train/strict.tar", make_tar(members), {"on_error": "fail"})
    assert response.status_code == 422
    assert response.text.startswith("shard 'train/strict.tar': sample 's00001' (member 's00001.jpg'): "
                                    "not a decodable image")


def test_bad_later_sample_under_fail_breaks_the_transfer_and_logs_the_reason(client: httpx.Client,
                                                                             still_serving: Service) -> None:
    # The status line went out with the first sample's bytes; a clean end would be a truncated tar,
    # so the connection is dropped instead and the reason goes to the pod log (ais etl view-logs).
    members = inputs.good_members(2) + [("s00009.jpg", inputs.garbage_jpeg())] + inputs.good_members(1, start=3)
    with pytest.raises(httpx.RemoteProtocolError):
        put(client, "/train/strict-late.tar", make_tar(members), {"on_error": "fail"})
    expected = "shard 'train/strict-late.tar': sample 's00009' (member 's00009.jpg'): not a decodable image"
    assert wait_until(lambda: expected in still_serving.log_tail(20000), timeout=5), still_serving.log_tail()


def test_bad_sample_under_passthrough_keeps_the_original_bytes(client: httpx.Client, still_serving: Service) -> None:
    bad = inputs.garbage_jpeg()
    members = [("s00001.jpg", bad), ("s00001.cls", b"1")]
    response = put(client, "/train/keep.tar", make_tar(members), {"on_error": "passthrough"})
    assert response.status_code == 200
    out = read_tar(response.content)
    assert out[:2] == members
    assert manifest_of(response.content)["errors"][0]["action"] == "passed-through"


def test_image_whose_resize_would_explode_is_refused_before_allocating(client: httpx.Client,
                                                                      still_serving: Service) -> None:
    # 1 x 100000 pixels passes the decode limit; imagenet-val's Resize(256) would make it 256 x 25.6M (19 GB).
    strip = inputs.png_bytes(np.full((1, 100_000, 3), 90, np.uint8))
    members = [("s00001.png", strip), ("s00001.cls", b"1")] + inputs.good_members(1, start=2)
    response = put(client, "/train/strip.tar", make_tar(members))
    assert response.status_code == 200, response.text
    (error,) = manifest_of(response.content)["errors"]
    assert error["key"] == "s00001"
    assert "Resize would turn 1x100000 into 256x25600000" in error["reason"]


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("rgba.png", inputs.rgba_png()),
        ("gray.jpg", inputs.photo_jpeg(0, "L")),
        ("cmyk.jpg", inputs.photo_jpeg(0, "CMYK")),
        ("deep.png", inputs.png16()),
    ],
    ids=["png-with-alpha", "grayscale-jpeg", "cmyk-jpeg", "16-bit-png"],
)
def test_unusual_image_modes_become_rgb_arrays(name: str, data: bytes, client: httpx.Client,
                                               still_serving: Service) -> None:
    response = put(client, "/train/modes.tar", make_tar([(name, data)]), {"dtype": "uint8"})
    assert response.status_code == 200, response.text
    ((out_name, out),) = read_tar(response.content)
    array = npy(out)
    assert out_name == name.rsplit(".", 1)[0] + ".npy"
    assert array.shape == (3, 224, 224) and array.dtype == np.uint8
    assert array.std() > 0 or name == "rgba.png"  # real content, not a blank canvas


def test_cmyk_jpeg_decodes_to_the_same_picture_as_rgb(client: httpx.Client, still_serving: Service) -> None:
    shard = make_tar([("rgb.jpg", inputs.photo_jpeg(0)), ("cmyk.jpg", inputs.photo_jpeg(0, "CMYK"))])
    response = put(client, "/train/cmyk.tar", shard, {"dtype": "uint8"})
    rgb, cmyk = (npy(data).astype(np.int16) for _, data in read_tar(response.content))
    assert np.abs(rgb - cmyk).mean() < 8  # inverted Adobe CMYK would be off by ~128


# ----------------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("etl_args", "field", "reason"),
    [
        ("{not json", "etl_args", "not valid JSON"),
        ("[1, 2]", "etl_args", "must be a JSON object"),
        ({"preset": "imagenet-tran"}, "preset", "unknown preset 'imagenet-tran'"),
        ({"transforms": ["ToTensor"]}, "transforms[0]", "transform 'ToTensor' is not allowed"),
        ({"transforms": [{"Lambda": {"lambd": "__import__('os').system('id')"}}]}, "transforms[0]", "not allowed"),
        ({"transforms": [{"Resize": {"size": "big"}}]}, "transforms[0] (Resize)", ""),
        ({"transforms": [{"Resize": {"size": 64, "evil": 1}}]}, "transforms[0] (Resize)", "evil"),
        ({"transforms": [{"Resize": [64]}]}, "transforms[0]", "must be a mapping"),
        ({"seed": "7"}, "seed", "must be an integer"),
        ({"epoch": -1}, "epoch", "non-negative"),
        ({"dtype": 5}, "dtype", "is not one of"),
        ({"layout": "NCHW"}, "layout", "is not one of"),
        ({"on_error": "ignore"}, "on_error", "is not one of"),
        ({"size": 224}, "size", "unknown field"),
    ],
)
def test_malformed_etl_args_is_a_400_naming_the_field(etl_args, field: str, reason: str, client: httpx.Client,
                                                     still_serving: Service) -> None:
    response = put(client, "/train/args.tar", make_tar(inputs.good_members(1)), etl_args)
    assert response.status_code == 400, response.text
    assert response.text.startswith(f"invalid etl_args field '{field}': ")
    assert reason in response.text


@pytest.mark.parametrize(
    "header",
    ["not a url", "http://", ",", "http://127.0.0.1:1,", "ftp://127.0.0.1:1/x",
     "http://127.0.0.1:1/ais%2F@%23%2Fb%2Fo,http://127.0.0.1:2"],
    ids=["no-scheme", "no-host", "empty-entries", "trailing-comma", "bad-scheme", "destination-not-last"],
)
def test_malformed_ais_node_url_is_a_400(header: str, client: httpx.Client, still_serving: Service) -> None:
    response = put(client, "/train/hop.tar", make_tar(inputs.good_members(1)), headers={"Ais-Node-Url": header})
    assert response.status_code == 400, response.text
    assert "Ais-Node-Url" in response.text
