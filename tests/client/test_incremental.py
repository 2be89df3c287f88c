"""Incremental offline transforms against the fake proxy and the real service: each source object classified
from one listing per bucket and a tail read per copy, only the stale ones transformed, orphans kept until asked."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from testbed.shardgen import make_tar, read_output, sealed
from transformer.client import ClientError, EtlSettings, register, transform_bucket
from transformer.client.incremental import PROBE_LIFETIME, PROBE_PREFIX, find_changes, sweep_probes
from transformer.integrity import marker_from_tail
from transformer.wire import END_OF_ARCHIVE

from .conftest import labelled_shard
from .fake_proxy import FakeProxy

if TYPE_CHECKING:
    from testbed.service import Service

IMAGE = "registry.local/ais-wds-transformer:0.1.0"
ETL = EtlSettings(image=IMAGE, comm_type="hpush", transforms=[{"Resize": {"size": [16, 16]}}], dtype="uint8",
                  layout="HWC", seed=5, obj_timeout="60s")
OPTIONS = {"transforms": [{"Resize": {"size": [16, 16]}}], "dtype": "uint8", "layout": "HWC", "seed": 5}
SHARDS = [f"val/shard-{i}.tar" for i in range(6)]


@pytest.fixture(scope="module")
def sync_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """The pod AIS would start for the ETL: its registered environment is all it knows."""
    from testbed.service import base_env, start_transformer

    mountpath = tmp_path_factory.mktemp("sync-mountpath")
    env = base_env(**ETL.environment(), ETL_FQN_ROOTS=str(mountpath), ETL_WORKERS="2", ETL_LOG_LEVEL="warning")
    service = start_transformer("sync-pod", tmp_path_factory.mktemp("sync-logs"), env)
    yield service, mountpath
    service.stop()


@pytest.fixture
def proxy(sync_pod: tuple[Service, Path], tmp_path: Path) -> Iterator[FakeProxy]:
    service, mountpath = sync_pod
    with FakeProxy(mountpath, pod_url=service.url) as fake:
        yield fake
    for bucket in list(fake.buckets):  # the mountpath is the module's: the next test starts empty
        for name in fake.objects(bucket):
            fake.fqn(bucket, name).unlink()
    assert fake.problems == [], fake.problems


@pytest.fixture
def ais(proxy: FakeProxy):
    from aistore.sdk import Client

    client = Client(proxy.url, timeout=(2, 60))
    register(client, "wds-etl-sync", ETL)
    source = client.bucket("src").create()
    for i, name in enumerate(SHARDS):
        source.object(name).get_writer().put_content(labelled_shard(3 * i, 3))
    return client


def transformed(proxy: FakeProxy) -> list[list[str]]:
    """The object names of each multi-object job started, in order."""
    return [call.body["value"]["objnames"] for call in proxy.calls("POST", "/v1/buckets/src")
            if call.body["action"] == "etl-listrange"]


def marker(proxy: FakeProxy, bucket: str, name: str) -> dict:
    data = proxy.fqn(bucket, name).read_bytes()
    return marker_from_tail(lambda offset, length: data[offset:offset + length], len(data), name)


def restamp(proxy: FakeProxy, name: str, field: str) -> None:
    """Rewrite one hex field of a stored copy's end marker with another of the same length (still a valid marker)."""
    path = proxy.fqn("dst", name)
    data, old = path.read_bytes(), marker(proxy, "dst", name)[field]
    value = (old if isinstance(old, str) else old["cksum"]).encode()
    head, tail = data[:-2048], data[-2048:]  # the marker's block and the end-of-archive blocks
    assert tail.count(value) == 1
    path.write_bytes(head + tail.replace(value, b"0" * len(value)))


def test_only_what_changed_is_transformed(ais, proxy: FakeProxy) -> None:
    first = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    assert first.changes.counts == {"new": 6, "changed": 0, "restyled": 0, "cut": 0, "up_to_date": 0, "orphan": 0}
    assert first.verified == 6 and transformed(proxy) == [SHARDS]
    assert first.changes.tail_reads == 0  # nothing stored yet: no tail to read, no probe
    source = ais.bucket("src")
    source.object(SHARDS[0]).get_writer().put_content(labelled_shard(100, 3))  # rewritten
    source.object(SHARDS[1]).delete()  # its copy is an orphan now
    source.object("val/shard-9.tar").get_writer().put_content(labelled_shard(200, 2))  # new
    cut = proxy.fqn("dst", SHARDS[2]).read_bytes()
    proxy.put_object("dst", SHARDS[2], cut[:len(cut) // 2])  # a copy cut short
    restamp(proxy, SHARDS[3], "settings")  # made with other settings
    # a copy with a marker from before the input, settings and version fields
    proxy.put_object("dst", SHARDS[4], sealed(make_tar(read_output(proxy.fqn("dst", SHARDS[4]).read_bytes()))))
    versions = {name: proxy.versions["dst", name] for name in SHARDS}

    second = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    changes = second.changes
    assert changes.counts == {"new": 1, "changed": 1, "restyled": 2, "cut": 1, "up_to_date": 1, "orphan": 1}
    assert changes.new == ("val/shard-9.tar",) and changes.changed == (SHARDS[0],)
    assert set(changes.restyled) == {SHARDS[3], SHARDS[4]}  # other settings; a marker from before the fields
    assert [name for name, _ in changes.cut] == [SHARDS[2]] and changes.up_to_date == (SHARDS[5],)
    assert changes.orphans == (SHARDS[1],) and changes.deleted == ()
    assert sorted(transformed(proxy)[-1]) == sorted(changes.stale) and len(changes.stale) == 5
    assert second.verified == 5 and second.job_id
    # one range GET per stored copy (the cut one is told from its size alone), never a whole object
    assert changes.tail_reads == 4
    reads = [call for call in proxy.calls("GET", "/_target/v1/objects/dst/") if "etl_name" not in call.query]
    assert reads and all(call.headers.get("Range", "").startswith("bytes=") for call in reads)
    assert proxy.versions["dst", SHARDS[5]] == versions[SHARDS[5]]  # the up-to-date copy untouched
    assert proxy.fqn("dst", SHARDS[1]).is_file()  # the orphan stays
    assert not [name for name in proxy.objects("dst") if name.startswith(PROBE_PREFIX)]  # the probe is gone
    # the copies now record their sources exactly as AIS lists them
    for name in SHARDS[2:] + ["val/shard-9.tar"]:
        assert marker(proxy, "dst", name)["input"]["cksum"] == proxy.checksum("src", name)

    jobs = len(transformed(proxy))
    third = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    assert third.changes.stale == () and third.changes.counts["up_to_date"] == 6
    assert third.job_id == "" and len(transformed(proxy)) == jobs  # no job at all
    assert third.changes.orphans == (SHARDS[1],)
    fourth = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True,
                              delete_orphans=True)
    assert fourth.changes.deleted == (SHARDS[1],) and not proxy.fqn("dst", SHARDS[1]).exists()
    assert len(transformed(proxy)) == jobs


def test_a_copy_of_other_bytes_or_another_version_is_redone(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    restamp(proxy, SHARDS[0], "input")  # recorded from other bytes of the same size
    restamp(proxy, SHARDS[1], "version")
    # a source rewritten with identical bytes is up to date: the bytes are what count, not the write
    same = proxy.fqn("src", SHARDS[2]).read_bytes()
    ais.bucket("src").object(SHARDS[2]).get_writer().put_content(same)
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/")
    assert changes.changed == (SHARDS[0],) and changes.restyled == (SHARDS[1],)
    assert SHARDS[2] in changes.up_to_date and changes.counts["up_to_date"] == 4


def test_a_source_bucket_the_pod_cannot_compare_counts_every_copy_as_changed(ais, proxy: FakeProxy,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    proxy.checksum_type = "md5"
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/")
    assert changes.changed == tuple(SHARDS) and changes.identity.startswith("unknown: ais://src checksums")
    assert "every source with a destination counts as changed" in caplog.text


def test_what_cannot_be_compared_is_refused_before_any_job(ais, proxy: FakeProxy) -> None:
    with pytest.raises(ValueError, match="pipeline's end markers record its last stage's input"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, incremental=True,
                         pipeline=["wds-etl-sync"])
    with pytest.raises(ValueError, match="prefix, not names or template"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, incremental=True, names=SHARDS)
    with pytest.raises(ValueError, match="delete_orphans applies to an incremental"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, delete_orphans=True)
    ais.bucket("src").object("val/shard-0.tgz").get_writer().put_content(labelled_shard(50, 1))
    with pytest.raises(ValueError, match="maps both 'val/shard-0.tar' and 'val/shard-0.tgz' to 'val/shard-0.npy'"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, incremental=True,
                         ext={"tar": "npy", "tgz": "npy"})
    with pytest.raises(ValueError, match="both ais://src"):
        transform_bucket(ais, "wds-etl-sync", "src", "src", options=OPTIONS, incremental=True)
    assert [call.body["action"] for call in proxy.calls("POST", "/v1/buckets/")] == ["create-bck"]  # no job
    assert proxy.calls("PUT", "/_target/v1/objects/dst/") == []  # not even the probe


def test_ext_maps_names_and_orphans_are_found_under_the_mapped_names(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", ext={"tar": "npy.tar"},
                     incremental=True)
    assert proxy.objects("dst") == [name[:-3] + "npy.tar" for name in SHARDS]
    ais.bucket("src").object(SHARDS[5]).delete()
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/", ext={"tar": "npy.tar"})
    assert changes.counts["up_to_date"] == 5 and changes.orphans == ("val/shard-5.npy.tar",)


def test_the_sync_command(ais, proxy: FakeProxy, capsys: pytest.CaptureFixture) -> None:
    from transformer.cli import main

    args = ["sync", "src", "dst", "--etl", "wds-etl-sync", "--endpoint", proxy.url, "--prefix", "val/"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "6 new, 0 changed, 0 restyled, 0 cut, 0 up to date, 0 orphan" in out and "job etl-listrange-" in out
    ais.bucket("src").object(SHARDS[0]).delete()
    assert main(args + ["--delete-orphans"]) == 0
    out = capsys.readouterr().out
    assert "0 new, 0 changed, 0 restyled, 0 cut, 5 up to date, 1 orphan" in out
    assert "nothing to transform" in out and f"deleted 1 orphan: {SHARDS[0]}" in out
    assert json.loads(json.dumps(proxy.objects("dst"))) == SHARDS[1:]


def probes(proxy: FakeProxy) -> list[str]:
    return [name for name in proxy.objects("dst") if name.startswith(PROBE_PREFIX)]


def test_a_probe_is_deleted_whatever_happens_and_never_counts_as_an_orphan(ais, proxy: FakeProxy,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    now = int(time.time())
    left = f"{PROBE_PREFIX}{now - PROBE_LIFETIME - 60}-{'0' * 32}.tar"  # a killed check's
    running = f"{PROBE_PREFIX}{now}-{'1' * 32}.tar"  # a check still running beside this one
    for name in (left, running):
        proxy.put_object("dst", name, END_OF_ARCHIVE)
    earlier = len(proxy.calls("PUT", f"/_target/v1/objects/dst/{PROBE_PREFIX}"))
    changes = find_changes(ais, "wds-etl-sync", "src", "dst")  # no prefix: the probes are listed with the rest
    assert changes.orphans == () and changes.counts["up_to_date"] == 6
    assert probes(proxy) == [running]  # the leftover deleted, the running check's kept
    puts = [call.path for call in proxy.calls("PUT", f"/_target/v1/objects/dst/{PROBE_PREFIX}")][earlier:]
    assert len(puts) == 1 and left not in puts[0] and running not in puts[0]

    # the read through the ETL fails: the error is raised, and the probe deleted all the same
    proxy.etls["wds-etl-sync"].stage = "Aborted"
    with pytest.raises(ClientError, match="wds-etl-sync"):
        find_changes(ais, "wds-etl-sync", "src", "dst")
    assert probes(proxy) == [running]
    proxy.etls["wds-etl-sync"].stage = "Running"

    # the delete fails: the check goes on, says so, and the first check after PROBE_LIFETIME deletes the probe
    from aistore.sdk.obj.object import Object

    delete = Object.delete

    def failing(self: Object, *args, **kwargs):
        if self.name.startswith(PROBE_PREFIX):
            raise ConnectionError("connection reset by peer")
        return delete(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Object, "delete", failing)
        assert find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/").counts["up_to_date"] == 6
    assert "could not be deleted (connection reset by peer)" in caplog.text
    stuck = [name for name in probes(proxy) if name != running]
    assert len(stuck) == 1
    assert sweep_probes(ais, "dst") == ()  # young: it could be a running check's
    later = time.time() + PROBE_LIFETIME + 1
    assert sorted(sweep_probes(ais, "dst", now=later)) == sorted([running, *stuck]) and probes(proxy) == []


def test_concurrent_checks_of_one_bucket_use_probes_of_their_own(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    earlier = len(proxy.calls("PUT", f"/_target/v1/objects/dst/{PROBE_PREFIX}"))
    results, start = [], threading.Barrier(4)

    def check() -> None:
        start.wait()
        results.append(find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/"))

    threads = [threading.Thread(target=check) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [changes.counts["up_to_date"] for changes in results] == [6] * 4
    assert all(changes.orphans == () for changes in results)
    puts = [call.path for call in proxy.calls("PUT", f"/_target/v1/objects/dst/{PROBE_PREFIX}")][earlier:]
    assert len(puts) == 4 and len(set(puts)) == 4 and probes(proxy) == []


def test_a_stale_copy_the_job_did_not_rewrite_is_reported(ais, proxy: FakeProxy) -> None:
    from transformer.client import IncompleteCopy

    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    restamp(proxy, SHARDS[0], "settings")
    restamp(proxy, SHARDS[1], "settings")
    proxy.drops.add(SHARDS[1])  # the target loses its new copy: the old one, whole but stale, stays
    with pytest.raises(IncompleteCopy, match=r"1 of 2 objects .* val/shard-1.tar: not rewritten by the job: "
                                             r"still restyled") as raised:
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    assert raised.value.cut == {SHARDS[1]: "not rewritten by the job: still restyled"}
    assert find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/").restyled == (SHARDS[1],)
