"""ETL'd shard URLs: etl_args encoding, epoch URLs, SDK-built object URLs, hpull-style pod URLs."""

from __future__ import annotations

import json
import pickle
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from testbed.fake_proxy import FakeProxy
from transformer.client.urls import (
    EpochUrls,
    ais_fqn,
    encode_etl_args,
    etl_args,
    get_etl_args,
    path_escape,
    pod_urls,
    set_etl_args,
    shard_urls,
)


def test_etl_args_refuses_what_the_service_would() -> None:
    assert etl_args(preset="imagenet-val", dtype="uint8", seed=3, epoch=2) == {
        "preset": "imagenet-val", "dtype": "uint8", "seed": 3, "epoch": 2}
    with pytest.raises(ValueError, match="dtype"):
        etl_args(dtype="int8")
    with pytest.raises(ValueError, match="either preset or transforms"):
        etl_args(preset="imagenet-val", transforms=["RandomHorizontalFlip"])
    with pytest.raises(ValueError, match="epoch"):
        etl_args(epoch=-1)
    assert etl_args(skip=4) == {"skip": 4}
    with pytest.raises(ValueError, match="skip"):
        etl_args(skip=-1)
    assert etl_args(crop_decode=False) == {"crop_decode": False}
    with pytest.raises(ValueError, match="crop_decode"):
        etl_args(crop_decode="false")
    assert etl_args(dct_scaling=True) == {"dct_scaling": True}
    with pytest.raises(ValueError, match="dct_scaling"):
        etl_args(dct_scaling=1)
    with pytest.raises(ValueError, match="unknown field 'size'"):
        encode_etl_args({"size": 224})


def test_encoded_etl_args_are_compact_sorted_json() -> None:
    assert encode_etl_args({"seed": 1, "dtype": "uint8"}) == '{"dtype":"uint8","seed":1}'
    assert encode_etl_args({}) is None
    assert encode_etl_args('{"seed":1}') == '{"seed":1}'


def test_set_etl_args_replaces_only_that_parameter() -> None:
    url = "http://proxy:8080/v1/objects/b/train-{000..001}.tar?provider=ais&etl_name=wds-etl&etl_args=%7B%7D"
    changed = set_etl_args(url, {"epoch": 3, "seed": 7})
    query = parse_qs(urlsplit(changed).query)
    assert query["provider"] == ["ais"] and query["etl_name"] == ["wds-etl"]
    assert json.loads(query["etl_args"][0]) == {"epoch": 3, "seed": 7}
    assert get_etl_args(changed) == {"epoch": 3, "seed": 7}
    assert "etl_args" not in set_etl_args(changed, None)
    # Braces inside etl_args are percent-encoded, so webdataset's brace expansion never touches them.
    assert "{" not in urlsplit(changed).query


def test_with_skip_goes_only_to_etl_urls_and_adds_up() -> None:
    from transformer.client.urls import is_etl_url, with_skip

    through_ais = "http://proxy:8080/v1/objects/b/a.tar?provider=ais&etl_name=wds-etl"
    at_pod = "http://pod:8000/ais%2F%40%23%2Fb%2Fa.tar?etl_fqn=%2Fmnt%2Fa.tar"
    assert is_etl_url(through_ais) and is_etl_url(at_pod)
    assert is_etl_url("http://pod:8000/ais%2F%40%23%2Fb%2Fa.tar?etl_args=%7B%7D")
    assert not is_etl_url("http://proxy:8080/v1/objects/b/a.tar?provider=ais")  # the raw object
    assert not is_etl_url("/data/shard-000.tar") and not is_etl_url("pipe:cat a.tar")
    skipped = with_skip(set_etl_args(through_ais, {"seed": 1}), 5)
    assert get_etl_args(skipped) == {"seed": 1, "skip": 5}
    assert get_etl_args(with_skip(skipped, 2)) == {"seed": 1, "skip": 7}
    assert parse_qs(urlsplit(skipped).query)["etl_name"] == ["wds-etl"]


def test_epoch_urls_carry_epoch_and_one_seed() -> None:
    urls = EpochUrls(("http://p/v1/objects/b/a.tar?provider=ais&etl_name=wds-etl",), {"dtype": "uint8"})
    first, second = get_etl_args(urls(0)[0]), get_etl_args(urls(1)[0])
    assert first["epoch"] == 0 and second["epoch"] == 1
    assert first["seed"] == second["seed"] == urls.seed and first["dtype"] == "uint8"
    assert EpochUrls(urls.urls, seed=5)(2) == EpochUrls(urls.urls, seed=5)(2)
    assert pickle.loads(pickle.dumps(urls))(1) == urls(1)  # DataLoader workers may unpickle it
    with pytest.raises(ValueError, match="unknown field"):
        EpochUrls(urls.urls, {"size": 1})


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("ais/@#/bck/dir/a.jpg", "ais%2F@%23%2Fbck%2Fdir%2Fa.jpg"),  # Go's url.PathEscape of the uname
        ("ais/@#/src/dir/obj x.txt", "ais%2F@%23%2Fsrc%2Fdir%2Fobj%20x.txt"),
        ("a,b;c?d", "a%2Cb%3Bc%3Fd"),
        ("$&+:=@~._-", "$&+:=@~._-"),
        ("100%", "100%25"),
    ],
)
def test_path_escape_is_go_path_escape(text: str, escaped: str) -> None:
    assert path_escape(text) == escaped


def test_pod_urls_are_what_an_hpull_redirect_sends() -> None:
    (url,) = pod_urls("http://127.0.0.1:9000/", "bck", ["dir/train 0.tar"], etl_args={"seed": 1},
                      mountpath="/data/mp1")
    parts = urlsplit(url)
    assert parts.path == "/ais%2F@%23%2Fbck%2Fdir%2Ftrain%200.tar"
    query = parse_qs(parts.query)
    # etl_fqn is PathEscape(FQN) inside an encoded query: one more unquote gives the path (section 2.1).
    assert query["etl_fqn"][0] == "%2Fdata%2Fmp1%2F@ais%2Fbck%2F%25ob%2Fdir%2Ftrain%200.tar"
    assert unquote(query["etl_fqn"][0]) == ais_fqn("/data/mp1", "bck", "dir/train 0.tar")
    assert json.loads(query["etl_args"][0]) == {"seed": 1}
    (bare,) = pod_urls("http://127.0.0.1:9000", "bck", ["a.tar"])
    assert bare == "http://127.0.0.1:9000/ais%2F@%23%2Fbck%2Fa.tar"


def test_a_relative_mountpath_is_sent_as_an_absolute_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (url,) = pod_urls("http://127.0.0.1:9000", "bck", ["a.tar"], mountpath="work/mp")
    fqn = unquote(parse_qs(urlsplit(url).query)["etl_fqn"][0])
    assert fqn == ais_fqn(str(tmp_path / "work" / "mp"), "bck", "a.tar") and fqn.startswith("/")


@pytest.fixture
def bucket_with_shards(proxy: FakeProxy) -> str:
    for i in range(5):
        proxy.put_object("shards", f"train/train-{i:03d}.tar", b"tar")
    proxy.put_object("shards", "train/readme.txt", b"not a shard")
    proxy.put_object("shards", "val/val-000.tar", b"tar")
    return "shards"


def test_shard_urls_by_prefix_list_every_page(ais, proxy: FakeProxy, bucket_with_shards: str) -> None:
    urls = shard_urls(ais, bucket_with_shards, "wds-etl", prefix="train/", etl_args={"dtype": "uint8", "epoch": 0})
    assert [urlsplit(u).path for u in urls] == [f"/v1/objects/shards/train/train-{i:03d}.tar" for i in range(5)]
    for url in urls:
        query = parse_qs(urlsplit(url).query)
        assert query["provider"] == ["ais"] and query["etl_name"] == ["wds-etl"]
        assert json.loads(query["etl_args"][0]) == {"dtype": "uint8", "epoch": 0}  # JSON, not a Python repr
    listings = proxy.calls("GET", "/v1/buckets/shards")
    assert len(listings) == 2  # 6 names under train/, pages of 3: the SDK followed the continuation token
    assert {r.body["action"] for r in listings} == {"list"}
    assert listings[0].body["value"]["prefix"] == "train/"


def test_shard_urls_by_template_and_names_do_not_list(ais, proxy: FakeProxy) -> None:
    urls = shard_urls(ais, "shards", "wds-etl", template="train-{000..002}.tar")
    assert [urlsplit(u).path.rsplit("/", 1)[1] for u in urls] == ["train-000.tar", "train-001.tar", "train-002.tar"]
    assert all("etl_args" not in u for u in urls)
    named = shard_urls(ais, "shards", None, names=["a.tar"], etl_args={"seed": 1})
    assert "etl_name" not in named[0]  # no ETL: the raw shard
    assert proxy.requests == []
    with pytest.raises(ValueError, match="exactly one"):
        shard_urls(ais, "shards", "wds-etl", prefix="", names=["a.tar"])


def test_sdk_get_url_with_dict_args_is_not_json(ais) -> None:
    """Why the client always passes etl_args as a JSON string (the SDK's ETLConfig encodes a dict as JSON)."""
    from aistore.sdk.etl import ETLConfig

    raw = ais.bucket("b").object("a.tar").get_url(etl=ETLConfig("wds-etl", args={"seed": 1}))
    value = parse_qs(urlsplit(raw).query)["etl_args"][0]
    assert value == "{'seed': 1}"
    with pytest.raises(json.JSONDecodeError):
        json.loads(value)
