"""The embedded demo dataset: real photographs, ImageNet-like JPEGs, deterministic, webdataset-readable."""

from __future__ import annotations

import io
import json
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from testbed.shardgen import read_tar
from transformer.cli import main
from transformer.demo import CLASSES, PHOTOGRAPHS, _photo, make_sample, make_shards
from transformer.errors import TransformerError


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    """48 samples of seed 0: enough for every class, both orientations and a stable mean size."""
    return [make_sample(i, 0) for i in range(48)]


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def meta(sample: dict) -> dict:
    return json.loads(sample["json"])


def test_every_class_is_a_photograph_shipped_in_an_installed_wheel() -> None:
    assert len(CLASSES) == len(set(CLASSES)) >= 6
    for photo in PHOTOGRAPHS:
        assert resources.files(photo.package).joinpath(photo.file).is_file(), photo.file
        width, height = _photo(photo, 1).size
        assert min(width, height) >= 300  # a real photograph, not an icon
        xs, ys = zip(*photo.subject)
        assert min(xs) >= -1 and max(xs) <= width + 1 and min(ys) >= -1 and max(ys) <= height + 1, photo.name


def test_shards_are_named_and_keys_run_on_across_shards(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, shards=2, samples=3, seed=0, progress=False)
    assert paths == [tmp_path / "demo-000000.tar", tmp_path / "demo-000001.tar"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-000000.tar", "demo-000001.tar"]  # no .partial
    names = [name for path in paths for name, _ in read_tar(path.read_bytes())]
    keys = [f"sample-{i:06d}" for i in range(6)]
    assert names == [f"{key}.{ext}" for key in keys for ext in ("cls", "jpg", "json")]
    assert all(re.fullmatch(r"sample-\d{6}", name.split(".")[0]) for name in names)  # no dot inside a key
    assert names[9] == "sample-000003.cls"  # the second shard starts where the first ended


def test_the_same_seed_gives_byte_identical_shards(tmp_path: Path) -> None:
    first = make_shards(tmp_path / "a", shards=1, samples=3, seed=7, progress=False)[0].read_bytes()
    again = make_shards(tmp_path / "b", shards=1, samples=3, seed=7, progress=False)[0].read_bytes()
    other = make_shards(tmp_path / "c", shards=1, samples=3, seed=8, progress=False)[0].read_bytes()
    assert first == again
    assert first != other


def test_a_sample_does_not_depend_on_how_the_dataset_is_sharded(tmp_path: Path) -> None:
    (one,) = make_shards(tmp_path / "one", shards=1, samples=4, seed=3, progress=False)
    two = make_shards(tmp_path / "two", shards=2, samples=2, seed=3, progress=False)
    assert read_tar(one.read_bytes()) == [m for path in two for m in read_tar(path.read_bytes())]


def test_samples_are_distinct_imagenet_sized_jpegs_of_about_100_kb(samples: list[dict]) -> None:
    shapes = set()
    for sample in samples:
        image = decoded(sample["jpg"])
        assert image.format == "JPEG"
        assert image.mode == ("L" if meta(sample)["source"] == "cameraman" else "RGB")
        assert max(image.size) == 500 and 320 <= min(image.size) <= 400, image.size
        assert list(image.size) == meta(sample)["size"]
        shapes.add("landscape" if image.width > image.height else "portrait")
    assert shapes == {"landscape", "portrait"}
    sizes = [len(sample["jpg"]) for sample in samples]
    assert 70_000 <= np.mean(sizes) <= 130_000, np.mean(sizes)
    assert len(set(map(bytes, (s["jpg"] for s in samples)))) == len(samples)  # every sample is its own image


def test_two_samples_of_one_class_are_different_views(samples: list[dict]) -> None:
    by_class: dict[str, list[dict]] = {}
    for sample in samples:
        by_class.setdefault(meta(sample)["source"], []).append(sample)
    first, second = next(group for group in by_class.values() if len(group) >= 2)[:2]
    assert (meta(first)["box"], meta(first)["angle"]) != (meta(second)["box"], meta(second)["angle"])


def test_labels_and_metadata_name_the_source_photograph(samples: list[dict]) -> None:
    assert {meta(s)["source"] for s in samples} == set(CLASSES)  # 48 draws cover all classes
    for sample in samples:
        info = meta(sample)
        label = int(sample["cls"])
        assert CLASSES[label] == info["source"] and info["class"] == label
        width, height = _photo(PHOTOGRAPHS[label], 1).size
        left, top, right, bottom = info["box"]
        assert -1 <= left < right <= width + 1 and -1 <= top < bottom <= height + 1, (info, width, height)
        assert abs(info["angle"]) <= 8 and isinstance(info["flip"], bool)
    assert len(sample["json"]) < 300  # a small member


def test_shards_read_back_with_webdataset(tmp_path: Path) -> None:
    (path,) = make_shards(tmp_path, shards=1, samples=4, seed=1, progress=False)
    dataset = wds.WebDataset(str(path), shardshuffle=False).decode("pil").to_tuple("__key__", "jpg", "cls", "json")
    rows = list(dataset)
    assert [key for key, *_ in rows] == [f"sample-{i:06d}" for i in range(4)]
    for _, image, label, info in rows:
        assert isinstance(label, int) and CLASSES[label] == info["source"]
        assert image.size == tuple(info["size"])


def test_pet_like_samples_carry_a_trimap_with_the_image_geometry() -> None:
    # The retina's outline is its disc, so the trimap must separate bright retina from black corners;
    # that holds only if the mask went through the same crop, rotation and flip as the image.
    retina = CLASSES.index("retina")
    checked = 0
    for index in range(400):
        sample = make_sample(index, 5, masks=True)
        assert {"image.jpg", "trimap.png", "cls", "json"} <= set(sample) and "jpg" not in sample
        if int(sample["cls"]) != retina:
            continue
        image = np.asarray(decoded(sample["image.jpg"]).convert("L"), dtype=np.float32)
        trimap = np.asarray(decoded(sample["trimap.png"]))
        assert trimap.shape == image.shape and set(np.unique(trimap)) <= {1, 2, 3}
        if (trimap == 2).sum() < 2000:
            continue  # the crop lies inside the disc: nothing to compare
        assert image[trimap == 1].mean() > 80 and image[trimap == 2].mean() < 40, meta(sample)
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_bad_counts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TransformerError, match="at least 1"):
        make_shards(tmp_path, shards=0, samples=10, seed=0, progress=False)
    with pytest.raises(TransformerError, match="at least 1"):
        make_shards(tmp_path, shards=1, samples=0, seed=0, progress=False)


def test_make_shards_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-shards", str(tmp_path), "--shards", "1", "--samples", "2", "--seed", "4", "--masks"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "demo-000000.tar")]
    names = [name for name, _ in read_tar((tmp_path / "demo-000000.tar").read_bytes())]
    assert names[:4] == ["sample-000000.cls", "sample-000000.image.jpg", "sample-000000.json",
                         "sample-000000.trimap.png"]


def test_demo_shards_can_be_written_into_an_ais_mountpath_folder(tmp_path):
    # AIS object paths contain "%ob"; the writer's name pattern must not choke on it.
    folder = tmp_path / "mp" / "@ais" / "bck" / "%ob"
    paths = make_shards(folder, shards=1, samples=2, seed=0, progress=False)
    assert paths == [folder / "demo-000000.tar"] and paths[0].stat().st_size > 0
