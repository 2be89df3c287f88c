"""The training client against a real aisnode, through the aistore SDK: convert uploads, shard_urls lists,
the loader reads directly (no ETL), dSort shuffles for real, and register fails with the cluster's message."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from testbed.cluster import LocalCluster
from testbed.service import base_env
from testbed.shardgen import jpeg_bytes
from tests.client.test_convert import make_pets
from transformer.client import (
    ClientError,
    EtlRequestError,
    EtlSettings,
    ShuffleError,
    convert,
    etl_logs,
    make_loader,
    register,
    shard_urls,
    shuffle_shards,
    transform_bucket,
    unregister,
)

pytestmark = pytest.mark.ais
NO_KUBERNETES = ("k8s client is not initialized (non-Kubernetes deployment?)", "the operation requires Kubernetes")
REPO = Path(__file__).resolve().parents[2]


def read_members(data: bytes) -> list[tuple[str, str, bytes]]:
    """(key, extension, bytes) of every member, in order: duplicates stay visible."""
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return [(*m.name.split(".", 1), archive.extractfile(m).read()) for m in archive.getmembers()]


def read_samples(data: bytes) -> list[tuple[str, dict[str, bytes]]]:
    samples: list[tuple[str, dict[str, bytes]]] = []
    for key, ext, content in read_members(data):
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
        samples[-1][1][ext] = content
    return samples


def make_folders(root: Path) -> dict[str, tuple[int, dict[str, bytes]]]:
    """``root/<class>/<image>``: key -> (label, members) that convert must write."""
    expected = {}
    for label, cls in enumerate(["ant", "bee", "zebra"]):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            data = jpeg_bytes(label * 4 + i, (32, 24))
            (root / cls / f"{i}.jpg").write_bytes(data)
            expected[f"{cls}_{i}"] = (label, {"jpg": data})
    return expected


def make_labels(root: Path) -> tuple[Path, dict[str, tuple[int, dict[str, bytes]]]]:
    """Images in nested folders and a labels file with text labels."""
    expected = {}
    lines = []
    for i, relative in enumerate(["a/cat.1.jpg", "a/b/dog.jpg", "c.png", "d/e/f/cat-2.jpeg", "g.jpg"]):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        data = jpeg_bytes(i, (20, 20))
        path.write_bytes(data)
        label = "cat" if "cat" in relative else "dog"
        lines.append(f"{relative}\t{label}")
        ext = "jpg" if relative.endswith((".jpg", ".jpeg")) else "png"
        key = re.sub(r"[./]", "_", relative.rsplit(".", 1)[0])  # a_cat_1: no dot left in a key
        expected[key] = ({"cat": 0, "dog": 1}[label], {ext: data})
    labels = root.parent / "labels.tsv"
    labels.write_text("\n".join(lines) + "\n")
    return labels, expected


def expected_pets(root: Path) -> dict[str, tuple[int, dict[str, bytes]]]:
    complete = make_pets(root, per_breed=4)
    return {name: (label, {"image.jpg": (root / "images" / f"{name}.jpg").read_bytes(),
                           "trimap.png": (root / "annotations" / "trimaps" / f"{name}.png").read_bytes()})
            for name, label in complete.items()}


@pytest.mark.parametrize("layout", ["folders", "labels", "pets"])
def test_convert_uploads_every_complete_record(layout: str, tmp_path: Path, ais_client, ais_cluster: LocalCluster,
                                               bucket_name: str) -> None:
    root = tmp_path / layout
    labels_file = None
    if layout == "folders":
        expected = make_folders(root)
    elif layout == "labels":
        root.mkdir()
        labels_file, expected = make_labels(root)
    else:
        expected = expected_pets(root)
    bucket = ais_client.bucket(bucket_name).create(exist_ok=True)
    report = convert(root, layout=layout, labels_file=labels_file, bucket=bucket, prefix="train/", max_samples=3,
                     progress=False)
    assert report.samples == len(expected)
    listed = sorted(entry.name for entry in bucket.list_all_objects(prefix="train/"))
    assert listed == report.shards == [f"train/shard-{i:06d}.tar" for i in range(-(-len(expected) // 3))]
    uploaded = []
    for name in listed:
        data = bucket.object(name).get_reader().read_all()
        assert ais_cluster.fqn(bucket_name, name).read_bytes() == data  # where the target keeps it
        uploaded += read_samples(data)
    assert Counter(key for key, _ in uploaded) == Counter(list(expected))  # each once
    for key, members in uploaded:
        label, files = expected[key]
        assert int(members.pop("cls")) == label
        assert members == files  # byte for byte


@pytest.fixture(scope="module")
def uploaded(ais_client, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, tuple[int, dict]]]:
    """Pets converted into ``samples-NN.tar`` shards of 4 in one bucket, plus an object that is no shard."""
    root = tmp_path_factory.mktemp("pets") / "pets"
    expected = expected_pets(root)  # 10 complete records
    bucket = ais_client.bucket("uploaded-pets").create(exist_ok=True)
    report = convert(root, layout="pets", bucket=bucket, prefix="samples-", pattern="%02d.tar", max_samples=4,
                     progress=False)
    assert report.shards == ["samples-00.tar", "samples-01.tar", "samples-02.tar"]
    bucket.object("samples-notes.txt").get_writer().put_content(b"not a shard")
    return "uploaded-pets", expected


def test_shard_urls_lists_by_prefix_and_by_template(ais_client, ais_cluster: LocalCluster, uploaded) -> None:
    bucket, _ = uploaded
    by_prefix = shard_urls(ais_client, bucket, None, prefix="samples-")
    by_template = shard_urls(ais_client, bucket, None, template="samples-{00..02}.tar")
    assert sorted(by_prefix) == by_template == [
        f"{ais_cluster.url}/v1/objects/{bucket}/samples-{i:02d}.tar?provider=ais" for i in range(3)]
    etl = shard_urls(ais_client, bucket, "wds-etl", template="samples-{00..01}.tar", etl_args={"dtype": "uint8"})
    assert etl == [f"{ais_cluster.url}/v1/objects/{bucket}/samples-0{i}.tar?provider=ais&etl_name=wds-etl"
                   "&etl_args=%7B%22dtype%22%3A%22uint8%22%7D" for i in range(2)]


def test_the_loader_reads_shards_directly_each_sample_once(ais_client, uploaded) -> None:
    bucket, expected = uploaded
    urls = shard_urls(ais_client, bucket, None, prefix="samples-")
    loader = make_loader(urls, 3, keys=("__key__", "cls", "image.jpg"), num_workers=2, shuffle_buffer=4, seed=3,
                         require_marker=False)  # source shards: no ETL end marker
    seen = []
    for keys, labels, images in loader:
        for key, label, image in zip(keys, labels.tolist(), images):
            assert (label, image) == (expected[key][0], expected[key][1]["image.jpg"])
            seen.append(key)
    assert Counter(seen) == Counter(list(expected))
    assert loader.errors.count == 0


def test_the_loader_requires_the_end_marker_by_default(ais_client, uploaded, caplog) -> None:
    bucket, _ = uploaded
    urls = shard_urls(ais_client, bucket, None, template="samples-{00..01}.tar")
    loader = make_loader(urls, 2, keys=("__key__", "cls"), num_workers=0, shuffle_buffer=0)
    with caplog.at_level("WARNING", logger="transformer.client"):
        keys = [key for batch, _ in loader for key in batch]
    assert len(keys) == len(set(keys)) == 8  # what arrived arrived once (retries continue after it) ...
    assert loader.errors.count == 2  # ... and each source shard counts as cut: no ETL end marker
    assert all(any(url in record.getMessage() for record in caplog.records) for url in urls)


def test_shuffle_shards_runs_a_real_dsort_job(ais_client, ais_cluster: LocalCluster, uploaded) -> None:
    bucket, expected = uploaded
    result = shuffle_shards(ais_client, bucket, "samples-{00..02}", "shuffled-{0000..0099}",
                            output_shard_size="4KB", seed=7, timeout=120)
    assert result.bucket == bucket and len(result.shards) >= 2, result
    assert (result.input_shards, result.members) == (3, 3 * len(expected))  # image.jpg, cls, trimap.png
    assert all(re.fullmatch(r"shuffled-\d{4}\.tar", name) for name in result.shards)
    before = [s for i in range(3) for s in read_samples(
        ais_client.bucket(bucket).object(f"samples-{i:02d}.tar").get_reader().read_all())]
    after = []
    for name in result.shards:
        after += read_samples(ais_client.bucket(bucket).object(name).get_reader().read_all())
    assert Counter(key for key, _ in after) == Counter(list(expected))  # every record exactly once
    assert sorted(after) == sorted(before)  # whole: the same members, byte for byte
    assert [key for key, _ in after] != [key for key, _ in before]  # and shuffled
    job = ais_client.dsort(result.job_id).get_job_info()
    assert job, result.job_id

    # Inputs given by (whole) name. The same seed need not give the same order: AIS shuffles the records in
    # the order the targets extracted them, and input shards are extracted concurrently (ext/dsort/sort.go).
    again = shuffle_shards(ais_client, bucket, [f"samples-{i:02d}.tar" for i in range(3)], "again-{0000..0099}",
                           output_shard_size="4KB", seed=7, timeout=120)
    records = [s for name in again.shards
               for s in read_samples(ais_client.bucket(bucket).object(name).get_reader().read_all())]
    assert sorted(records) == sorted(before)

    # A missing input: AIS skips it and reports success (missing_shards "ignore"); the client does not.
    with pytest.raises(ShuffleError, match="read 2 of its 3 input shards"):
        shuffle_shards(ais_client, bucket, ["samples-00.tar", "samples-01.tar", "samples-07.tar"],
                       "partial-{0000..0099}", seed=7, timeout=120)


def test_register_without_kubernetes_fails_with_the_clusters_message(ais_client, ais_cluster: LocalCluster) -> None:
    settings = EtlSettings(image="registry.example.com/ais-wds-transformer:0.1.0", comm_type="hpush")
    with pytest.raises(EtlRequestError) as failure:
        register(ais_client, "wds-etl", settings)
    error = failure.value
    # AIS's own words: a target's, from the registration's first phase (or, once AIS has recorded the
    # name, from the target that answers for it).
    assert error.ais_message in NO_KUBERNETES, error
    assert error.status == 400 and error.node.startswith("t[") and error.cannot_run_etl
    message = str(error)
    assert message.startswith(f"ETL 'wds-etl': registration at {ais_cluster.url} failed (HTTP 400 from t[")
    assert "cannot run ETLs" in message and "require_marker=False" in message
    assert isinstance(error.__cause__, __import__("aistore.sdk.errors").sdk.errors.AISError)
    with pytest.raises(EtlRequestError) as again:
        unregister(ais_client, "wds-etl", missing_ok=False)
    assert again.value.ais_message in NO_KUBERNETES and again.value.cannot_run_etl


def test_bucket_transform_without_kubernetes_is_refused_by_the_proxy(ais_client, uploaded) -> None:
    """The proxy checks for Kubernetes before an offline transform starts (no job, no partial copy)."""
    from aistore.sdk.errors import AISError

    bucket, _ = uploaded
    with pytest.raises(AISError, match="requires Kubernetes"):
        ais_client.bucket(bucket).transform("wds-etl", to_bck=ais_client.bucket("never-made"))
    names = {b.name for b in ais_client.cluster().list_buckets()}
    assert "never-made" not in names


def run_example(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=base_env(), cwd=REPO)


@pytest.mark.slow
def test_train_example_runs_its_non_etl_steps_against_aisnode(ais_cluster: LocalCluster, ais_client) -> None:
    checked = run_example("--ais-endpoint", ais_cluster.url, "--bucket", "example-no-etl", "--no-etl",
                          "--workers", "1")
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-3000:]
    assert "uploaded 96 samples in 6 shards to ais://example-no-etl/train/" in checked.stdout
    assert "listed 6 shards" in checked.stdout
    assert "read back 96 samples (96 distinct) directly, loader errors 0" in checked.stdout
    names = sorted(e.name for e in ais_client.bucket("example-no-etl").list_all_objects())
    assert names == [f"train/shard-{i:06d}.tar" for i in range(6)]

    # Without --no-etl it goes on to register the ETL, which this cluster cannot run: it says so and stops.
    full = run_example("--ais-endpoint", ais_cluster.url, "--bucket", "example-etl", "--workers", "1")
    assert full.returncode == 2, full.stdout[-2000:] + full.stderr[-3000:]
    assert "uploaded 96 samples in 6 shards" in full.stdout
    assert "error: ETL 'wds-etl': registration at" in full.stderr
    assert any(message in full.stderr for message in NO_KUBERNETES) and "Traceback" not in full.stderr
    assert "cannot run ETLs" in full.stderr


def test_offline_copy_logs_and_etld_reads_on_a_cluster_without_kubernetes(ais_client, uploaded, caplog) -> None:
    """What a user meets on a cluster that cannot run the ETL: each request fails with the cluster's words."""
    bucket, _ = uploaded
    with pytest.raises(ClientError) as offline:  # the options check asks AIS for the ETL before any job starts
        transform_bucket(ais_client, "wds-etl", bucket, "never-made", options={"preset": "imagenet-val"})
    # Never registered: the proxy does not know it. After a refused registration AIS keeps the name, and the
    # target that answers for it says why it cannot run.
    assert ("ETL 'wds-etl' is not registered" in str(offline.value)
            or getattr(offline.value, "ais_message", "") in NO_KUBERNETES), offline.value
    with pytest.raises(EtlRequestError) as logs:
        etl_logs(ais_client, "wds-etl")
    assert logs.value.ais_message in NO_KUBERNETES and logs.value.node.startswith("t[")
    urls = shard_urls(ais_client, bucket, "wds-etl", template="samples-{00..01}.tar", pipeline=["wds-etl-next"])
    assert all(url.endswith("&etl_name=wds-etl&etl_pipeline=wds-etl-next") for url in urls)
    loader = make_loader(urls, 2, keys=("__key__", "cls"), num_workers=0, shuffle_buffer=0, retries=0)
    with caplog.at_level("WARNING", logger="transformer.client"):
        assert list(loader) == []
    assert loader.errors.count == 2
    assert caplog.text.count("HTTP 404: ") == 2 and "wds-etl does not exist - try starting new ETL" in caplog.text
