"""The pod reads what aisnode wrote: ``etl_fqn`` requests over objects a real target stored on its mountpath.

Requests are built as AIS 5.0's target builds them (``ext/etl/communicator.go``): hpush ``PUT
/<bucket>/<object>?etl_fqn=<PathEscape(fqn)>`` with an empty body, hpull ``GET /<PathEscape(uname)>?
etl_fqn=..``. The FQN is where the target keeps the object (``<mountpath>/@ais/[#<ns>/]<bucket>/%ob/
<object>``, checked to exist), and the pod's ``AIS_TARGET_URL`` reaches that target's metadata and data
through ``EtlObjectRelay`` (aisnode refuses its own ETL object route outside Kubernetes).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from testbed.cluster import LocalCluster
from testbed.service import Service, base_env, start_transformer
from testbed.shardgen import jpeg_bytes, make_tar, read_output
from tests.contract.harness import fqn_query
from transformer.wire import path_escape

from .etl_objects import EtlObjectRelay

pytestmark = pytest.mark.ais
ETL_NAME, SECRET = "wds-etl", "Sec4et9XyZ"
ARGS = '{"transforms":[{"Resize":{"size":[24,24]}}],"dtype":"uint8"}'  # small, deterministic output
NAMES = ["plain.tar", "dir/sub dir/a shard #1 100% é.tar", "ünï/日本語/ñ %41 #.tar", "a/b/c/d/e/deep.tar"]


def shard(samples: int, first: int = 0, size: tuple[int, int] = (64, 48)) -> bytes:
    members = []
    for i in range(first, first + samples):
        members += [(f"s{i:04d}.jpg", jpeg_bytes(i, size)), (f"s{i:04d}.cls", str(i).encode())]
    return make_tar(members)


@pytest.fixture(scope="module")
def relay(ais_cluster: LocalCluster) -> Iterator[EtlObjectRelay]:
    relay = EtlObjectRelay(ais_cluster.target.url, ETL_NAME, SECRET)
    yield relay
    relay.close()


@pytest.fixture(scope="module")
def pod(ais_cluster: LocalCluster, relay: EtlObjectRelay,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = base_env(ETL_FQN_ROOTS=str(ais_cluster.mountpath), AIS_TARGET_URL=relay.ais_target_url, ETL_WORKERS="2",
                   ETL_OBJ_TIMEOUT="60s", ETL_LOG_LEVEL="warning")
    service = start_transformer("aisnode-pod", tmp_path_factory.mktemp("pod-logs"), env)
    yield service
    service.stop()


@pytest.fixture
def http(pod: Service, relay: EtlObjectRelay) -> Iterator[httpx.Client]:
    relay.clear()
    relay.head_status = None
    with httpx.Client(base_url=pod.url, timeout=60) as client:
        yield client


def hpush(http: httpx.Client, bucket: str, name: str, fqn: Path) -> httpx.Response:
    """What the target sends (Go's url.Parse of ``<pod>/<bucket>/<object>?<query>``, then the request line)."""
    return http.put(f"/{quote(bucket)}/{quote(name)}?{fqn_query(str(fqn), ARGS)}", content=b"")


def hpull(http: httpx.Client, uname: str, fqn: Path) -> httpx.Response:
    return http.get(f"/{path_escape(uname)}?{fqn_query(str(fqn), ARGS)}")


def by_body(http: httpx.Client, data: bytes) -> bytes:
    response = http.put(f"/ref/shard.tar?{httpx.QueryParams({'etl_args': ARGS})}", content=data)
    assert response.status_code == 200, response.text
    return response.content


def test_names_with_spaces_hash_percent_and_non_ascii(ais_client, ais_cluster: LocalCluster, http: httpx.Client,
                                                      relay: EtlObjectRelay) -> None:
    bucket = ais_client.bucket("pod-names").create(exist_ok=True)
    for i, name in enumerate(NAMES):
        data = shard(3, first=10 * i)
        bucket.object(name).get_writer().put_content(data)
        fqn = ais_cluster.fqn("pod-names", name)
        assert fqn.read_bytes() == data, f"aisnode keeps {name!r} elsewhere"  # the layout the pod expects
        expected = by_body(http, data)
        relay.clear()
        pushed = hpush(http, "pod-names", name, fqn)
        assert pushed.status_code == 200, (name, pushed.text)
        assert pushed.content == expected
        assert [m for m, _ in read_output(pushed.content)][:2] == [f"s{10 * i:04d}.npy", f"s{10 * i:04d}.cls"]
        pulled = hpull(http, f"ais/@#/pod-names/{name}", fqn)
        assert pulled.status_code == 200, (name, pulled.text)
        assert pulled.content == expected
        # The pod asked the target for the size once per request, by the object's exact uname; the target knew it.
        assert [(s.method, s.uname, s.status) for s in relay.recorded()] == [
            ("HEAD", f"ais/@#/pod-names/{name}", 200)] * 2


def test_a_bucket_in_a_namespace(ais_client, ais_cluster: LocalCluster, http: httpx.Client,
                                 relay: EtlObjectRelay) -> None:
    from aistore.sdk.namespace import Namespace

    bucket = ais_client.bucket("pod-ns", namespace=Namespace(name="team")).create(exist_ok=True)
    data = shard(4)
    bucket.object("dir/shard #1.tar").get_writer().put_content(data)
    fqn = ais_cluster.mountpath / "@ais" / "#team" / "pod-ns" / "%ob" / "dir" / "shard #1.tar"
    assert fqn.read_bytes() == data
    expected = by_body(http, data)
    relay.clear()
    pushed = hpush(http, "pod-ns", "dir/shard #1.tar", fqn)  # the hpush path carries no namespace
    assert pushed.status_code == 200, pushed.text
    assert pushed.content == expected
    pulled = hpull(http, "ais/@#team/pod-ns/dir/shard #1.tar", fqn)
    assert pulled.status_code == 200, pulled.text
    assert pulled.content == expected
    # The namespace came from the FQN (hpush) and from the request (hpull): the target found the object both times.
    assert [(s.method, s.uname, s.status) for s in relay.recorded()] == [
        ("HEAD", "ais/@#team/pod-ns/dir/shard #1.tar", 200)] * 2


def test_files_as_aisnode_leaves_them(ais_client, ais_cluster: LocalCluster, http: httpx.Client) -> None:
    """aisnode writes objects 0640 and their folders 0750, owned by its own user and group: a pod must run as
    that user or in that group (root and gid 0 for AIS's images) to read them, and only reads them."""
    bucket = ais_client.bucket("pod-perms").create(exist_ok=True)
    data = shard(2)
    bucket.object("d/perm.tar").get_writer().put_content(data)
    fqn = ais_cluster.fqn("pod-perms", "d/perm.tar")
    info = fqn.stat()
    assert stat.S_IMODE(info.st_mode) == 0o640
    assert (info.st_uid, info.st_gid) == (os.getuid(), os.getgid())  # aisnode's (the test's) user and group
    assert {stat.S_IMODE(p.stat().st_mode) for p in (fqn.parent, fqn.parent.parent, fqn.parents[2])} == {0o750}
    before = (info.st_mtime_ns, info.st_size, stat.S_IMODE(info.st_mode))
    response = hpush(http, "pod-perms", "d/perm.tar", fqn)
    assert response.status_code == 200, response.text
    assert response.content == by_body(http, data)
    after = fqn.stat()
    assert (after.st_mtime_ns, after.st_size, stat.S_IMODE(after.st_mode)) == before  # read, never written


@pytest.fixture(scope="module")
def chunked(ais_client, ais_cluster: LocalCluster) -> tuple[bytes, Path]:
    """A shard uploaded in three parts (multipart upload): AIS 5.0 stores it as a chunked object."""
    data = shard(12, size=(160, 120))
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    obj = ais_client.bucket("pod-chunked").create(exist_ok=True).object("big/chunked shard.tar")
    upload = obj.multipart_upload().create()
    for number in (1, 2, 3):
        upload.add_part(number).put_content(data[cut[number - 1]:cut[number]])
    upload.complete()
    assert obj.get_reader().read_all() == data
    fqn = ais_cluster.fqn("pod-chunked", "big/chunked shard.tar")
    assert fqn.read_bytes() == data[: cut[1]]  # the FQN holds the first chunk only
    assert list((ais_cluster.mountpath / "@ais" / "pod-chunked" / "%ch" / "big").iterdir())  # the others live here
    return data, fqn


def test_a_chunked_object_is_detected_and_read_whole(chunked: tuple[bytes, Path], http: httpx.Client,
                                                     relay: EtlObjectRelay) -> None:
    data, fqn = chunked
    expected = by_body(http, data)
    relay.clear()
    pushed = hpush(http, "pod-chunked", "big/chunked shard.tar", fqn)
    assert pushed.status_code == 200, pushed.text
    assert pushed.content == expected  # all 12 samples, not those of the first chunk
    assert len([m for m, _ in read_output(pushed.content) if m.endswith(".npy")]) == 12
    uname = "ais/@#/pod-chunked/big/chunked shard.tar"
    assert [(s.method, s.uname, s.status) for s in relay.recorded()] == [("HEAD", uname, 200), ("GET", uname, 200)]
    pulled = hpull(http, uname, fqn)
    assert pulled.status_code == 200 and pulled.content == expected


def test_a_chunked_object_is_never_a_shorter_shard_when_the_target_cannot_tell(
        chunked: tuple[bytes, Path], http: httpx.Client, relay: EtlObjectRelay) -> None:
    _, fqn = chunked
    relay.head_status = 500
    response = hpush(http, "pod-chunked", "big/chunked shard.tar", fqn)
    assert response.status_code == 422, response.text[:300]
    assert "truncated" in response.text or "end-of-archive" in response.text, response.text[:300]


def test_what_the_pod_gets_for_an_hpush_name_with_a_hash(http: httpx.Client) -> None:
    """AIS 5.0 builds the hpush URL from the raw object name and parses it with Go's url.Parse: for
    ``dir/a shard #1 100% é.tar`` that fails outright ('%' not followed by two hex digits), and for
    ``dir/a #1.tar`` everything from '#' on, ``etl_fqn`` included, becomes the fragment, so the pod gets
    ``PUT /<bucket>/dir/a%20`` with an empty body. It must fail, naming the empty input, not answer an
    empty shard."""
    response = http.put("/pod-names/dir/a%20", content=b"")
    assert response.status_code in (400, 422), response.text
    assert "empty" in response.text, response.text
