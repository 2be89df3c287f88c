"""``wds-transform apply``: local shards through the service's engine, end to end."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.faults import planted
from testbed.shardgen import imagenet_like_shard, jpeg_bytes, make_tar, read_tar
from transformer.cli import main
from transformer.config import VARIABLES, Settings
from transformer.engine import ERROR_MANIFEST_NAME, transform_shard
from transformer.options import parse_etl_args
from transformer.pool import TransformPool


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads its settings from the environment: make that environment known."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ETL_WORKERS", "2")


def small_shard(samples: int = 3, bad: int | None = None) -> bytes:
    members = []
    for i in range(samples):
        members += [(f"s{i}.jpg", b"broken" if i == bad else jpeg_bytes(i, (120, 90))), (f"s{i}.cls", b"%d" % i)]
    return make_tar(members)


def test_apply_one_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(small_shard())
    target = tmp_path / "out.tar"
    etl_args = '{"preset": "imagenet-val", "dtype": "uint8", "layout": "HWC"}'
    assert main(["apply", str(source), str(target), "--etl-args", etl_args]) == 0

    produced = read_tar(target.read_bytes())
    assert [n for n, _ in produced] == ["s0.npy", "s0.cls", "s1.npy", "s1.cls", "s2.npy", "s2.cls"]
    array = np.load(io.BytesIO(produced[0][1]), allow_pickle=False)
    assert array.shape == (224, 224, 3) and array.dtype == np.uint8
    # Exactly what the engine gives the service for the same etl_args (imagenet-val has no randomness).
    settings = Settings.from_env()
    pool = TransformPool(1, 4)
    try:
        direct = b"".join(transform_shard(io.BytesIO(source.read_bytes()), parse_etl_args(etl_args, settings), pool,
                                          shard=str(source), object_name="in.tar", window=2))
    finally:
        pool.shutdown()
    assert target.read_bytes() == direct
    assert "3 samples (3 images) of 3" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.tar", "out.tar"]


def test_apply_several_shards_into_a_folder(tmp_path: Path) -> None:
    sources = []
    for name, samples in (("a-000.tar", 2), ("a-001.tar", 3), ("a-002.tar", 1)):
        path = tmp_path / name
        path.write_bytes(small_shard(samples))
        sources.append(path)
    folder = tmp_path / "out" / "nested"
    assert main(["apply", *map(str, sources), str(folder), "--etl-args", '{"seed": 3}']) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["a-000.tar", "a-001.tar", "a-002.tar"]
    for path, samples in zip(sorted(folder.iterdir()), (2, 3, 1)):
        names = [n for n, _ in read_tar(path.read_bytes())]
        assert names == [n for i in range(samples) for n in (f"s{i}.npy", f"s{i}.cls")]


def test_seeded_apply_is_reproducible(tmp_path: Path) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(small_shard())
    for out in ("one.tar", "two.tar"):
        assert main(["apply", str(source), str(tmp_path / out), "--etl-args", '{"seed": 9, "epoch": 1}']) == 0
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()


def test_sample_errors_under_skip_are_reported_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(small_shard(3, bad=1))
    target = tmp_path / "out.tar"
    assert main(["apply", str(source), str(target)]) == 0
    produced = read_tar(target.read_bytes())
    assert [n for n, _ in produced] == ["s0.npy", "s0.cls", "s2.npy", "s2.cls", ERROR_MANIFEST_NAME]
    assert json.loads(produced[-1][1])["errors"][0]["key"] == "s1"
    assert "1 with errors" in capsys.readouterr().out


@pytest.mark.parametrize(
    "data, etl_args, words",
    [
        (small_shard(3, bad=1), '{"on_error": "fail"}', "sample 's1'"),
        (small_shard(3)[:3000], "", "truncated"),
        (b"definitely not a tar file" * 50, "", "not a tar"),
    ],
)
def test_failure_leaves_no_file_under_the_final_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, etl_args: str, words: str
) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(data)
    target = tmp_path / "out.tar"
    assert main(["apply", str(source), str(target), "--etl-args", etl_args]) == 1
    assert not target.exists()
    error = capsys.readouterr().err
    assert words in error and str(source) in error


def test_one_bad_shard_among_several(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.tar", tmp_path / "bad.tar"
    good.write_bytes(small_shard(2))
    bad.write_bytes(small_shard(2)[:2500])
    folder = tmp_path / "out"
    assert main(["apply", str(bad), str(good), str(folder)]) == 1
    assert (folder / "good.tar").exists() and not (folder / "bad.tar").exists()


def test_failure_leaves_no_partial_file(tmp_path: Path) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(small_shard(3)[:3000])
    assert main(["apply", str(source), str(tmp_path / "out.tar")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.tar"]


def test_bad_etl_args_fail_before_any_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(small_shard(1))
    assert main(["apply", str(source), str(tmp_path / "out.tar"), "--etl-args", '{"dtype": "float64"}']) == 2
    assert "'dtype'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.tar"]


def test_console_script_end_to_end(tmp_path: Path) -> None:
    source = tmp_path / "in.tar"
    source.write_bytes(imagenet_like_shard(2))
    target = tmp_path / "out.tar"
    script = shutil.which("wds-transform", path=os.path.dirname(sys.executable))
    assert script, "the wds-transform console script is not installed next to this interpreter"
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES} | {"ETL_WORKERS": "2"}
    done = subprocess.run([script, "apply", str(source), str(target), "--etl-args", '{"dtype": "float16"}'],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    names = [n for n, _ in read_tar(target.read_bytes())]
    assert names == ["sample-000000.npy", "sample-000000.cls", "sample-000000.json",
                     "sample-000001.npy", "sample-000001.cls", "sample-000001.json"]
    array = np.load(io.BytesIO(read_tar(target.read_bytes())[0][1]), allow_pickle=False)
    assert array.shape == (3, 224, 224) and array.dtype == np.float16


@pytest.mark.parametrize("on_error", ["skip", "passthrough", "fail"])
def test_a_fault_of_our_own_fails_the_shard_under_every_policy(tmp_path: Path, on_error: str) -> None:
    """Good samples and a fault in the pod's own output path (planted: every 5th .npy header): a non-zero exit and
    no output file, never a whole shard with a sample skipped or passed through."""
    source = tmp_path / "in.tar"
    source.write_bytes(imagenet_like_shard(8))
    target = tmp_path / "out.tar"
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES} | {"ETL_WORKERS": "2"}
    env |= planted(tmp_path / "fault", "npy-descr", 5)
    done = subprocess.run([sys.executable, "-m", "transformer", "apply", str(source), str(target),
                           "--etl-args", json.dumps({"on_error": on_error})],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "was not transformed" in done.stderr and "planted fault 'npy-descr'" in done.stderr, done.stderr
    assert f"shard '{source}'" in done.stderr, done.stderr
    assert not target.exists() and not list(tmp_path.glob("out.tar*"))


def test_measure_seconds_per_image_times_the_engine_and_refuses_a_shard_without_images(tmp_path: Path) -> None:
    from transformer.apply import measure_seconds_per_image

    source = tmp_path / "in.tar"
    source.write_bytes(small_shard(4))
    seconds = measure_seconds_per_image(str(source), '{"preset": "imagenet-val"}')
    assert 0 < seconds < 5
    assert 0 < measure_seconds_per_image(str(source), max_samples=1) < 5
    empty = tmp_path / "labels.tar"
    empty.write_bytes(make_tar([("s0.cls", b"1")]))
    with pytest.raises(ValueError, match="no transformable image"):
        measure_seconds_per_image(str(empty))
