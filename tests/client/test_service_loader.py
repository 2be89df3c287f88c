"""End to end: shards in a (fake) AIS bucket -> the real transformer service -> make_loader -> batches.

URLs come from the SDK (``shard_urls``) and hit the fake proxy, which redirects through a "target" to
the service exactly as AIS does for an ``hpull://`` ETL (ext/etl/communicator.go); ``pod_urls``
builds the same redirect target directly. Every sample must arrive exactly once per epoch, with its
label and its own photo.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from testbed.fake_proxy import FakeProxy
from transformer.client import CudaPrefetcher, EpochUrls, EtlSettings, make_loader, register, shard_urls
from transformer.client.urls import get_etl_args, pod_urls

from .conftest import SMALL, labelled_shard

if TYPE_CHECKING:
    from testbed.service import Service

PER_SHARD = 4
KEYS = ("npy", "cls", "__key__")


def fill_bucket(proxy: FakeProxy, shards: int) -> str:
    bucket = "b" + uuid.uuid4().hex[:8]
    for s in range(shards):
        proxy.put_object(bucket, f"train/train-{s:03d}.tar", labelled_shard(s * PER_SHARD, PER_SHARD))
    return bucket


def registered(proxy: FakeProxy):
    from aistore.sdk import Client

    client = Client(proxy.url, timeout=(2, 60))
    register(client, "wds-etl", EtlSettings(image="registry.local/ais-wds-transformer:0.1.0", comm_type="hpull"))
    return client


def check_epoch(loader, total: int) -> dict[int, np.ndarray]:
    """Every label 0..total-1 once, keyed right; one image per photo (samples i and i+4 share photo i % 4)."""
    images: dict[int, np.ndarray] = {}
    for batch, labels, keys in loader:
        assert batch.dtype == torch.uint8 and batch.shape[1:] == (3, 32, 32)
        for image, label, key in zip(batch.numpy(), labels.tolist(), keys):
            assert key == f"sample-{label:05d}" and label not in images
            images[label] = image
    assert sorted(images) == list(range(total))
    for label, image in images.items():
        same_photo = images[label % 4]
        assert np.array_equal(image, same_photo)
        assert not np.array_equal(image, images[(label + 1) % 4])
    return images


@pytest.mark.parametrize(("workers", "shards"), [(0, 1), (2, 3), (3, 2), (2, 5)])
def test_loader_reads_every_sample_once_through_the_service(served_proxy: FakeProxy, workers: int,
                                                            shards: int) -> None:
    bucket = fill_bucket(served_proxy, shards)
    client = registered(served_proxy)
    urls = shard_urls(client, bucket, "wds-etl", prefix="train/", etl_args=SMALL)
    loader = make_loader(urls, 3, keys=KEYS, num_workers=workers, shuffle_buffer=4, seed=5)
    for _ in range(2):
        check_epoch(loader, shards * PER_SHARD)
    assert loader.errors.count == 0
    redirected = served_proxy.calls("GET", "/_target/v1/objects/")
    assert len(redirected) == 2 * shards  # each shard once per epoch, through the proxy -> target redirect
    assert all(r.query["etl_name"] == ["wds-etl"] and json.loads(r.query["etl_args"][0]) == SMALL
               for r in redirected)


def test_epoch_urls_give_new_draws_per_epoch_and_repeat_with_the_seed(served_proxy: FakeProxy) -> None:
    bucket = fill_bucket(served_proxy, 2)
    client = registered(served_proxy)
    args = {"transforms": [{"RandomResizedCrop": {"size": 32, "antialias": True}}], "dtype": "uint8"}
    urls = EpochUrls(tuple(shard_urls(client, bucket, "wds-etl", prefix="train/")), args, seed=11)
    assert get_etl_args(urls(3)[0]) == {**args, "seed": 11, "epoch": 3}

    def epoch(number: int) -> dict[int, bytes]:
        loader = make_loader(urls, 8, keys=KEYS, num_workers=1, epoch=number)
        return {int(label): image.numpy().tobytes()
                for batch, labels, _ in loader for image, label in zip(batch, labels)}

    first, again, second = epoch(0), epoch(0), epoch(1)
    assert sorted(first) == sorted(second) == list(range(8))
    assert first == again  # same seed, same epoch: the same crops
    assert all(first[label] != second[label] for label in first)  # a new epoch: new crops


def test_failed_samples_are_skipped_by_the_service_and_the_manifest_is_invisible(
        served_proxy: FakeProxy, service: Service) -> None:
    bucket = fill_bucket(served_proxy, 1)
    from testbed.shardgen import make_tar, read_tar

    members = read_tar(served_proxy.fqn(bucket, "train/train-000.tar").read_bytes())
    members[2] = ("sample-00001.jpg", b"\xff\xd8 not really a jpeg")
    served_proxy.put_object(bucket, "train/train-000.tar", make_tar(members))
    urls = pod_urls(service.url, bucket, ["train/train-000.tar"], etl_args=SMALL, mountpath=str(served_proxy.mountpath))
    loader = make_loader(urls, 8, keys=KEYS, num_workers=0)
    labels = sorted(label for _, batch_labels, _ in loader for label in batch_labels.tolist())
    assert labels == [0, 2, 3]  # sample 1 skipped by the service (on_error=skip), noted in __etl__/errors.json
    assert loader.errors.count == 0  # webdataset skips the __etl__/ manifest: nothing to count

    failing = pod_urls(service.url, bucket, ["train/train-000.tar"], etl_args={**SMALL, "on_error": "fail"},
                       mountpath=str(served_proxy.mountpath))
    loader = make_loader(failing, 8, keys=KEYS, num_workers=0)
    delivered = [label for _, batch_labels, _ in loader for label in batch_labels.tolist()]
    assert 1 not in delivered
    assert loader.errors.count >= 1  # the 422 (or the aborted stream) was counted, not raised


def test_prefetcher_normalizes_uint8_batches_from_the_service(served_proxy: FakeProxy, service: Service) -> None:
    bucket = fill_bucket(served_proxy, 2)
    # The same spec for both: with dtype=uint8 the service leaves Normalize to the client.
    normalized = {"transforms": SMALL["transforms"] + [{"Normalize": {"mean": [0.485, 0.456, 0.406],
                                                                       "std": [0.229, 0.224, 0.225]}}]}
    names = ["train/train-000.tar", "train/train-001.tar"]
    urls = pod_urls(service.url, bucket, names, etl_args={**normalized, "dtype": "uint8"},
                    mountpath=str(served_proxy.mountpath))
    float_urls = pod_urls(service.url, bucket, names, etl_args={**normalized, "dtype": "float32"},
                          mountpath=str(served_proxy.mountpath))
    prefetched = {}
    for images, labels, _ in CudaPrefetcher(make_loader(urls, 4, keys=KEYS, num_workers=1)):
        prefetched.update(zip(labels.tolist(), images.cpu()))
    served = {}
    for images, labels, _ in make_loader(float_urls, 4, keys=KEYS, num_workers=1):
        served.update(zip(labels.tolist(), images))
    assert sorted(prefetched) == sorted(served) == list(range(8))
    for label, image in prefetched.items():
        assert image.dtype == torch.float32
        # uint8 over the wire + normalize on the device == the service's own float32 normalization
        torch.testing.assert_close(image, served[label], atol=1e-5, rtol=1e-5)


def test_converted_pets_load_with_their_trimaps(served_proxy: FakeProxy, tmp_path) -> None:
    from transformer.client import convert

    from .test_convert import make_pets

    complete = make_pets(tmp_path / "pets")
    client = registered(served_proxy)
    bucket = "p" + uuid.uuid4().hex[:8]
    report = convert(tmp_path / "pets", layout="pets", bucket=client.bucket(bucket).create(), prefix="pets/",
                     max_samples=3, progress=False)
    urls = shard_urls(client, bucket, "wds-etl", prefix="pets/", etl_args=SMALL)
    loader = make_loader(urls, 4, keys=("image.npy", "cls", "trimap.npy", "__key__"), num_workers=2)
    seen = {}
    for images, labels, trimaps, keys in loader:
        assert images.shape[1:] == (3, 32, 32) and trimaps.shape[1:] == (32, 32)
        assert trimaps.dtype == torch.uint8 and set(trimaps.unique().tolist()) <= {1, 2, 3}
        seen.update(zip(keys, labels.tolist()))
    assert seen == complete and report.samples == len(complete)
