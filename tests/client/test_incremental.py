"""Incremental offline transforms against the fake proxy and the real service: each source object classified
from one listing per bucket, the copy ledger and a tail read per copy the ledger does not know, only the stale
ones transformed, orphans (this transformer's copies of gone sources) deleted only when asked, anything else
under the prefix kept."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from testbed.fake_proxy import FakeProxy
from testbed.shardgen import make_tar, read_output, sealed
from transformer.client import ClientError, EtlSettings, register, transform_bucket
from transformer.client.errors import OrphanDeleteRefused
from transformer.client.incremental import PROBE_LIFETIME, PROBE_PREFIX, find_changes, listing_prefix, sweep_probes
from transformer.client.ledger import LEDGER_PREFIX
from transformer.client.whole_copy import read_tail, source_names
from transformer.integrity import marker_from_tail
from transformer.wire import END_OF_ARCHIVE

from .conftest import labelled_shard, registered_pod

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
    yield from registered_pod("sync-pod", ETL.environment(), tmp_path_factory)


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


def bucket_jobs(proxy: FakeProxy) -> list[str]:
    """The prefix of each bucket-to-bucket job started, in order."""
    return [call.body["value"].get("prefix", "") for call in proxy.calls("POST", "/v1/buckets/src")
            if call.body["action"] == "etl-bck"]


def ledgers(proxy: FakeProxy, bucket: str = "dst") -> list[str]:
    return [name for name in proxy.objects(bucket) if name.startswith(LEDGER_PREFIX)]


def forget(proxy: FakeProxy, bucket: str = "dst") -> None:
    """Remove the copy ledgers: the next check knows no copy and asks the pod."""
    for name in ledgers(proxy, bucket):
        proxy.fqn(bucket, name).unlink()


def copies(proxy: FakeProxy, bucket: str = "dst") -> list[str]:
    return [name for name in proxy.objects(bucket) if not name.startswith("__etl__/")]


def writes(proxy: FakeProxy) -> list[tuple[str, str]]:
    """Every request that can change a bucket: object PUTs and DELETEs, bucket actions other than a listing."""
    return [(call.method, call.path) for call in proxy.requests
            if (call.method in ("PUT", "DELETE") and call.path.startswith("/_target/"))
            or (call.path.startswith("/v1/buckets/") and call.method in ("POST", "DELETE"))]


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
    assert first.changes.counts == {"new": 6, "changed": 0, "restyled": 0, "cut": 0, "up_to_date": 0, "orphan": 0,
                                    "other": 0}
    # everything stale: one bucket-to-bucket job over the prefix, no list of names
    assert first.verified == 6 and first.kind == "etl-bck" and bucket_jobs(proxy) == ["val/"]
    assert transformed(proxy) == []
    assert first.changes.tail_reads == 0 and first.changes.probe == ""  # nothing stored yet: no tail, no probe
    assert len(ledgers(proxy)) == 1  # the markers the proof read, kept for the next check
    source = ais.bucket("src")
    source.object(SHARDS[0]).get_writer().put_content(labelled_shard(100, 3))  # rewritten
    source.object(SHARDS[1]).delete()  # its copy is an orphan now
    source.object("val/shard-9.tar").get_writer().put_content(labelled_shard(200, 2))  # new
    cut = proxy.fqn("dst", SHARDS[2]).read_bytes()
    proxy.put_object("dst", SHARDS[2], cut[:len(cut) // 2 + 100])  # a copy cut short (not whole tar blocks)
    restamp(proxy, SHARDS[3], "settings")  # made with other settings
    # a copy with a marker from before the input, settings and version fields
    proxy.put_object("dst", SHARDS[4], sealed(make_tar(read_output(proxy.fqn("dst", SHARDS[4]).read_bytes()))))
    versions = {name: proxy.versions["dst", name] for name in SHARDS}

    second = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    changes = second.changes
    assert changes.counts == {"new": 1, "changed": 1, "restyled": 2, "cut": 1, "up_to_date": 1, "orphan": 1,
                              "other": 0}
    assert changes.new == ("val/shard-9.tar",) and changes.changed == (SHARDS[0],)
    assert set(changes.restyled) == {SHARDS[3], SHARDS[4]}  # other settings; a marker from before the fields
    assert [name for name, _ in changes.cut] == [SHARDS[2]] and changes.up_to_date == (SHARDS[5],)
    assert changes.orphans == (SHARDS[1],) and changes.deleted == ()
    assert sorted(transformed(proxy)[-1]) == sorted(changes.stale) and len(changes.stale) == 5
    assert second.verified == 5 and second.job_id and second.kind == "etl-listrange"
    # the ledger knew the unchanged copies (the rewritten source's, the up-to-date one, the orphan): only the
    # two copies rewritten behind its back are read, the cut one is told from its size, the ETL is not asked
    assert changes.ledger_hits == 2 and changes.tail_reads == 2 and changes.probe == "remembered"
    reads = [call for call in proxy.calls("GET", "/_target/v1/objects/dst/") if "etl_name" not in call.query]
    assert all(call.headers.get("Range", "").startswith("bytes=") for call in reads
               if not call.path.endswith(".ledger"))
    assert proxy.versions["dst", SHARDS[5]] == versions[SHARDS[5]]  # the up-to-date copy untouched
    assert proxy.fqn("dst", SHARDS[1]).is_file()  # the orphan stays
    assert not [name for name in proxy.objects("dst") if name.startswith(PROBE_PREFIX)]  # no probe left
    # the copies now record their sources exactly as AIS lists them
    for name in SHARDS[2:] + ["val/shard-9.tar"]:
        assert marker(proxy, "dst", name)["input"]["cksum"] == proxy.checksum("src", name)

    jobs = len(transformed(proxy))
    before = len(proxy.requests)
    third = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    assert third.changes.stale == () and third.changes.counts["up_to_date"] == 6
    assert third.job_id == "" and len(transformed(proxy)) == jobs  # no job at all
    assert third.changes.orphans == (SHARDS[1],)
    # nothing changed: two listings and the ledger, no tail read, no probe, nothing written
    object_gets = [call.path for call in proxy.requests[before:]
                   if call.method == "GET" and call.path.startswith("/_target/")]
    assert object_gets == [f"/_target/v1/objects/dst/{ledgers(proxy)[0]}"]
    assert third.changes.tail_reads == 0 and third.changes.ledger_hits == 6 and third.changes.probe == "remembered"
    assert not [call for call in proxy.requests[before:] if call.method in ("PUT", "DELETE", "POST")]
    fourth = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True,
                              delete_orphans=True)
    assert fourth.changes.deleted == (SHARDS[1],) and not proxy.fqn("dst", SHARDS[1]).exists()
    deletes = [call for call in proxy.calls("DELETE", "/v1/buckets/dst")]
    assert [call.body["value"]["objnames"] for call in deletes] == [[SHARDS[1]]]  # one multi-object delete
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
    assert copies(proxy) == [name[:-3] + "npy.tar" for name in SHARDS]
    ais.bucket("src").object(SHARDS[5]).delete()
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/", ext={"tar": "npy.tar"})
    assert changes.counts["up_to_date"] == 5 and changes.orphans == ("val/shard-5.npy.tar",)


def test_the_sync_command(ais, proxy: FakeProxy, capsys: pytest.CaptureFixture) -> None:
    from transformer.cli import main

    args = ["sync", "src", "dst", "--etl", "wds-etl-sync", "--endpoint", proxy.url, "--prefix", "val/"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "6 new, 0 changed, 0 restyled, 0 cut, 0 up to date, 0 orphan, 0 other" in out and "job etl-bck-" in out
    assert f"  new: {', '.join(SHARDS)}" in out
    ais.bucket("src").object(SHARDS[0]).delete()
    assert main(args + ["--delete-orphans"]) == 0
    out = capsys.readouterr().out
    assert "0 new, 0 changed, 0 restyled, 0 cut, 5 up to date, 1 orphan, 0 other" in out
    assert "nothing to transform" in out and f"deleted 1 orphan: {SHARDS[0]}" in out
    assert json.loads(json.dumps(copies(proxy))) == SHARDS[1:]


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

    forget(proxy)  # so that the check asks the pod again
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
    forget(proxy)  # no ledger: each check asks the pod
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


def test_delete_orphans_deletes_only_this_transformers_copies_of_gone_sources(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    ais.bucket("src").object(SHARDS[0]).delete()  # its copy: an orphan
    proxy.put_object("dst", "val/index.json", b'{"shards": 6}')  # put by hand: no end marker
    proxy.put_object("dst", "val/notes.tar", make_tar([("a.txt", b"by hand")]))  # a tar, but not the ETL's
    proxy.put_object("dst", "val/shard-7.tar", sealed(make_tar([("x.cls", b"1")])))  # a marker, no source ever
    job = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True,
                           delete_orphans=True)
    changes = job.changes
    # the hand-made marker's shard counts as this transformer's copy of a gone source: it has the marker
    assert changes.deleted == (SHARDS[0], "val/shard-7.tar") and changes.not_deleted == ()
    others = dict(changes.others)
    assert sorted(others) == ["val/index.json", "val/notes.tar"]
    assert others["val/index.json"] == ("no end marker of this transformer (13 bytes are not whole 512-byte tar "
                                        "blocks: cut short, no end marker)")
    assert others["val/notes.tar"].startswith("no end marker of this transformer (")
    assert proxy.fqn("dst", "val/index.json").is_file() and proxy.fqn("dst", "val/notes.tar").is_file()
    assert copies(proxy) == ["val/index.json", "val/notes.tar", *SHARDS[1:]]


def test_the_dotted_prefix_keeps_its_neighbours(ais, proxy: FakeProxy) -> None:
    source = ais.bucket("src")
    for version in ("v1.2", "v1.3"):
        for i in range(3):
            source.object(f"{version}/s-{i}.tar").get_writer().put_content(labelled_shard(i, 1))
    ext = {"tar": "npy.tar"}
    for version in ("v1.2", "v1.3"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix=version, ext=ext, incremental=True)
    source.object("v1.2/s-0.tar").delete()
    job = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="v1.2", ext=ext,
                           incremental=True, delete_orphans=True)
    assert job.changes.deleted == ("v1.2/s-0.npy.tar",) and job.changes.others == ()
    assert [name for name in copies(proxy) if name.startswith("v1.3/")] == [f"v1.3/s-{i}.npy.tar" for i in range(3)]
    # the listing prefix is cut at a dot only where ext could rename what follows it
    assert listing_prefix("v1.2", ext) == "v1.2" and listing_prefix("v1.2/s-1.t", ext) == "v1.2/s-1."
    assert listing_prefix("v1.2/s-1.t", None) == "v1.2/s-1.t"
    # cut there, the listing holds names no source under the prefix maps to: reported, never deleted
    proxy.put_object("dst", "v1.2/s-1.json", sealed(make_tar([("x.cls", b"1")])))
    cut = transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="v1.2/s-1.t", ext=ext,
                           incremental=True, delete_orphans=True)
    assert cut.changes.deleted == () and cut.changes.others == (
        ("v1.2/s-1.json", "its name maps back to no source name under the prefix 'v1.2/s-1.t' (ext {'tar': "
                          "'npy.tar'})"),)
    assert proxy.fqn("dst", "v1.2/s-1.json").is_file()
    assert source_names("a.npy.tar", ext) == ("a.tar",) and source_names("a.json", ext) == ("a.json",)


def test_a_listing_taken_during_a_rebalance_refuses_to_delete(ais, proxy: FakeProxy,
                                                                capsys: pytest.CaptureFixture) -> None:
    from transformer.cli import main

    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    ais.bucket("src").object(SHARDS[0]).delete()
    proxy.flagged_pages = True  # every listing page flagged by the targets
    with pytest.raises(OrphanDeleteRefused, match=r"ais://dst: 1 orphan\(s\) not deleted: AIS flagged the listing of "
                                                  r"ais://dst as taken during a rebalance") as raised:
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True,
                         delete_orphans=True)
    assert raised.value.orphans == [SHARDS[0]] and raised.value.job.changes.rebalancing
    assert proxy.fqn("dst", SHARDS[0]).is_file() and proxy.calls("DELETE", "/v1/buckets/") == []
    args = ["sync", "src", "dst", "--etl", "wds-etl-sync", "--endpoint", proxy.url, "--prefix", "val/"]
    assert main(args + ["--delete-orphans"]) == 2  # the sync's report, then the refusal
    captured = capsys.readouterr()
    assert "1 orphan, 0 other" in captured.out and "AIS flagged a listing as taken during a rebalance" in captured.out
    assert "error: ais://dst: 1 orphan(s) not deleted" in captured.err
    assert main(args + ["--dry-run", "--delete-orphans"]) == 0
    out = capsys.readouterr().out
    assert "no orphan is deleted until the rebalance has ended" in out
    assert f"dry run: would refuse to delete 1 orphan(s): {SHARDS[0]}" in out
    # pages not flagged, but a rebalance runs: refused too
    proxy.flagged_pages = False
    proxy.running = ["rebalance[g12]"]
    with pytest.raises(OrphanDeleteRefused, match=r"a rebalance runs \(rebalance\[g12\]\)"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True,
                         delete_orphans=True)
    assert proxy.fqn("dst", SHARDS[0]).is_file() and proxy.calls("DELETE", "/v1/buckets/") == []
    proxy.running = []


def test_a_dry_run_changes_nothing(ais, proxy: FakeProxy, capsys: pytest.CaptureFixture) -> None:
    from transformer.cli import main

    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    source = ais.bucket("src")
    source.object(SHARDS[0]).get_writer().put_content(labelled_shard(100, 3))  # changed
    source.object(SHARDS[1]).delete()  # its copy: an orphan
    source.object("val/shard-9.tar").get_writer().put_content(labelled_shard(200, 2))  # new
    proxy.put_object("dst", "val/index.json", b"{}")  # other
    forget(proxy)  # the ETL's settings unknown: a plain check would put a probe
    state = {(bucket, name): proxy.fqn(bucket, name).read_bytes() for bucket in ("src", "dst")
             for name in proxy.objects(bucket)}
    before, earlier = len(proxy.requests), writes(proxy)
    args = ["sync", "src", "dst", "--etl", "wds-etl-sync", "--endpoint", proxy.url, "--prefix", "val/", "--dry-run",
            "--delete-orphans"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 new, 1 changed, 0 restyled, 0 cut, 4 up to date, 1 orphan, 1 other" in out
    assert "  new: val/shard-9.tar" in out and f"  changed: {SHARDS[0]}" in out
    assert "dry run: would transform 2 objects" in out and f"dry run: would delete 1 orphan(s): {SHARDS[1]}" in out
    assert "1 other object(s) under the prefix, never deleted: val/index.json (no end marker" in out
    assert writes(proxy) == earlier  # no PUT, no DELETE, no job
    assert {(bucket, name): proxy.fqn(bucket, name).read_bytes() for bucket in ("src", "dst")
            for name in proxy.objects(bucket)} == state
    # what the ETL writes was read through it from the smallest source, not probed with a put
    through = [call.path for call in proxy.requests[before:] if "etl_name" in call.query]
    assert len(through) == 2 and all(path.startswith("/v1/objects/src/") or path.startswith("/_target/v1/objects/src/")
                                     for path in through)
    with pytest.raises(ValueError, match="dry_run applies to an incremental transform"):
        transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, dry_run=True)


def test_the_ledger_never_gives_a_wrong_class(ais, proxy: FakeProxy, caplog: pytest.LogCaptureFixture) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    # a copy rewritten behind the ledger's back has other bytes, so another identity: read, not trusted
    restamp(proxy, SHARDS[2], "settings")
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/")
    assert changes.restyled == (SHARDS[2],) and changes.tail_reads == 1 and changes.ledger_hits == 5
    # a damaged ledger is set aside: every tail is read, and the ETL asked
    (name,) = ledgers(proxy)
    proxy.put_object("dst", name, proxy.fqn("dst", name).read_bytes()[:-5])
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/")
    assert "the copy ledger cannot be read" in caplog.text and changes.tail_reads == 6 and changes.probe == "asked"
    assert changes.restyled == (SHARDS[2],) and changes.counts["up_to_date"] == 5
    # the ETL re-registered (another run, other pods): the remembered settings do not hold, the pod is asked
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    proxy.etls["wds-etl-sync"].xaction = "etl-restarted"
    changes = find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/")
    assert changes.probe == "asked" and changes.counts["up_to_date"] == 6 and changes.tail_reads == 0


def test_a_tail_is_read_at_the_size_the_object_has_not_the_one_listed(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    whole = proxy.fqn("dst", SHARDS[0]).read_bytes()
    bigger = proxy.fqn("dst", SHARDS[1]).stat().st_size + 8 * 512  # what a listing taken before a rewrite said
    tail = read_tail(ais, "dst", SHARDS[0], bigger)
    assert tail.marker is not None and tail.why == "" and tail.size == len(whole) and tail.reads == 1
    assert tail.checksum == proxy.checksum("dst", SHARDS[0])
    gone = read_tail(ais, "dst", "val/nothing.tar", 4096)
    assert gone.marker is None and gone.why == "listed, then not found when read"


def test_tail_reads_show_progress(ais, proxy: FakeProxy) -> None:
    transform_bucket(ais, "wds-etl-sync", "src", "dst", options=OPTIONS, prefix="val/", incremental=True)
    forget(proxy)
    bars: list[list] = []

    class Bar:
        def __init__(self, total: int, what: str):
            self.record = [what, total, 0, False]
            bars.append(self.record)

        def update(self, n: int = 1) -> None:
            self.record[2] += n

        def close(self) -> None:
            self.record[3] = True

    find_changes(ais, "wds-etl-sync", "src", "dst", prefix="val/", progress=Bar)
    assert bars == [["incremental check", 6, 6, True]]
