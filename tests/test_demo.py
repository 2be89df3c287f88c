"""The embedded demo dataset: real photographs, ImageNet-like sizes, deterministic, webdataset-readable."""

from __future__ import annotations

import io
import json

import numpy as np
import webdataset as wds
from PIL import Image

from tests.shardgen import read_tar
from transformer.demo import make_sample, make_shards, photographs


def test_demo_uses_bundled_photographs_as_classes():
    names = [p.name for p in photographs()]
    assert len(names) >= 6 and "cat" in names and "astronaut" in names


def test_demo_shards_are_imagenet_like(tmp_path):
    paths = make_shards(tmp_path, shards=2, samples=16, seed=1, progress=False)
    assert [p.name for p in paths] == ["demo-000000.tar", "demo-000001.tar"]
    members = read_tar(paths[0].read_bytes())
    names = [n for n, _ in members]
    assert names[:3] == ["sample-000000.cls", "sample-000000.jpg", "sample-000000.json"]
    jpegs = [data for name, data in members if name.endswith(".jpg")]
    assert len(jpegs) == 16
    sizes = [len(j) for j in jpegs]
    assert 60_000 < np.mean(sizes) < 160_000, np.mean(sizes)
    for data in jpegs:
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert max(image.size) == 500 and min(image.size) >= 333
    second = read_tar(paths[1].read_bytes())
    assert second[0][0].startswith("sample-000016.")  # keys continue across shards


def test_demo_labels_follow_the_source_photograph(tmp_path):
    (path,) = make_shards(tmp_path, shards=1, samples=len(photographs()) * 2, seed=0, progress=False)
    dataset = wds.WebDataset(str(path), shardshuffle=False).decode().to_tuple("cls", "json")
    for label, meta in dataset:
        assert photographs()[label].name == meta["source"]


def test_demo_is_deterministic_for_a_seed(tmp_path):
    a = make_shards(tmp_path / "a", shards=1, samples=4, seed=7, progress=False)[0].read_bytes()
    b = make_shards(tmp_path / "b", shards=1, samples=4, seed=7, progress=False)[0].read_bytes()
    c = make_shards(tmp_path / "c", shards=1, samples=4, seed=8, progress=False)[0].read_bytes()
    assert a == b and a != c


def test_demo_masks_are_oxford_pet_like():
    sample = make_sample(3, 0, masks=True)
    assert set(sample) >= {"__key__", "image.jpg", "trimap.png", "cls", "json"}
    with Image.open(io.BytesIO(sample["trimap.png"])) as mask, Image.open(io.BytesIO(sample["image.jpg"])) as image:
        assert mask.size == image.size
        assert set(np.unique(np.asarray(mask))) == {1, 2, 3}
    assert json.dumps(sample["json"])  # metadata is JSON-serialisable
