"""make_loader on local .npy shards: exactly once per epoch, shuffles, node/worker splits, batches, errors."""

from __future__ import annotations

import io
import multiprocessing
import tarfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.httpserve import QuietServer
from testbed.shardgen import npy_bytes, sealed
from transformer.client import ClientError, ErrorCounter, ShardFetchError, make_loader
from transformer.client.reading import open_shard

KEYS = ("npy", "cls", "__key__")



def write_shards(folder: Path, shards: int, per_shard: int, *, broken: dict[int, str] | None = None,
                 marker: dict | None = None) -> list[str]:
    """Shards of ``<key>.npy`` (3x4x4 float32 filled with the label) + ``<key>.cls``; label = global index.

    Each ends with the end marker, as the ETL writes them."""
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for i in range(s * per_shard, (s + 1) * per_shard):
                key = f"sample-{i:05d}"
                members = [(f"{key}.npy", npy_bytes(np.full((3, 4, 4), i, np.float32))), (f"{key}.cls", b"%d" % i)]
                if broken and i in broken:
                    members = [(f"{key}.npy", b"not an npy")] if broken[i] == "npy" else members[:1]
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        path.write_bytes(sealed(buffer.getvalue(), **(marker or {})))  # as the ETL writes them: with the end marker
        paths.append(str(path))
    return paths


def epoch_samples(loader) -> list[tuple[str, int]]:
    seen = []
    for images, labels, keys in loader:
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.equal(images[:, 0, 0, 0].long(), labels)  # each image travels with its own label
        seen += list(zip(keys, labels.tolist()))
    return seen


@pytest.mark.parametrize(("workers", "shards"), [(0, 1), (1, 3), (2, 5), (3, 2)])
def test_every_sample_exactly_once_per_epoch(tmp_path: Path, workers: int, shards: int) -> None:
    urls = write_shards(tmp_path, shards, 6)
    loader = make_loader(urls, 4, keys=KEYS, num_workers=workers, shuffle_buffer=5, seed=1)
    for _ in range(2):
        seen = epoch_samples(loader)
        assert sorted(label for _, label in seen) == list(range(shards * 6))
        assert all(key == f"sample-{label:05d}" for key, label in seen)
    assert loader.num_workers == min(workers, shards)  # no idle worker when there are fewer shards
    assert loader.errors.count == 0


@pytest.mark.parametrize("marker", [{}, {"source": {"size": 10240, "cksum_type": "xxhash2", "cksum": "0" * 16},
                                     "settings": "f" * 32, "version": "0.1.0"}], ids=["older", "current"])
def test_shards_with_older_or_current_end_markers_are_read_whole(tmp_path: Path, marker: dict) -> None:
    urls = write_shards(tmp_path, 2, 3, marker=marker)
    loader = make_loader(urls, 2, keys=KEYS, num_workers=0, shuffle_buffer=0, seed=1)
    assert sorted(label for _, label in epoch_samples(loader)) == list(range(6)) and loader.errors.count == 0


def test_shuffles_follow_seed_and_epoch(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 4, 5)

    def order(seed: int, epoch: int) -> list[int]:
        loader = make_loader(urls, 20, keys=KEYS, num_workers=0, shuffle_buffer=8, seed=seed, epoch=epoch)
        return [label for _, label in epoch_samples(loader)]

    assert order(1, 0) == order(1, 0)  # reproducible
    assert order(1, 0) != order(1, 1)  # a new order every epoch
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != sorted(order(1, 0))
    loader = make_loader(urls, 20, keys=KEYS, num_workers=0, shuffle_shards=False, shuffle_buffer=0)
    assert [label for _, label in epoch_samples(loader)] == list(range(20))


def test_iterating_again_is_the_next_epoch(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 3, 4)
    loader = make_loader(urls, 12, keys=KEYS, num_workers=0, shuffle_buffer=6, seed=3)
    first, second = epoch_samples(loader), epoch_samples(loader)
    assert loader.epoch == 2 and first != second
    loader.set_epoch(0)
    assert epoch_samples(loader) == first


def test_split_by_node_gives_each_rank_its_own_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = write_shards(tmp_path, 5, 3)
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = make_loader(urls, 4, keys=KEYS, num_workers=2, seed=9)
        per_rank.append({label for _, label in epoch_samples(loader)})
    assert not per_rank[0] & per_rank[1]
    assert per_rank[0] | per_rank[1] == set(range(15))
    assert {len(p) for p in per_rank} == {6, 9}  # shards 3 + 2 of the same shuffled order
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ClientError, match="rank 5 of 8 gets no shard"):
        make_loader(urls, 4, num_workers=1)


@pytest.mark.parametrize(("last_batch", "sizes"), [("partial", [4, 4, 2]), ("drop", [4, 4]), ("pad", [4, 4, 4])])
def test_last_batch(tmp_path: Path, last_batch: str, sizes: list[int]) -> None:
    urls = write_shards(tmp_path, 1, 10)
    loader = make_loader(urls, 4, keys=KEYS, num_workers=0, last_batch=last_batch, shuffle_buffer=0)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == sizes
    if last_batch == "pad":
        valid = batches[-1][3]
        assert valid.dtype == torch.bool and valid.tolist() == [True, True, False, False]
        assert batches[-1][1].tolist() == [8, 9, 9, 9]  # padded by repeating the last sample
        assert all(b[3].all() for b in batches[:-1])


def test_resampled_stream_has_the_epoch_length(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 2, 5)
    loader = make_loader(urls, 3, keys=KEYS, num_workers=2, resampled=True, epoch_batches=7)
    assert len(loader) == 7
    batches = list(loader)
    assert len(batches) == 7 and all(len(b[1]) == 3 for b in batches)
    with pytest.raises(ValueError, match="endless"):
        make_loader(urls, 3, resampled=True)


def test_bad_samples_and_shards_are_counted_and_skipped_without_sleeping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = write_shards(tmp_path, 3, 10, broken={3: "npy", 4: "cls", 5: "npy"})
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(Path(urls[2]).read_bytes()[:3000])
    urls[2] = str(truncated)
    urls.append(str(tmp_path / "missing.tar"))
    errors = ErrorCounter()
    # webdataset's warn_and_continue sleeps 0.5 s per error: every sleep the workers ask for is summed here
    # (a shared value, and time.sleep patched before the DataLoader forks them), not read off a loaded clock
    assert torch.multiprocessing.get_start_method() == "fork", "the workers must inherit the patched time.sleep"
    slept = multiprocessing.Value("d", 0.0)
    real_sleep = time.sleep

    def counted_sleep(seconds: float) -> None:
        with slept.get_lock():
            slept.value += seconds
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", counted_sleep)
    loader = make_loader(urls, 4, keys=KEYS, num_workers=2, errors=errors)
    seen = epoch_samples(loader)
    assert slept.value < 0.5, f"the loader slept {slept.value:.1f} s over {errors.count} errors"
    labels = {label for _, label in seen}
    assert labels >= set(range(10, 20)) and not labels & {3, 4, 5}
    assert errors.count >= 5  # 3 bad samples, the truncated shard, the missing shard


def test_too_many_errors_stop_the_epoch(tmp_path: Path) -> None:
    urls = [str(tmp_path / f"missing-{i}.tar") for i in range(5)]
    loader = make_loader(urls, 4, num_workers=0, errors=ErrorCounter(max_errors=2))
    with pytest.raises(ClientError, match="more than 2 loader errors"):
        list(loader)


class _Server:
    """Serves fixed (status, body) answers per path on 127.0.0.1, counting requests."""

    def __init__(self, answers: dict[str, list[tuple[int, bytes]]]):
        self.answers = answers
        self.hits: Counter[str] = Counter()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                outer.hits[self.path] += 1
                replies = outer.answers[self.path]
                status, body = replies[min(outer.hits[self.path], len(replies)) - 1]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_http_errors_keep_the_service_message(tmp_path: Path) -> None:
    shard = Path(write_shards(tmp_path, 1, 3)[0]).read_bytes()
    server = _Server({
        "/bad": [(422, b"shard 'ais/@#/b/bad.tar': sample 'k' (member 'k.jpg'): not a decodable image")],
        "/flaky": [(503, b"busy"), (200, shard)],
        "/down": [(502, b"upstream failed")],
    })
    try:
        with pytest.raises(ShardFetchError) as info:
            open_shard(server.url + "/bad")
        assert info.value.status == 422 and "not a decodable image" in str(info.value)
        assert server.hits["/bad"] == 1  # a 4xx is not retried: it would only re-run a failing transform
        assert open_shard(server.url + "/flaky").read() == shard
        with pytest.raises(ShardFetchError, match="HTTP 502: upstream failed"):
            open_shard(server.url + "/down", retries=1)
        assert server.hits["/down"] == 2
        loader = make_loader([server.url + "/flaky", server.url + "/bad"], 8, keys=KEYS, num_workers=0)
        assert sorted(label for _, label in epoch_samples(loader)) == [0, 1, 2]
        assert loader.errors.count == 1
    finally:
        server.close()
