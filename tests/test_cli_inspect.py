"""``wds-transform inspect``: a shard's summary, and whether it is whole (its end marker checked)."""

from __future__ import annotations

import functools
import io
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler
from pathlib import Path

import pytest

from testbed.httpserve import QuietServer
from testbed.shardgen import jpeg_bytes, make_tar, read_tar
from transformer.cli import main


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("inspect")
    raw = folder / "raw.tar"
    members = []
    for i in range(4):
        members += [(f"s{i}.jpg", b"broken" if i == 2 else jpeg_bytes(i, (120, 90))), (f"s{i}.cls", b"%d" % i)]
    raw.write_bytes(make_tar(members))
    out = folder / "out.tar"
    assert main(["apply", str(raw), str(out), "--etl-args", '{"dtype": "uint8"}']) == 0
    data = out.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        third = archive.getmembers()[4]  # s3.npy: after s0, s1 (s2 was skipped)
    (folder / "cut.tar").write_bytes(data[:third.offset] + b'{"message": "copy failed", "status": 500}')
    (folder / "unmarked.tar").write_bytes(make_tar(read_tar(data)))
    return {p.stem: p for p in folder.iterdir()}


def test_a_whole_output_is_summarized_and_said_whole(shards, capsys) -> None:
    assert main(["inspect", str(shards["out"])]) == 0
    out = capsys.readouterr().out
    assert "3 samples, 6 members" in out and "uint8 (3, 224, 224) x3" in out
    assert "s2 (s2.jpg)" in out and "-> skipped" in out  # the error manifest
    assert "  labels: 3 (3 distinct): 0 x1, 1 x1, 3 x1\n" in out
    assert ("whole: the end marker matches (7 members" in out and "read 4 samples, wrote 3, skipped 1, passed 0"
            in out)


@pytest.mark.parametrize("name", ["cut", "unmarked"])
def test_a_cut_or_unmarked_shard_is_an_error(shards, capsys, name: str) -> None:
    assert main(["inspect", str(shards[name])]) == 1
    captured = capsys.readouterr()
    assert f"error: shard '{shards[name]}'" in captured.err
    assert ("corrupt or truncated tar" if name == "cut" else "no end marker") in captured.err
    # cut before s3: s1 may have had more members, so only s0 counts as read
    assert ("1 samples" if name == "cut" else "3 samples") in captured.out


@pytest.mark.parametrize("content, why", [(b"root:x:0:0:root:/root:/bin/sh\n" * 20, "invalid header"),
                                          (b"", "empty file"), (b"\x8b" * 100, "truncated header")],
                         ids=["text", "empty", "binary"])
def test_a_file_that_is_not_a_tar_gets_the_error_alone(tmp_path: Path, capsys, content: bytes, why: str) -> None:
    path = tmp_path / "passwd"
    path.write_bytes(content)
    for raw in ([], ["--raw"]):
        assert main(["inspect", *raw, str(path)]) == 1
        captured = capsys.readouterr()
        assert captured.out == "", captured.out  # no summary of nothing
        assert captured.err == f"error: shard '{path}': not a tar archive ({why})\n"


def test_the_labels_of_a_large_shard_are_summarized_on_one_short_line(tmp_path: Path, capsys) -> None:
    labels = ["5"] * 100 + ["7"] * 60 + ["12"] * 40 + [str(n) for n in range(100, 156)]  # 256 samples, 59 labels
    shard = tmp_path / "labels.tar"
    shard.write_bytes(make_tar([(f"s{i:03d}.cls", label.encode()) for i, label in enumerate(labels)]))
    assert main(["inspect", "--raw", str(shard)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  labels:")]
    assert lines == ["  labels: 256 (59 distinct); most common: 5 x100, 7 x60, 12 x40, 100 x1, 101 x1"]


def test_a_source_shard_needs_raw(shards, capsys) -> None:
    assert main(["inspect", str(shards["raw"])]) == 1
    assert "--raw for a shard that is not ETL'd" in capsys.readouterr().err
    assert main(["inspect", "--raw", str(shards["raw"])]) == 0
    assert "no end marker: not checked (--raw)" in capsys.readouterr().out


def test_a_url_is_read_too(shards, capsys) -> None:
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(shards["out"].parent))
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["inspect", f"{base}/out.tar"]) == 0
        assert main(["inspect", f"{base}/cut.tar"]) == 1
        assert main(["inspect", f"{base}/missing.tar"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    captured = capsys.readouterr()
    assert "whole: the end marker matches" in captured.out and "HTTP 404" in captured.err
