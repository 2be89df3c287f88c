"""Incremental offline transforms through the real cluster (two targets): AIS's own xxhash2 checksums against
the pods' input digests, only the stale shards transformed, the untouched copies left alone, orphans kept until
asked, a re-registered ETL redoing everything (either way of re-registering, at once), and the check of 1,000
up-to-date shards timed."""

from __future__ import annotations

import time

import pytest

from transformer.client import register, transform_bucket, unregister
from transformer.integrity import marker_from_tail

from .conftest import delivered, put_shards, settings, shard_bytes

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
SHARDS = [f"inc-{i:04d}.tar" for i in range(12)]
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what settings() registers
ETL = "etl-incremental"


def state(client, bucket: str) -> dict[str, tuple[str, str]]:
    """Name -> (AIS version, AIS checksum) of every object, as AIS lists them."""
    return {entry.name: (entry.version, entry.checksum)
            for entry in client.bucket(bucket).list_all_objects(props="name,version,checksum")}


def marker_of(client, bucket: str, name: str) -> dict:
    data = client.bucket(bucket).object(name).get_reader().read_all()
    return marker_from_tail(lambda offset, length: data[offset:offset + length], len(data), name)


def transformed(cluster, etl: str) -> int:
    """Shards the ETL's pods transformed whole so far; a check's probe is one of them (asked only when the copy
    ledger does not hold what this run of the ETL writes)."""
    return int(sum(delivered(cluster, etl).values()))


def run(client, **kwargs):
    return transform_bucket(client, ETL, "inc-src", "inc-dst", options=kwargs.pop("options", OPTIONS),
                            incremental=True, timeout=600, **kwargs)


@pytest.fixture
def incremental_etl(etl_client):
    register(etl_client, ETL, settings("hpush"))
    yield ETL
    unregister(etl_client, ETL)


def test_only_what_changed_is_transformed_again(etl_client, etl_cluster, incremental_etl: str) -> None:
    put_shards(etl_client, "inc-src", SHARDS, samples=2)
    first = run(etl_client)  # 1: the baseline, one bucket-to-bucket job
    assert first.changes.counts["new"] == len(SHARDS) and first.verified == len(SHARDS), first
    assert first.kind == "etl-bck"
    listed = state(etl_client, "inc-src")
    for name in SHARDS:  # the pods' digest of what they read is AIS's own checksum of the source
        recorded = marker_of(etl_client, "inc-dst", name)["input"]
        assert recorded["cksum_type"] == "xxhash2" and recorded["cksum"] == listed[name][1], name
        assert recorded["size"] == len(shard_bytes(SHARDS.index(name), 2))

    # 2: rewrite 2 sources, delete 1, add 1, cut 1 copy
    source = etl_client.bucket("inc-src")
    for index in (0, 1):
        source.object(SHARDS[index]).get_writer().put_content(shard_bytes(100 + index, 3))
    source.object(SHARDS[2]).delete()
    source.object("inc-0099.tar").get_writer().put_content(shard_bytes(99, 2))
    whole = etl_client.bucket("inc-dst").object(SHARDS[3]).get_reader().read_all()
    etl_client.bucket("inc-dst").object(SHARDS[3]).get_writer().put_content(whole[:-3000])
    before, pods_before = state(etl_client, "inc-dst"), transformed(etl_cluster, ETL)
    second = run(etl_client)
    changes = second.changes
    assert changes.counts == {"new": 1, "changed": 2, "restyled": 0, "cut": 1, "up_to_date": 8, "orphan": 1,
                              "other": 0}
    assert sorted(changes.stale) == sorted([SHARDS[0], SHARDS[1], SHARDS[3], "inc-0099.tar"])
    assert second.job_id and second.kind == "etl-listrange" and second.verified == 4 and not second.object_errors
    # the ledger knew every copy but the cut one, and what this run of the ETL writes: no probe
    assert changes.ledger_hits == 10 and changes.probe == "remembered"
    assert transformed(etl_cluster, ETL) - pods_before == 4  # the 4 stale shards, no more
    after = state(etl_client, "inc-dst")
    untouched = SHARDS[4:]
    assert {name: after[name] for name in untouched} == {name: before[name] for name in untouched}
    assert changes.orphans == (SHARDS[2],) and SHARDS[2] in after  # reported, kept
    assert not [name for name in after if name.startswith("__etl__/probe-")]  # no probe left

    # a second run right after: nothing transformed, nothing changed
    pods_before = transformed(etl_cluster, ETL)
    again = run(etl_client)
    assert again.changes.stale == () and again.job_id == "" and state(etl_client, "inc-dst") == after
    assert again.changes.tail_reads == 0 and transformed(etl_cluster, ETL) - pods_before == 0  # not even a probe
    removed = run(etl_client, delete_orphans=True)
    assert removed.changes.deleted == (SHARDS[2],) and SHARDS[2] not in state(etl_client, "inc-dst")

    # 3: the ETL re-registered with another dtype, at once (the last list job still idles): every copy is redone
    register(etl_client, ETL, settings("hpush", dtype="float16"), replace=True)
    redone = run(etl_client, options={**OPTIONS, "dtype": "float16"})
    live = sorted(set(SHARDS) - {SHARDS[2]} | {"inc-0099.tar"})
    assert sorted(redone.changes.restyled) == live and redone.verified == len(live), redone.changes.counts
    assert redone.kind == "etl-bck" and redone.changes.probe == "asked"  # everything stale; a new run of the ETL
    assert transformed(etl_cluster, ETL) == len(live) + 1  # new pods: every live shard, and the probe
    # every copy rewritten: other bytes (AIS's checksum), made with the new settings (the marker's digest)
    rewritten = state(etl_client, "inc-dst")
    assert all(rewritten[name][1] != after[name][1] for name in live), (rewritten, after)
    assert {marker_of(etl_client, "inc-dst", name)["settings"] for name in live} == {redone.changes.settings}
    assert redone.changes.settings != again.changes.settings
    assert run(etl_client, options={**OPTIONS, "dtype": "float16"}).job_id == ""
    assert state(etl_client, "inc-dst") == rewritten


@pytest.mark.parametrize("how", ["unregister", "replace"])
def test_a_settings_change_right_after_a_run_redoes_every_copy(etl_client, how: str) -> None:
    """Re-registered with another dtype at once after a run whose list job still idles (AIS keeps one for up to
    about two minutes and hands it the next list between the same buckets), twice: every copy is redone (one
    bucket-to-bucket job) and proven. With unregister and register, a partial change right after the first
    re-registration goes through a list job of the new pods, once the old one has ended."""
    source, destination, name = f"set-{how}-src", f"set-{how}-dst", f"etl-settings-{how}"
    shards = [f"s-{i:03d}.tar" for i in range(8)]
    put_shards(etl_client, source, shards, samples=2)

    def sync(dtype: str):
        return transform_bucket(etl_client, name, source, destination, options={**OPTIONS, "dtype": dtype},
                                incremental=True, timeout=600)

    def markers() -> set[str]:
        return {marker_of(etl_client, destination, shard)["settings"] for shard in shards}

    register(etl_client, name, settings("hpush", dtype="float32"))
    try:
        assert sync("float32").verified == len(shards)
        etl_client.bucket(source).object(shards[0]).get_writer().put_content(shard_bytes(50, 2))
        assert sync("float32").changes.changed == (shards[0],)  # a list job: it idles on after the run
        for dtype in ("uint8", "float16"):  # a smaller copy, then a bigger one: an older listing never fits both
            if how == "unregister":
                unregister(etl_client, name)
                register(etl_client, name, settings("hpush", dtype=dtype))
            else:
                register(etl_client, name, settings("hpush", dtype=dtype), replace=True)
            redone = sync(dtype)
            assert redone.kind == "etl-bck" and redone.changes.probe == "asked"
            assert sorted(redone.changes.restyled) == shards and redone.verified == len(shards), redone.changes
            assert not redone.object_errors and markers() == {redone.changes.settings}
            assert sync(dtype).job_id == ""  # up to date at once
        if how == "unregister":
            etl_client.bucket(source).object(shards[1]).get_writer().put_content(shard_bytes(60, 2))
            partial = sync("float16")  # the list job from before the re-registrations is waited out first
            assert partial.kind == "etl-listrange" and partial.changes.changed == (shards[1],)
            assert partial.verified == 1 and not partial.object_errors and markers() == {redone.changes.settings}
    finally:
        unregister(etl_client, name)


@pytest.mark.slow
def test_checking_1000_up_to_date_shards_takes_under_30_s(etl_client, incremental_etl: str) -> None:
    names = [f"big-{i:04d}.tar" for i in range(1000)]
    payload = shard_bytes(0, 1)
    source = etl_client.bucket("inc-big-src")
    source.create(exist_ok=True)
    for name in names:
        source.object(name).get_writer().put_content(payload)
    first = transform_bucket(etl_client, ETL, "inc-big-src", "inc-big-dst", options=OPTIONS, incremental=True,
                             timeout=1800)
    assert first.verified == len(names)
    started = time.monotonic()
    check = transform_bucket(etl_client, ETL, "inc-big-src", "inc-big-dst", options=OPTIONS, incremental=True)
    seconds = time.monotonic() - started
    print(f"checked {len(names)} up-to-date shards in {seconds:.2f} s ({check.changes.tail_reads} tail reads)")
    assert check.job_id == "" and check.changes.counts["up_to_date"] == len(names)
    assert seconds < 30
