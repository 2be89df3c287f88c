"""A reader can always tell a whole shard from a cut one, and a cut read continues where it stopped.

The cuts are the ones AIS 5.0 delivers: its target sends the pod's status line first, then copies the
pod's body; a pod that fails after that reaches the reader as a cleanly terminated chunked ``200``
holding part of the tar, with the target's JSON error after it (``FakeProxy._relay`` does the same).
The first tests serve such bytes directly; the last ones go through the real service and the relay.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from typing import TYPE_CHECKING

import numpy as np
import pytest
import webdataset as wds

from testbed.fake_proxy import FakeProxy
from testbed.shardgen import make_tar, read_tar
from transformer.client import ClientError, ErrorCounter, IncompleteShard, make_loader, shard_urls
from transformer.client.dali import EtlBatchSource
from transformer.client.reading import tarfile_to_whole_samples
from transformer.wire import END_MARKER_NAME

from .conftest import SAMPLES, SMALL, labelled_shard
from .test_service_loader import fill_bucket

if TYPE_CHECKING:
    from testbed.service import Service

KEYS = ("npy", "cls", "__key__")
TARGET_ERROR = json.dumps({"message": "ETL wds-etl: failed to copy the transformed object: unexpected EOF",
                           "method": "GET", "url_path": "/v1/objects/b/s.tar", "status": 500}).encode()


def members_of(shard: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(shard)) as archive:
        return archive.getmembers()


def cuts(shard: bytes) -> list[tuple[str, int]]:
    """Every member boundary (a sample boundary among them), and a point inside each member's header
    and data, up to and including the end marker."""
    points = []
    for info in members_of(shard):
        points.append((f"before {info.name}", info.offset))
        points.append((f"inside the header of {info.name}", info.offset + 100))
        points.append((f"inside {info.name}", info.offset_data + max(1, info.size // 2)))
    return points


def read_all(urls: list[str], **kwargs) -> tuple[list[str], ErrorCounter]:
    errors = ErrorCounter(log_first=0)
    loader = make_loader(urls, 4, keys=KEYS, num_workers=0, shuffle_shards=False, shuffle_buffer=0,
                         errors=errors, **kwargs)
    return [key for _, _, keys in loader for key in keys], errors


def test_the_service_ends_every_shard_with_a_marker_the_reader_accepts(pod_whole: bytes, served) -> None:
    infos = members_of(pod_whole)
    assert infos[-1].name == END_MARKER_NAME
    with tarfile.open(fileobj=io.BytesIO(pod_whole)) as archive:
        marker = json.loads(archive.extractfile(infos[-1]).read())
    assert marker["samples_in"] == marker["samples_out"] == SAMPLES and marker["skipped"] == 0
    assert marker["members"] == len(infos) - 1 and marker["bytes"] == infos[-1].offset
    server = served({"/s.tar": [pod_whole]})
    keys, errors = read_all([server.url + "/s.tar"])
    assert keys == [f"sample-{i:05d}" for i in range(SAMPLES)] and errors.count == 0


def test_the_written_whole_shard_is_laid_out_as_the_services(whole: bytes, pod_whole: bytes) -> None:
    """The shard the other tests cut (written here) has the service's members at the service's offsets,
    and the same end marker: a cut at an offset of one is a cut at the same place in the other."""
    def layout(shard: bytes) -> list[tuple]:
        return [(info.name, info.offset, info.offset_data, info.size, info.type) for info in members_of(shard)]

    assert layout(whole) == layout(pod_whole) and len(whole) == len(pod_whole)
    mine, pods = dict(read_tar(whole)), dict(read_tar(pod_whole))
    for name in mine:
        if name.endswith(".npy"):  # the same array header: only the pixels differ
            assert mine[name][:mine[name].index(b"\n") + 1] == pods[name][:pods[name].index(b"\n") + 1], name
        else:
            assert mine[name] == pods[name], name
    with tarfile.open(fileobj=io.BytesIO(whole)) as archive, tarfile.open(fileobj=io.BytesIO(pod_whole)) as pod:
        assert archive.extractfile(END_MARKER_NAME).read() == pod.extractfile(END_MARKER_NAME).read()


def test_stock_webdataset_reads_a_relayed_cut_as_a_shorter_shard(whole: bytes, served) -> None:
    """Why the marker exists: the fake's relay reproduces what webdataset alone would not notice."""
    third = members_of(whole)[2 * 3]  # the first member of the fourth sample
    server = served({"/s.tar": [whole[:third.offset] + TARGET_ERROR]})
    pipeline = wds.DataPipeline(wds.SimpleShardList([server.url + "/s.tar"]), wds.tarfile_to_samples())
    assert len(list(pipeline)) == 3  # no error: half the shard is gone without a trace


@pytest.mark.parametrize("target_error", [False, True], ids=["clean-end", "json-error-after"])
def test_a_cut_anywhere_is_an_error_naming_the_shard(whole: bytes, served, target_error: bool) -> None:
    points = cuts(whole)
    bodies = {f"/cut-{i}.tar": [whole[:offset] + (TARGET_ERROR if target_error else b"")]
              for i, (_, offset) in enumerate(points)}
    server = served(bodies)
    for i, (where, _) in enumerate(points):
        url = f"{server.url}/cut-{i}.tar"
        keys, errors = read_all([url], retries=0)
        assert errors.count == 1, where
        assert len(keys) < SAMPLES or where.endswith(END_MARKER_NAME), where
        with pytest.raises(ClientError, match=f"shard '{url}': incomplete, {len(keys)} samples received"):
            _strict(url)


def _strict(url: str) -> None:
    loader = make_loader([url], 4, keys=KEYS, num_workers=0, shuffle_shards=False, shuffle_buffer=0, retries=0,
                         errors=ErrorCounter(log_first=0, max_errors=0))
    for _ in loader:
        pass


def test_a_valid_tar_without_the_marker_is_reported(whole: bytes, served) -> None:
    unmarked = make_tar(read_tar(whole))  # every sample, a proper end-of-archive: only the marker is gone
    server = served({"/s.tar": [unmarked]})
    keys, errors = read_all([server.url + "/s.tar"])
    assert len(keys) == SAMPLES and errors.count == 1
    with pytest.raises(ClientError, match="no end marker"):
        _strict(server.url + "/s.tar")
    keys, errors = read_all([server.url + "/s.tar"], require_marker=False)  # a shard not written by the ETL
    assert len(keys) == SAMPLES and errors.count == 0


def test_a_marker_that_does_not_match_is_reported(whole: bytes, served) -> None:
    infos = members_of(whole)
    forged = whole[infos[2].offset:]  # the first sample dropped, the marker kept
    server = served({"/s.tar": [forged]})
    with pytest.raises(ClientError, match="the end marker counts"):
        _strict(server.url + "/s.tar")


@pytest.mark.parametrize("target_error", [False, True], ids=["clean-end", "json-error-after"])
def test_a_cut_read_is_read_again_and_continued_once(whole: bytes, served, target_error: bool) -> None:
    tail = TARGET_ERROR if target_error else b""
    points = [offset for _, offset in cuts(whole)]
    server = served({f"/s-{i}.tar": [whole[:offset] + tail, whole] for i, offset in enumerate(points)})
    for i in range(len(points)):
        keys, errors = read_all([f"{server.url}/s-{i}.tar"])
        assert keys == [f"sample-{k:05d}" for k in range(SAMPLES)], points[i]  # each once, in order
        assert errors.count == 0 and server.hits[f"/s-{i}.tar"] == 2


def test_a_shard_still_cut_after_the_retries_is_one_error(whole: bytes, served) -> None:
    cut = whole[:members_of(whole)[5].offset] + TARGET_ERROR
    server = served({"/s.tar": [cut]})
    keys, errors = read_all([server.url + "/s.tar"], retries=2)
    assert len(keys) == 2 and errors.count == 1 and server.hits["/s.tar"] == 3
    with pytest.raises(ClientError, match=r"incomplete, 2 samples received: .*read 3 times"):
        loader = make_loader([server.url + "/s.tar"], 4, keys=KEYS, num_workers=0, retries=2,
                             errors=ErrorCounter(log_first=0, max_errors=0))
        list(loader)


def test_a_read_again_that_differs_is_refused(whole: bytes, served) -> None:
    other = make_tar([(name.replace("sample-", "other-"), data) for name, data in read_tar(whole)])
    cut = whole[:members_of(whole)[4].offset]
    server = served({"/s.tar": [cut, other]})
    with pytest.raises(ClientError, match="read again after a cut, sample 0 is 'other-00000', not 'sample-00000'"):
        loader = make_loader([server.url + "/s.tar"], 4, keys=KEYS, num_workers=0,
                             errors=ErrorCounter(log_first=0, max_errors=0))
        list(loader)


def test_the_webdataset_stage_and_the_dali_source_check_too(whole: bytes, served) -> None:
    cut = whole[:members_of(whole)[6].offset] + TARGET_ERROR
    server = served({"/whole.tar": [whole], "/cut.tar": [cut]})
    urls = [server.url + "/whole.tar", server.url + "/cut.tar"]
    failures: list[BaseException] = []
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls),
                                tarfile_to_whole_samples(handler=lambda exc: failures.append(exc) or True,
                                                         retries=0))
    # The cut falls before sample 3's first member: sample 2 may have had more members, so it is held back.
    assert len(list(pipeline)) == SAMPLES + 2
    assert len(failures) == 1 and isinstance(failures[0], IncompleteShard) and failures[0].samples == 2
    with pytest.raises(IncompleteShard, match="/cut.tar"):  # the default handler raises
        list(wds.DataPipeline(wds.SimpleShardList(urls[1:]), tarfile_to_whole_samples(retries=0)))

    errors = ErrorCounter(log_first=0)
    source = EtlBatchSource(urls, 4, keys=("npy", "cls"), errors=errors, retries=0)
    assert sum(len(labels) for _, labels in source) == SAMPLES + 2 and errors.count == 1


# ---- through the real service and the fake target's relay (hpush) ------------------------------------


def hpush_urls(proxy: FakeProxy, bucket: str, etl_args, comm: str = "hpush") -> list[str]:
    from aistore.sdk import Client

    from transformer.client import EtlSettings, register

    client = Client(proxy.url, timeout=(2, 60))
    register(client, "wds-etl", EtlSettings(image="registry.local/ais-wds-transformer:0.1.0", comm_type=comm),
             replace=True)
    return shard_urls(client, bucket, "wds-etl", prefix="train/", etl_args=etl_args)


RANDOM = {"transforms": [{"RandomResizedCrop": {"size": 32, "antialias": True}}, {"RandomHorizontalFlip": {}}],
          "dtype": "uint8"}


def epoch_images(urls: list[str], **kwargs) -> tuple[dict[str, np.ndarray], ErrorCounter]:
    errors = ErrorCounter(log_first=0)
    images: dict[str, np.ndarray] = {}
    loader = make_loader(urls, 3, keys=KEYS, num_workers=0, shuffle_buffer=0, errors=errors, **kwargs)
    for batch, _, keys in loader:
        for image, key in zip(batch.numpy(), keys):
            assert key not in images, key  # never twice
            images[key] = image
    return images, errors


def test_through_the_relay_a_cut_shard_with_a_seed_gives_the_uninterrupted_epoch(served_proxy: FakeProxy) -> None:
    bucket = fill_bucket(served_proxy, 2)
    urls = hpush_urls(served_proxy, bucket, {**RANDOM, "seed": 3, "epoch": 0})
    uninterrupted, errors = epoch_images(urls)
    assert len(uninterrupted) == 8 and errors.count == 0
    assert served_proxy.calls("GET", "/_target/v1/objects/")  # read through the relay
    served_proxy.relay_cuts["train/train-001.tar"] = 2 * 3072 + 1500  # the pod's body breaks once, mid-sample
    cut, errors = epoch_images(urls)
    assert not served_proxy.relay_cuts  # the cut happened
    assert errors.count == 0 and sorted(cut) == sorted(uninterrupted)
    for key, image in uninterrupted.items():
        assert np.array_equal(cut[key], image), key  # the same crops, bit for bit


def test_through_the_relay_a_cut_shard_without_a_seed_still_gives_each_sample_once(
        served_proxy: FakeProxy) -> None:
    bucket = fill_bucket(served_proxy, 2)
    urls = hpush_urls(served_proxy, bucket, RANDOM)
    served_proxy.relay_cuts["train/train-000.tar"] = 3 * 3072
    images, errors = epoch_images(urls)
    assert not served_proxy.relay_cuts
    assert errors.count == 0 and sorted(images) == [f"sample-{i:05d}" for i in range(8)]


@pytest.mark.parametrize("comm", ["hpush", "hpull"])
def test_a_pod_failing_mid_shard_is_counted_not_lost(served_proxy: FakeProxy, service: Service, comm: str) -> None:
    """hpush: through the relay (a clean 200 with the target's error); hpull: redirected to the pod (a
    broken chunked body)."""
    bucket = "b" + uuid.uuid4().hex[:8]
    members = read_tar(labelled_shard(0, 60, size=(32, 24)))
    members[2 * 50] = ("sample-00050.jpg", b"\xff\xd8 not really a jpeg")  # fails under on_error=fail
    served_proxy.put_object(bucket, "train/train-000.tar", make_tar(members))
    urls = hpush_urls(served_proxy, bucket, {**SMALL, "on_error": "fail"}, comm)
    keys, errors = read_all(urls)
    # The pod fails at sample 50 on every read, after its first 64 KB went out (about 20 samples):
    # those arrive once, and the shard is one error.
    assert 0 < len(keys) < 50 and keys == [f"sample-{i:05d}" for i in range(len(keys))]
    assert errors.count == 1
    with pytest.raises(ClientError, match=rf"train-000\.tar.*incomplete, {len(keys)} samples received: .*read 3 times"):
        list(make_loader(urls, 4, keys=KEYS, num_workers=0, errors=ErrorCounter(log_first=0, max_errors=0)))
