"""ETL downloads through the real cluster: AIS's downloader asks the hpush pod (``POST /download``), which
fetches the link, transforms it with the job's ``etl_args`` and answers; AIS stores the answer. The links
are served by a small HTTP origin inside the cluster's network namespace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from testbed.etl_cluster import NODES, REAL_KUBERNETES, EtlCluster
from testbed.httpserve import StaticServer
from testbed.k8s.topology import LAN_GATEWAY
from testbed.shardgen import read_output
from transformer.client import download, shard_urls

from .conftest import shard_bytes
from .test_failures import failing_shard

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
SHARDS = {f"train-{i:04d}.tar": shard_bytes(i, 4) for i in range(4)}
ARGS = {"dtype": "uint8", "seed": 11}


@pytest.fixture(scope="module")
def origin(etl_cluster: EtlCluster) -> Iterator[str]:
    """An HTTP server with the shards above, ``junk.tar`` (no tar) and ``bad.tar`` (a sample fails after the
    first byte); anything else is 404. It listens on node-0's address, in the cluster's namespace (on a real
    Kubernetes, on the machine room's address, outside both nodes, where the pods reach it)."""
    files = {f"/data/{name}": data for name, data in SHARDS.items()}
    files["/data/junk.tar"] = b"not a tar archive" * 100
    files["/data/bad.tar"] = failing_shard()
    server = StaticServer(files, host=LAN_GATEWAY if REAL_KUBERNETES else NODES["node-0"])
    yield f"{server.url}/data"
    server.close()


def objects(client, bucket: str) -> list[str]:
    return sorted(entry.name for entry in client.bucket(bucket).list_all_objects())


def stored(client, bucket: str, name: str) -> bytes:
    return client.bucket(bucket).object(name).get_reader().read_all()


def test_downloaded_shard_is_what_an_inline_read_gives(etl_client, etls, origin: str) -> None:
    name = "train-0000.tar"
    args = {"dtype": "float32"}  # not the ETL's own setting (uint8): only etl_args make the pod use it
    job = download(etl_client, etls["hpush"], "dl-one", f"{origin}/{name}", etl_args=args, timeout=120)
    assert job.success and job.stored == 1, job  # the bucket did not exist: AIS creates it
    data = stored(etl_client, "dl-one", name)
    etl_client.bucket("dl-source").create(exist_ok=True)
    etl_client.bucket("dl-source").object(name).get_writer().put_content(SHARDS[name])
    (url,) = shard_urls(etl_client, "dl-source", etls["hpush"], names=[name], etl_args=args)
    inline = requests.get(url, timeout=60).content
    assert data == inline  # etl_args reached the pod; the end marker is in place
    arrays = [member for n, member in read_output(data) if n.endswith(".npy")]
    assert len(arrays) == 4 and all(b"'descr': '<f4'" in array[:128] for array in arrays)


@pytest.mark.parametrize("how", ["template", "list", "mapping"])
def test_many_links_by_template_list_or_mapping(etl_client, etls, origin: str, how: str) -> None:
    links = {"template": f"{origin}/train-{{0000..0003}}.tar",
             "list": [f"{origin}/{name}" for name in SHARDS],
             "mapping": {f"copy/{name}": f"{origin}/{name}" for name in SHARDS}}[how]
    bucket = f"dl-{how}"
    job = download(etl_client, etls["hpush"], bucket, links, etl_args=ARGS, timeout=120)
    assert job.success and job.stored == 4 and job.verified == 4, job  # each proven whole from its tail
    names = sorted(f"copy/{n}" for n in SHARDS) if how == "mapping" else sorted(SHARDS)
    assert objects(etl_client, bucket) == names
    for name in names:
        assert sum(n.endswith(".npy") for n, _ in read_output(stored(etl_client, bucket, name))) == 4, name


def test_each_failed_link_is_named_and_nothing_cut_is_stored(etl_client, etls, origin: str) -> None:
    links = {name: f"{origin}/{name}" for name in ("train-0001.tar", "missing.tar", "junk.tar", "bad.tar")}
    job = download(etl_client, etls["hpush"], "dl-fail", links, etl_args={**ARGS, "on_error": "fail"}, timeout=120)
    assert job.finished and not job.success and job.stored == 1 and job.verified == 1, job
    errors = dict(job.object_errors)
    assert sorted(errors) == ["bad.tar", "junk.tar", "missing.tar"], errors
    assert "404" in errors["missing.tar"]  # the origin's 404, as the pod's status
    assert "422" in errors["junk.tar"]  # the pod refused the shard before its first byte
    assert "unexpected EOF" in errors["bad.tar"]  # the pod's answer was cut: AIS stored nothing
    assert objects(etl_client, "dl-fail") == ["train-0001.tar"]
    # with on_error=skip the same shard arrives whole, without the failing sample
    job = download(etl_client, etls["hpush"], "dl-fail", f"{origin}/bad.tar", etl_args={**ARGS, "on_error": "skip"},
                   timeout=120)
    assert job.success, job
    assert sum(n.endswith(".npy") for n, _ in read_output(stored(etl_client, "dl-fail", "bad.tar"))) == 23


def test_only_an_hpush_etl_downloads(etl_client, etls, origin: str) -> None:
    for comm in ("hpull", "ws"):
        with pytest.raises(ValueError, match=rf"communicates over {comm}://; AIS serves downloads through hpush"):
            download(etl_client, etls[comm], "dl-refused", f"{origin}/train-0000.tar")
    with pytest.raises(ValueError, match="'no-such-etl' is not registered"):
        download(etl_client, "no-such-etl", "dl-refused", f"{origin}/train-0000.tar")
