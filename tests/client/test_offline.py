"""Offline transforms against the fake proxy: an ETL'd copy of a bucket made by a pod started with the ETL's own
environment (AIS passes no etl_args to offline jobs), the options check, job errors, pod logs, pipeline URLs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pytest

from testbed.fake_proxy import FakeProxy
from testbed.httpserve import StaticServer
from testbed.shardgen import read_output
from transformer.client import (
    ClientError,
    EtlSettings,
    IncompleteCopy,
    OfflineOptionsMismatch,
    download,
    etl_logs,
    register,
    shard_urls,
    transform_bucket,
)
from transformer.client.copy_options import check_offline_options
from transformer.client.download import wait_download
from transformer.client.jobs import object_errors
from transformer.client.offline import wait_transform

from .conftest import labelled_shard, registered_pod

if TYPE_CHECKING:
    from testbed.service import Service

IMAGE = "registry.local/ais-wds-transformer:0.1.0"
VAL = EtlSettings(image=IMAGE, comm_type="hpush", transforms=[{"Resize": {"size": [16, 16]}}], dtype="uint8",
                  layout="HWC", obj_timeout="60s")
VAL_OPTIONS = {"transforms": [{"Resize": {"size": [16, 16]}}], "dtype": "uint8", "layout": "HWC"}


@pytest.fixture(scope="module")
def val_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """The pod AIS would start for the VAL ETL: the registered environment is all it knows."""
    yield from registered_pod("offline-val-pod", VAL.environment(), tmp_path_factory)


@pytest.fixture
def val_proxy(val_pod: tuple[Service, Path]) -> Iterator[FakeProxy]:
    service, mountpath = val_pod
    with FakeProxy(mountpath, pod_url=service.url) as fake:
        yield fake
    assert fake.problems == [], fake.problems


def client_of(proxy: FakeProxy):
    from aistore.sdk import Client

    return Client(proxy.url, timeout=(2, 60))


def test_an_offline_copy_is_made_with_the_etls_own_settings(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    source = ais.bucket("imagenet").create()
    for i in range(2):
        source.object(f"val/shard-{i}.tar").get_writer().put_content(labelled_shard(4 * i, 4))
    source.object("val/broken.tar").get_writer().put_content(b"not a tar archive")
    source.object("train/shard-0.tar").get_writer().put_content(labelled_shard(100, 2))
    ais.bucket("imagenet-val").create()

    job = transform_bucket(ais, "wds-etl-val", "imagenet", "imagenet-val", options=VAL_OPTIONS, prefix="val/",
                           timeout=60)
    assert job.finished and job.success and job.error is None, job
    assert val_proxy.objects("imagenet-val") == ["val/shard-0.tar", "val/shard-1.tar"]  # the prefix only
    assert job.verified == 2  # both proven whole; the broken one is among the errors
    for i in range(2):
        members = read_output(val_proxy.fqn("imagenet-val", f"val/shard-{i}.tar").read_bytes())
        arrays = [np.load(__import__("io").BytesIO(data)) for name, data in members if name.endswith(".npy")]
        assert len(arrays) == 4 and all(a.shape == (16, 16, 3) and a.dtype == np.uint8 for a in arrays)
    (name, message), = job.object_errors  # continue on error: recorded, the job went on
    assert name == "ais://imagenet/val/broken.tar" and "not a tar archive" in message  # as AIS names it
    assert object_errors(ais, "wds-etl-val", job.job_id) == job.object_errors
    (start,) = [c for c in val_proxy.calls("POST", "/v1/buckets/imagenet") if c.body["action"] == "etl-bck"]
    assert start.body["value"]["id"] == "wds-etl-val" and "etl_args" not in str(start.body)


def test_options_the_etl_would_not_use_are_refused_before_any_job(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    assert check_offline_options(ais, "wds-etl-val", VAL_OPTIONS)["dtype"] == "uint8"
    with pytest.raises(OfflineOptionsMismatch) as failure:
        transform_bucket(ais, "wds-etl-val", "imagenet", "out", options={"preset": "imagenet-val", "dtype": "float32"})
    message = str(failure.value)
    assert "pipeline: the ETL uses \"'transforms'" in message
    assert "dtype: the ETL uses 'uint8', wanted 'float32'" in message
    assert "AIS passes no etl_args to offline transforms" in message
    assert "register(client, 'wds-etl-val-val'" in message
    assert val_proxy.calls("POST", "/v1/buckets/") == []  # nothing started
    with pytest.raises(ValueError, match="say which pipeline"):
        check_offline_options(ais, "wds-etl-val", {"dtype": "uint8"})
    with pytest.raises(ValueError, match="no epoch"):
        check_offline_options(ais, "wds-etl-val", {**VAL_OPTIONS, "epoch": 1})
    with pytest.raises(ValueError, match="unknown field 'size'"):
        check_offline_options(ais, "wds-etl-val", {**VAL_OPTIONS, "size": 1})
    with pytest.raises(Exception, match="is not registered"):
        check_offline_options(ais, "wds-etl-other", VAL_OPTIONS)


def test_defaults_count_as_the_etls_settings(val_proxy: FakeProxy, caplog: pytest.LogCaptureFixture) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-train", EtlSettings(image=IMAGE))  # imagenet-train, float32, CHW, no seed
    with caplog.at_level("WARNING", logger="transformer.client"):
        used = check_offline_options(ais, "wds-etl-train", {"preset": "imagenet-train", "dtype": "float32"})
    assert used == {"preset": "imagenet-train", "dtype": "float32", "layout": "CHW", "on_error": "skip", "seed": None}
    assert "one random draw" in caplog.text


def test_pod_logs(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    val_proxy.pod_logs = "INFO transformer: shard val/shard-0.tar: 4 samples\n"
    assert etl_logs(ais, "wds-etl-val") == {"t1": "INFO transformer: shard val/shard-0.tar: 4 samples\n"}


def test_pipeline_urls_carry_what_the_sdks_pipeline_sends(val_proxy: FakeProxy) -> None:
    from aistore.sdk.etl import ETLConfig

    ais = client_of(val_proxy)
    urls = shard_urls(ais, "imagenet", "wds-etl", names=["a.tar"], etl_args={"dtype": "uint8"},
                      pipeline=["wds-etl-next"])
    query = parse_qs(urlsplit(urls[0]).query)
    sdk: dict[str, str] = {}
    ETLConfig(ais.etl("wds-etl") >> ais.etl("wds-etl-next")).update_qparams(sdk)
    assert {k: v[0] for k, v in query.items() if k.startswith("etl_") and k != "etl_args"} == sdk
    assert query["etl_args"] == ['{"dtype":"uint8"}']
    with pytest.raises(ValueError, match="needs the first ETL"):
        shard_urls(ais, "imagenet", None, names=["a.tar"], pipeline=["wds-etl-next"])


# ---- the copy proven whole --------------------------------------------------------------------------------


def val_bucket(ais, count: int = 4) -> str:
    """A new bucket (the pod's mountpath outlives each test's proxy) of ``count`` shards ``val/shard-<i>.tar``."""
    bucket = "imagenet-" + uuid.uuid4().hex[:8]
    source = ais.bucket(bucket).create()
    for i in range(count):
        source.object(f"val/shard-{i}.tar").get_writer().put_content(labelled_shard(4 * i, 2))
    return bucket


def test_a_job_that_reports_success_with_an_object_missing_raises_naming_it(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais)
    val_proxy.drops.add("val/shard-2.tar")  # the target loses it and records nothing
    with pytest.raises(IncompleteCopy) as failure:
        transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val", options=VAL_OPTIONS, timeout=60)
    error = failure.value
    assert error.missing == ["val/shard-2.tar"] and error.cut == {}
    assert error.job.success and error.job.object_errors == [] and error.job.verified == 3  # what AIS said
    assert str(error).startswith(f"job {error.job.job_id} (ais://{src} -> ais://{src}-imagenet-val): 1 of 4 objects "
                                 "asked for are not whole in the destination and AIS recorded no error for them (it "
                                 "reports the job as succeeded); missing: val/shard-2.tar. Transform or download")


def test_a_cut_object_stored_without_an_error_raises_naming_why(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais)
    val_proxy.cuts["val/shard-1.tar"] = 3000  # stored cut, as a ws reply on the same target is
    val_proxy.cuts["val/shard-3.tar"] = 4096  # ... at a block boundary, a valid shorter tar
    with pytest.raises(IncompleteCopy) as failure:
        transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val", options=VAL_OPTIONS, timeout=60)
    error = failure.value
    assert error.missing == [] and sorted(error.cut) == ["val/shard-1.tar", "val/shard-3.tar"]
    assert "not whole 512-byte tar blocks" in error.cut["val/shard-1.tar"]
    assert "no end-of-archive blocks" in error.cut["val/shard-3.tar"]
    assert "stored cut (no valid end marker): val/shard-1.tar: 3000 bytes" in str(error)


def test_the_check_lists_once_and_reads_only_each_objects_tail(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais, 7)
    before = len(val_proxy.requests)
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val", options=VAL_OPTIONS, timeout=60)
    assert job.verified == 7
    requests = val_proxy.requests[before:]
    listings = [r for r in requests if r.path == f"/v1/buckets/{src}-imagenet-val" and r.body["action"] == "list"]
    assert len(listings) == 3  # one listing, its pages (3 objects a page)
    assert all(r.body["value"]["props"] == "name,size,checksum" for r in listings)
    where = f"/_target/v1/objects/{src}-imagenet-val/"
    reads = {unquote(r.path[len(where):]): r.headers["Range"] for r in requests
             if r.method == "GET" and r.path.startswith(where)}
    assert len(reads) == 7 and len([r for r in requests if r.path.startswith(where)]) == 7
    assert set(reads.values()) == {"bytes=-2048"}  # the last 2 KiB of each, nothing else


def test_names_map_through_ext(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais, 3)
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val", options=VAL_OPTIONS, ext={"tar": "npy.tar"},
                           timeout=60)
    assert job.verified == 3 and val_proxy.objects(f"{src}-imagenet-val")[0] == "val/shard-0.npy.tar"
    val_proxy.drops.add("val/shard-1.tar")
    with pytest.raises(IncompleteCopy, match=r"missing: val/shard-1\.npy\.tar \(from val/shard-1\.tar\)"):
        transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-ext", options=VAL_OPTIONS,
                         ext={"tar": ".npy.tar"}, timeout=60)  # AIS drops the leading dot of the new extension


def test_a_template_checks_the_names_it_expands_to_that_exist(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais, 4)
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-val-some", options=VAL_OPTIONS,
                           template="val/shard-{1..5}.tar", timeout=60)  # 4 and 5 do not exist: AIS skips them
    assert job.verified == 3 and val_proxy.objects(f"{src}-val-some") == [f"val/shard-{i}.tar" for i in (1, 2, 3)]
    val_proxy.drops.add("val/shard-2.tar")
    with pytest.raises(IncompleteCopy) as failure:
        transform_bucket(ais, "wds-etl-val", src, f"{src}-val-other", options=VAL_OPTIONS,
                         template="val/shard-{1..5}.tar", timeout=60)
    assert failure.value.missing == ["val/shard-2.tar"] and "1 of 3 objects" in str(failure.value)
    with pytest.raises(ValueError, match="give the range in braces"):
        transform_bucket(ais, "wds-etl-val", src, f"{src}-val-other", options=VAL_OPTIONS, template="val/shard-@5.tar")


def test_a_list_checks_each_name_and_a_missing_source_is_an_error_of_the_job(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais, 4)
    names = ["val/shard-0.tar", "val/shard-3.tar", "val/nope.tar"]
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-val-list", options=VAL_OPTIONS, names=names, timeout=60)
    assert job.verified == 2 and job.object_errors == [(f"ais://{src}/val/nope.tar", "object not found")]
    val_proxy.drops.add("val/shard-3.tar")
    with pytest.raises(IncompleteCopy) as failure:
        transform_bucket(ais, "wds-etl-val", src, f"{src}-val-list-2", options=VAL_OPTIONS, names=names, timeout=60)
    assert failure.value.missing == ["val/shard-3.tar"]


def test_wait_false_then_wait_transform_checks_the_copy(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    src = val_bucket(ais, 3)
    val_proxy.drops.add("val/shard-0.tar")
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val", options=VAL_OPTIONS, wait=False)
    assert not job.finished and job.objects == tuple(f"val/shard-{i}.tar" for i in range(3))  # listed at the start
    with pytest.raises(IncompleteCopy) as failure:
        wait_transform(ais, job, timeout=60)
    assert failure.value.missing == ["val/shard-0.tar"] and failure.value.job.finished
    val_proxy.drops.clear()
    job = transform_bucket(ais, "wds-etl-val", src, f"{src}-imagenet-val-2", options=VAL_OPTIONS, wait=False)
    done = wait_transform(ais, job, timeout=60)
    assert done.finished and done.success and done.verified == 3


def test_a_pipeline_ending_in_another_etl_is_checked_for_presence_only(val_proxy: FakeProxy,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    ais.etl("other-etl").init(image="registry.local/someone-else:1", comm_type="hpush")  # writes no end marker
    src = val_bucket(ais, 3)
    val_proxy.cuts["val/shard-1.tar"] = 3000
    with caplog.at_level("INFO", logger="transformer.client"):
        job = transform_bucket(ais, "wds-etl-val", src, f"{src}-piped", options=VAL_OPTIONS, pipeline=["other-etl"],
                               timeout=60)
    assert job.verified == 3 and not job.end_marker  # a cut object cannot be told from the stage's own output
    assert "is not this transformer; the copy is checked for the presence of each object" in caplog.text
    val_proxy.drops.add("val/shard-2.tar")
    with pytest.raises(IncompleteCopy, match="missing: val/shard-2.tar"):
        transform_bucket(ais, "wds-etl-val", src, f"{src}-piped-2", options=VAL_OPTIONS, pipeline=["other-etl"],
                         timeout=60)
    register(ais, "wds-etl-val-2", VAL)  # this transformer as the last stage: its marker is checked
    with pytest.raises(IncompleteCopy, match="stored cut"):
        transform_bucket(ais, "wds-etl-val", src, f"{src}-piped-3", options=VAL_OPTIONS, pipeline=["wds-etl-val-2"],
                         timeout=60)


@pytest.fixture
def origin() -> Iterator[str]:
    files = {f"/data/train-{i}.tar": labelled_shard(4 * i, 2) for i in range(3)}
    server = StaticServer(files)
    yield f"{server.url}/data"
    server.close()


def test_download_proves_its_bucket_whole(val_proxy: FakeProxy, origin: str) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    job = download(ais, "wds-etl-val", "dl", f"{origin}/train-{{0..2}}.tar", timeout=60)
    assert job.success and job.verified == 3
    links = {f"copy/{i}.tar": f"{origin}/train-{i}.tar" for i in range(3)} | {"copy/404.tar": f"{origin}/no"}
    job = download(ais, "wds-etl-val", "dl", links, timeout=60)  # the 404 is among the job's errors
    assert job.verified == 3 and [name for name, _ in job.object_errors] == ["copy/404.tar"]
    val_proxy.drops.add("train-1.tar")
    val_proxy.cuts["train-2.tar"] = 1024
    job = download(ais, "wds-etl-val", "dl-2", [f"{origin}/train-{i}.tar" for i in range(3)], wait=False)
    with pytest.raises(IncompleteCopy) as failure:
        wait_download(ais, job, timeout=60)
    error = failure.value
    assert error.missing == ["train-1.tar"] and list(error.cut) == ["train-2.tar"]
    assert f"train-1.tar (from {origin}/train-1.tar)" in str(error)
    assert "it reports the download as finished" in str(error) and error.job.verified == 1


def test_a_list_handed_to_a_job_being_aborted_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """AIS may hand a new list to the job it is aborting (the same id comes back, already ended): the list is sent
    again once that job is gone, never waited on."""
    from transformer.client import jobs

    waited: list[str] = []
    monkeypatch.setattr(jobs, "_end_stale_list_jobs", lambda *args: {"tco-old"})
    monkeypatch.setattr(jobs, "_wait_gone", lambda client, job_id: waited.append(job_id))
    answers = iter(["tco-old", "tco-old", "tco-new"])
    assert jobs.start_list_job(None, "wds-etl-val", "src", "dst", lambda: next(answers)) == "tco-new"
    assert waited == ["tco-old", "tco-old"]
    with pytest.raises(ClientError, match="AIS gave the list to job tco-old, aborted because it started before ETL "
                                          "'wds-etl-val' was last started, 4 times"):
        jobs.start_list_job(None, "wds-etl-val", "src", "dst", lambda: "tco-old")


def test_a_list_job_from_before_the_etls_start_is_waited_out_and_aborted_only_when_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformer.client import jobs

    class Jobs:
        def __init__(self, job_id: str, job_kind: str = ""):
            self.job_id = job_id

        def abort(self) -> None:
            aborted.append(self.job_id)

    class Client:
        job = Jobs

    aborted: list[str] = []
    monkeypatch.setattr(jobs.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(jobs, "_wait_gone", lambda client, job_id: None)
    answers = iter([{"tco-old"}, {"tco-old"}, set()])  # idle, it ends by itself on the third look
    monkeypatch.setattr(jobs, "_stale_list_jobs", lambda *args: next(answers))
    assert jobs._end_stale_list_jobs(Client(), "wds-etl-val", "src", "dst") == set() and aborted == []
    monkeypatch.setattr(jobs, "_stale_list_jobs", lambda *args: {"tco-busy"})  # never ends: aborted at last
    assert jobs._end_stale_list_jobs(Client(), "wds-etl-val", "src", "dst", patience=0.0) == {"tco-busy"}
    assert aborted == ["tco-busy"]
