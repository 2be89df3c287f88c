"""convert: folder datasets -> WebDataset shards -> uploaded through the fake proxy; dSort shuffle."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from testbed.fake_proxy import FakeProxy
from testbed.shardgen import jpeg_bytes, make_tar, trimap_bytes
from transformer.client import ShuffleError, convert, shuffle_shards
from transformer.client.errors import ConvertError
from transformer.client.shuffle import dsort_framework

BREEDS = ["Abyssinian", "Bengal", "american_bulldog"]


def make_pets(root: Path, per_breed: int = 3) -> dict[str, int]:
    """An Oxford-IIIT Pet tree with its defects; returns the complete records' labels (name -> cls)."""
    (root / "images").mkdir(parents=True)
    (root / "annotations" / "trimaps").mkdir(parents=True)
    lines = ["#Image CLASS-ID SPECIES BREED ID", "#ID: 1:37 Class ids"]
    complete = {}
    for b, breed in enumerate(BREEDS):
        for i in range(1, per_breed + 1):
            name = f"{breed}_{i}"
            lines.append(f"{name} {b + 1} {1 + b % 2} {i}")
            (root / "images" / f"{name}.jpg").write_bytes(jpeg_bytes(b * per_breed + i, (40, 30)))
            (root / "annotations" / "trimaps" / f"{name}.png").write_bytes(trimap_bytes((40, 30)))
            complete[name] = b
    # Incomplete records: listed without an image, without a trimap, an unlisted image, a corrupt JPEG.
    lines.append("Bengal_99 2 1 99")
    (root / "annotations" / "trimaps" / "Abyssinian_1.png").unlink()
    del complete["Abyssinian_1"]
    (root / "images" / "Bengal_50.jpg").write_bytes(jpeg_bytes(0, (40, 30)))
    (root / "images" / "Bengal_2.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    del complete["Bengal_2"]
    (root / "annotations" / "list.txt").write_text("\n".join(lines) + "\n")
    return complete


def read_shard(data: bytes) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            key, _, ext = member.name.partition(".")
            samples.setdefault(key, {})[ext] = archive.extractfile(member).read()
    return samples


def test_pets_layout_uploads_complete_records_and_reports_the_rest(tmp_path: Path, ais, proxy: FakeProxy) -> None:
    root = tmp_path / "pets"
    complete = make_pets(root)
    report = convert(root, layout="pets", bucket=ais.bucket("pets").create(), prefix="raw/", max_samples=3,
                     progress=False)
    assert report.samples == len(complete) == 7
    assert report.shards == ["raw/shard-000000.tar", "raw/shard-000001.tar", "raw/shard-000002.tar"]
    assert proxy.objects("pets") == report.shards
    assert dict(report.skipped) == {
        "Bengal_2": "Bengal_2.jpg is not a readable image (OSError: Truncated File Read)",
        "Abyssinian_1": "annotations/trimaps/Abyssinian_1.png does not exist",
        "Bengal_50": "images/Bengal_50.jpg has no entry in list.txt",
        "Bengal_99": "images/Bengal_99.jpg listed in list.txt does not exist",
    }
    assert report.classes == {"Abyssinian": 0, "Bengal": 1, "american_bulldog": 2}
    samples = {}
    for name in report.shards:
        samples.update(read_shard(proxy.fqn("pets", name).read_bytes()))
    assert {k: int(v["cls"]) for k, v in samples.items()} == complete
    for key, members in samples.items():
        assert set(members) == {"image.jpg", "cls", "trimap.png"}
        assert members["image.jpg"] == (root / "images" / f"{key}.jpg").read_bytes()  # byte-exact
        assert members["trimap.png"] == (root / "annotations" / "trimaps" / f"{key}.png").read_bytes()
    puts = proxy.calls("PUT", "/v1/objects/pets/raw/")
    assert len(puts) == 3 and all(p.query["provider"] == ["ais"] for p in puts)  # then 307 to the target
    assert len(proxy.calls("PUT", "/_target/v1/objects/pets/raw/")) == 3


def test_shard_limits(tmp_path: Path) -> None:
    root = tmp_path / "pets"
    make_pets(root, per_breed=4)  # 10 complete records
    out = tmp_path / "out"
    report = convert(root, layout="pets", output_dir=out, max_samples=2, max_shards=3, progress=False)
    assert report.samples == 6 and report.not_written == 4
    assert [Path(p).name for p in report.shards] == [f"shard-00000{i}.tar" for i in range(3)]
    assert sorted(p.name for p in out.iterdir()) == [Path(p).name for p in report.shards]
    sized = convert(root, layout="pets", output_dir=tmp_path / "@ais" / "b" / "%ob", max_bytes=1, progress=False)
    assert Path(sized.shards[0]) == tmp_path / "@ais" / "b" / "%ob" / "shard-000000.tar"  # '%' in the folder
    assert len(sized.shards) == sized.samples == 10  # max_bytes reached after every sample


def test_labels_layout_numbers_text_labels(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    (root / "a").mkdir(parents=True)
    for name in ("a/cat.1.jpg", "a/dog.jpg", "b.png", "unlabelled.jpg"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(jpeg_bytes(len(name), (20, 20)))
    labels = tmp_path / "labels.txt"
    labels.write_text("# path label\na/cat.1.jpg cat\na/dog.jpg,dog\nb.png\tcat\nmissing.jpg dog\n")
    report = convert(root, layout="labels", labels_file=labels, output_dir=tmp_path / "out", progress=False)
    assert report.classes == {"cat": 0, "dog": 1}
    samples = read_shard(Path(report.shards[0]).read_bytes())
    assert {k: (sorted(v), int(v["cls"])) for k, v in samples.items()} == {
        "a_cat_1": (["cls", "jpg"], 0), "a_dog": (["cls", "jpg"], 1), "b": (["cls", "png"], 0)}
    assert sorted(key for key, _ in report.skipped) == ["missing", "unlabelled"]


def test_labels_layout_reads_tab_separated_paths_and_labels_with_spaces(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    (root / "my pics").mkdir(parents=True)
    for name in ("my pics/a b.jpg", "my pics/c,d.jpg"):
        (root / name).write_bytes(jpeg_bytes(len(name), (20, 20)))
    labels = tmp_path / "labels.tsv"
    labels.write_text("my pics/a b.jpg\tgolden retriever\nmy pics/c,d.jpg\t tabby cat \n")
    report = convert(root, layout="labels", labels_file=labels, output_dir=tmp_path / "out", progress=False)
    assert report.classes == {"golden retriever": 0, "tabby cat": 1} and not report.skipped
    samples = read_shard(Path(report.shards[0]).read_bytes())
    assert {k: int(v["cls"]) for k, v in samples.items()} == {"my pics_a b": 0, "my pics_c,d": 1}
    labels.write_text("my pics/a b.jpg\t\n")
    with pytest.raises(ConvertError, match=r"labels.tsv:1: expected '<image path> <label>'"):
        convert(root, layout="labels", labels_file=labels, output_dir=tmp_path / "out2", progress=False)


def test_folders_layout(tmp_path: Path) -> None:
    for cls in ("zebra", "ant"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(2):
            (tmp_path / "data" / cls / f"{i}.jpeg").write_bytes(jpeg_bytes(i, (20, 20)))
    report = convert(tmp_path / "data", layout="folders", output_dir=tmp_path / "out", progress=False)
    samples = read_shard(Path(report.shards[0]).read_bytes())
    assert report.classes == {"ant": 0, "zebra": 1}
    assert {k: int(v["cls"]) for k, v in samples.items()} == {"ant_0": 0, "ant_1": 0, "zebra_0": 1, "zebra_1": 1}
    assert all(set(v) == {"jpg", "cls"} for v in samples.values())


def test_convert_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="unknown layout"):
        convert(tmp_path, layout="coco", output_dir=tmp_path)
    with pytest.raises(ConvertError, match="not the Oxford-IIIT Pet layout"):
        convert(tmp_path, layout="pets", output_dir=tmp_path)
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ConvertError, match="no complete record"):
        convert(tmp_path / "empty", layout="folders", output_dir=tmp_path / "out", progress=False)


def test_dsort_shuffle_keeps_records_whole(tmp_path: Path, ais, proxy: FakeProxy) -> None:
    root = tmp_path / "pets"
    make_pets(root, per_breed=5)
    bucket = ais.bucket("pets").create()
    report = convert(root, layout="pets", bucket=bucket, prefix="samples-", pattern="%02d.tar", max_samples=5,
                     progress=False)
    assert report.shards == ["samples-00.tar", "samples-01.tar", "samples-02.tar"]
    result = shuffle_shards(ais, "pets", "samples-{00..02}", "shuffled-{0000..0099}", output_shard_size="40KB",
                            seed=7, timeout=20)
    assert result.shards and all(name.startswith("shuffled-") for name in result.shards)
    (start,) = proxy.calls("POST", "/v1/sort")
    assert start.body == dsort_framework("pets", "samples-{00..02}", "shuffled-{0000..0099}",
                                         output_shard_size="40KB", seed=7).to_spec()
    assert start.body["algorithm"] == {"kind": "shuffle", "decreasing": False, "seed": "7"}
    assert start.body["dsorter_type"] == "dsort_general"  # AIS 5.0 cannot pick one itself (see shuffle.py)
    assert start.body["input_format"] == {"template": "samples-{00..02..1}"} and start.body["input_extension"] == ".tar"
    before, after = {}, {}
    for name in report.shards:
        before.update(read_shard(proxy.fqn("pets", name).read_bytes()))
    order = []
    for name in result.shards:
        shard = read_shard(proxy.fqn("pets", name).read_bytes())
        after.update(shard)
        order += list(shard)
    assert after == before  # every record, whole, exactly once
    assert order != sorted(order)
    assert len(proxy.calls("GET", "/v1/sort")) >= 1  # the job was waited for


def test_dsort_failure_is_an_error(ais, proxy: FakeProxy) -> None:
    with pytest.raises(ShuffleError, match="no brace range"):
        shuffle_shards(ais, "pets", "samples", "shuffled-{0..9}")
    with pytest.raises(ShuffleError, match="needs a brace range"):
        dsort_framework("pets", ["a.tar"], "shuffled")
    bucket = ais.bucket("pets").create()
    bucket.object("samples-00.tar").get_writer().put_content(make_tar([("k.cls", b"1")]))
    # AIS skips a missing input shard (missing_shards "ignore") and reports success: the client notices.
    with pytest.raises(ShuffleError, match=r"read 1 of its 2 input shards: the others do not exist in pets"):
        shuffle_shards(ais, "pets", ["samples-00.tar", "samples-01.tar"], "shuffled-{0..9}", timeout=5)


def test_aborted_dsort_job_is_an_error(ais, proxy: FakeProxy) -> None:
    bucket = ais.bucket("pets").create()
    bucket.object("samples-00.tar").get_writer().put_content(make_tar([("k.cls", b"1")]))
    proxy.dsort_error = "out of memory on target t1"
    with pytest.raises(ShuffleError, match="did not finish: out of memory on target t1"):
        shuffle_shards(ais, "pets", ["samples-00.tar"], "shuffled-{0..9}", timeout=5)
