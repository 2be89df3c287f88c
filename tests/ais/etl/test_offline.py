"""Offline transforms through the real cluster: a bucket copied whole over both targets (hpush, and ws with
direct put), a multi-object transform by list and by template, the job's per-object errors, and the
pods' logs through AIS."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from testbed.etl_cluster import EtlCluster
from testbed.shardgen import read_output
from transformer.client import IncompleteCopy, etl_logs, transform_bucket
from transformer.client.offline import wait_job, wait_transform

from .conftest import delivered, owner_of, put_shards

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
SHARDS = [f"val-{i:04d}.tar" for i in range(10)]
SAMPLES = 4
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what settings() registers


@pytest.fixture(scope="module")
def offline(etl_client, etls: dict[str, str]) -> dict[str, str]:
    put_shards(etl_client, "offline-src", SHARDS, SAMPLES)
    return etls


def objects(client, bucket: str) -> list[str]:
    return sorted(entry.name for entry in client.bucket(bucket).list_all_objects())


def raw(client, bucket: str, name: str) -> bytes:
    return client.bucket(bucket).object(name).get_reader().read_all()


@pytest.mark.parametrize("comm", ["hpush", "ws"])
def test_transform_bucket_copies_it_whole_over_both_targets(etl_client, etl_cluster: EtlCluster, offline,
                                                           comm: str) -> None:
    name, destination = offline[comm], f"offline-dst-{comm}"
    before = delivered(etl_cluster, name)
    started = time.monotonic()
    job = transform_bucket(etl_client, name, "offline-src", destination, options=OPTIONS)  # timeout: an hour
    assert job.finished and job.success and not job.object_errors and job.verified == len(SHARDS), job
    # reported soon after it ends (the SDK alone would poll every 56 s for an hour's timeout)
    assert time.monotonic() - started < 30
    assert objects(etl_client, destination) == SHARDS
    moved = 0
    for shard in SHARDS:
        data = raw(etl_client, destination, shard)
        assert sum(n.endswith(".npy") for n, _ in read_output(data)) == SAMPLES, shard  # whole, end marker intact
        # the same bytes an inline read gives with the ETL's own settings (offline jobs carry no etl_args)
        assert data == etl_client.bucket("offline-src").object(shard).get_reader(etl=_etl(name)).read_all(), shard
        moved += owner_of(etl_cluster, destination, shard) != owner_of(etl_cluster, "offline-src", shard)
    assert {owner_of(etl_cluster, destination, shard) for shard in SHARDS} == {0, 1}
    after = delivered(etl_cluster, name)
    # AIS asks for a direct put exactly when the destination is on the other target (Ais-Node-Url)
    assert moved and after.get("target", 0) - before.get("target", 0) == moved


def _etl(name: str):
    from aistore.sdk.etl import ETLConfig

    return ETLConfig(name)


@pytest.mark.parametrize("how", ["names", "template"])
def test_multi_object_transform_by_list_or_template(etl_client, offline, how: str) -> None:
    destination = f"offline-some-{how}"
    chosen = {"names": {"names": [SHARDS[1], SHARDS[4], SHARDS[8]]},
              "template": {"template": "val-{0002..0005}.tar"}}[how]
    job = transform_bucket(etl_client, offline["hpush"], "offline-src", destination, options=OPTIONS, timeout=300,
                           **chosen)
    wanted = chosen.get("names") or [f"val-{i:04d}.tar" for i in range(2, 6)]
    assert job.success and not job.object_errors and job.verified == len(wanted), job
    assert objects(etl_client, destination) == sorted(wanted)
    for shard in wanted:
        read_output(raw(etl_client, destination, shard))


def test_job_records_each_failed_object_and_copies_the_rest(etl_client, offline) -> None:
    put_shards(etl_client, "offline-broken", SHARDS[:3], SAMPLES)
    etl_client.bucket("offline-broken").object("broken.tar").get_writer().put_content(b"not a tar archive" * 100)
    job = transform_bucket(etl_client, offline["hpush"], "offline-broken", "offline-broken-dst", options=OPTIONS,
                           timeout=300)
    assert job.finished and job.verified == 3
    assert [name for name, _ in job.object_errors] == ["ais://offline-broken/broken.tar"], job.object_errors
    assert "offline-broken/broken.tar" in job.object_errors[0][1] and "not a tar archive" in job.object_errors[0][1]
    assert objects(etl_client, "offline-broken-dst") == sorted(SHARDS[:3])


def test_a_copy_changed_after_its_job_is_caught_from_the_tails(etl_client, offline) -> None:
    """The check through the real AIS (listing, range GETs of each tail through the proxy): the job ends,
    then one copy is deleted and one cut before its end marker, a valid shorter tar; one padded after it
    stays whole. ``wait_transform`` raises naming both, whatever AIS says of the job."""
    job = transform_bucket(etl_client, offline["ws"], "offline-src", "offline-changed", options=OPTIONS, wait=False)
    assert not job.finished and job.objects == tuple(SHARDS)
    wait_job(etl_client.job(job.job_id, job_kind=job.kind), 300)
    copy = etl_client.bucket("offline-changed")
    copy.object(SHARDS[3]).delete()
    whole = raw(etl_client, "offline-changed", SHARDS[5])
    copy.object(SHARDS[5]).get_writer().put_content(whole[:-2048] + b"\0" * 1024)
    copy.object(SHARDS[7]).get_writer().put_content(raw(etl_client, "offline-changed", SHARDS[7]) + b"\0" * 9216)
    with pytest.raises(IncompleteCopy) as caught:
        wait_transform(etl_client, job, timeout=300)
    error = caught.value
    assert error.job.success and not error.job.object_errors and error.job.verified == len(SHARDS) - 2
    assert error.missing == [SHARDS[3]]
    assert error.cut == {SHARDS[5]: "its last member is 's005-sample-000003.json', not the end marker "
                                    "'__etl__/end.json'"}


def test_etl_logs_come_from_both_pods(etl_client, etl_cluster: EtlCluster, offline) -> None:
    logs = etl_logs(etl_client, offline["hpush"])
    targets = {json.loads(httpx.get(f"{node.url}/v1/daemon", params={"what": "snode"}).text)["daemon_id"]
               for node in etl_cluster.targets}
    assert set(logs) == targets
    for text in logs.values():
        assert "transformer ready" in text


def test_copy_check_bench_measures_every_case(etl_client, offline) -> None:
    """bench/experiments/copy_check.py, small: each case runs through the real cluster; the check reads 2 KiB
    an object."""
    from bench.experiments.copy_check import CASES, markdown, measure

    result = measure(etl_client, offline["hpush"], objects=12, rounds=1, progress=lambda line: None)
    assert list(result["summary"]) == list(CASES)
    assert result["summary"]["check"]["bytes_read"] == 12 * 2048
    assert result["summary"]["read-whole"]["bytes_read"] == 12 * result["object_bytes"]
    assert "| check |" in markdown(result)
