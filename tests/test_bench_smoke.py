"""CI-sized runs of the benchmarks (``python -m bench.run --smoke``, ``python -m bench.reader --smoke``),
so the harnesses cannot rot.

Not a timed test: it checks that every section ran, that both servers answered every request with a
float32 ``.npy`` per image, and that the report files were written, not how fast anything was.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NPY_PAYLOAD = {"float32": 3 * 224 * 224 * 4, "uint8": 3 * 224 * 224}  # bytes of one (3, 224, 224) array

needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="the benchmark drives HTTP with curl")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench-out")
    work = tmp_path_factory.mktemp("bench-work")
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out), "--work", str(work), "--budget", "200"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280,
    )
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((work / "logs").glob("*.log")))
    assert done.returncode == 0, f"bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs}"
    return json.loads((out / "results.json").read_text()), out


@needs_curl
def test_every_section_ran_and_nothing_was_skipped(smoke: tuple[dict, Path]) -> None:
    results, _ = smoke
    assert results["skipped"] == []
    assert {r["preset"] for r in results["compute"]} == {"imagenet-train", "imagenet-val"}
    assert all(r["images_per_s"] > 0 for r in results["compute"])
    # The compute limit's loop with each array sent to curl: every image reached the client.
    assert {r["preset"] for r in results["http_limit"]} == {"imagenet-train", "imagenet-val"}
    assert all(r["images"] > 0 and r["images_per_s"] > 0 and r["client_cpu_ms_per_image"] > 0
               for r in results["http_limit"])
    assert {r["option"].split()[0] for r in results["decoders"]} >= {"torchvision", "PIL"}
    seen = {(r["system"], r["mode"], r["concurrency"]) for r in results["measurements"] if r["shard"] == "demo"}
    for system in ("service", "peer"):
        cases = {("hpush-body", 1), ("hpush-fqn", 1), ("ws", 1), ("hpush-fqn", 2)}
        assert {(system, mode, c) for mode, c in cases} <= seen
    assert {(m["mode"], m["shard"]) for m in results["memory"]} == {
        (mode, size) for mode in ("hpush-fqn", "hpush-body") for size in ("small", "big")
    }
    readers = {c["reader"].split(",")[0] for c in results["client"]}
    assert readers == {"client-side decoding (raw shards)", "transformer.client"}
    assert all(c["samples"] > 0 and c["complete"] for c in results["client"])


@needs_curl
def test_both_servers_returned_a_float32_array_per_image(smoke: tuple[dict, Path]) -> None:
    results, _ = smoke
    shard_images = {s["name"]: s["images"] for s in results["shards"]["demo"]}
    assert all(n > 0 for n in shard_images.values())
    for row in results["measurements"]:
        assert row["failed"] == 0, row["errors"]
        assert row["images"] > 0 and row["images_per_s"] > 0
        # Every image became a (3, 224, 224) .npy: the output holds at least that many payload bytes.
        dtype = "uint8" if row["shard"].endswith("uint8") else "float32"
        assert row["bytes_out"] >= row["images"] * NPY_PAYLOAD[dtype], (row["system"], row["mode"], dtype)
        assert row["bytes_out"] < row["images"] * NPY_PAYLOAD[dtype] * 1.5 + row["bytes_in"]
        assert len(row["latency_s"]) == row["requests"] and row["peak_rss"] > 0
    assert [r["round"] for r in results["uint8"]] == [0]


@needs_curl
def test_report_files_are_written(smoke: tuple[dict, Path]) -> None:
    results, out = smoke
    markdown = (out / "results.md").read_text()
    for heading in ("## Targets", "## Compute limit", "## Where an image's CPU goes", "## The same with uint8",
                    "## Throughput over HTTP", "## Memory",
                    "## What the training loop receives", "## Decode and resize options"):
        assert heading in markdown
    assert results["meta"]["command"].startswith("python -m bench.run --smoke")
    assert results["meta"]["versions"]["torch"]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reader_smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("reader-out")
    done = subprocess.run([sys.executable, "-m", "bench.reader", "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"bench.reader failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads((out / "results.json").read_text()), out


def test_the_reader_bench_measures_every_reader_for_both_dtypes(reader_smoke: tuple[dict, Path]) -> None:
    results, out = reader_smoke
    readers = {(r["dtype"], r["reader"]) for r in results["reads"]}
    assert {reader for _, reader in readers} == {
        "one-copy reader (floor)", "make_loader, shuffle_buffer=0", "make_loader, shuffle_buffer=1000",
        "make_loader, shuffle_buffer=1000, num_workers=1", "web_loader (WebLoader, shards read whole)",
        "plain webdataset"}
    assert {dtype for dtype, _ in readers} == {"uint8", "float32"} and len(readers) == 12
    expected = results["meta"]["shards"] * results["meta"]["samples_per_shard"] * results["meta"]["passes"]
    assert all(r["samples"] == expected and r["samples_per_s"] > 0 and r["cpu_s"] > 0 and r["steady_samples_per_s"] > 0
               for r in results["reads"])
    mixing = {row["shuffle"]: row for row in results["mixing"]}
    assert mixing["make_loader, shuffle_buffer=1000"]["held"] == 1024  # 16 open batches of 64
    assert (mixing["picking buffer of 500"]["neighbours_together"] > mixing["picking buffer of 1000"][
        "neighbours_together"] > mixing["picking buffer of 2000"]["neighbours_together"] > 0)
    assert [(m["shuffle_buffer"], m["workers"]) for m in results["memory"]] == [(0, 0), (4, 1)]
    assert all(m["pss_peak"] >= m["pss_before"] > 0 for m in results["memory"])
    markdown = (out / "results.md").read_text()
    assert "of the floor, same round" in markdown and "PSS peak" in markdown and "neighbours in one batch" in markdown
    assert results["meta"]["command"].startswith("python -m bench.reader --smoke")
