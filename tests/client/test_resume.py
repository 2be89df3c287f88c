"""Resume mid-epoch, exactly: a run stopped after k batches and resumed from its saved state (through
JSON) yields the batches of the uninterrupted run, bit for bit and in order.

Through the real service with a seeded ETL (random crops and flips, ``EpochUrls``): shards in a fake AIS
bucket, URLs from the SDK, each GET redirected to the service as a target does for ``hpull://``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from testbed.fake_proxy import FakeProxy
from transformer.client import CudaPrefetcher, EpochUrls, LoaderStateError, make_loader, shard_urls
from transformer.client.urls import get_etl_args

from .conftest import labelled_shard
from .test_loader import write_shards
from .test_service_loader import registered

if TYPE_CHECKING:
    from testbed.service import Service

PER_SHARD = 5
SHARDS = 6
KEYS = ("npy", "cls", "__key__")
RANDOM = {"transforms": [{"RandomResizedCrop": {"size": 32, "antialias": True}}, {"RandomHorizontalFlip": {}}],
          "dtype": "uint8"}


def seeded_urls(proxy: FakeProxy, shards: int = SHARDS) -> EpochUrls:
    bucket = "r" + uuid.uuid4().hex[:8]
    for s in range(shards):
        proxy.put_object(bucket, f"train/train-{s:03d}.tar", labelled_shard(s * PER_SHARD, PER_SHARD, size=(40, 36)))
    client = registered(proxy)
    return EpochUrls(tuple(shard_urls(client, bucket, "wds-etl", prefix="train/")), RANDOM, seed=21)


def loader_of(urls, batch_size: int = 3, **kwargs):
    options = {"keys": KEYS, "num_workers": 2, "shuffle_buffer": 4, "seed": 3, "epoch": 1, **kwargs}
    return make_loader(urls, batch_size, **options)


def stopped(urls, stop: int, **kwargs) -> tuple[list, dict]:
    """The first ``stop`` batches, and the state after them (through JSON, as a checkpoint file holds it)."""
    loader = loader_of(urls, **kwargs)
    batches = iter(loader)
    head = [next(batches) for _ in range(stop)]
    state = json.loads(json.dumps(loader.state_dict()))
    del batches
    return head, state


def resumed(urls, state: dict, **kwargs) -> list:
    loader = loader_of(urls, **kwargs)
    loader.load_state_dict(state)
    assert loader.epoch == state["epoch"]
    rest = list(loader)
    assert loader.state_dict()["epoch"] == state["epoch"] + 1 and loader.state_dict()["batches"] == 0
    return rest


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for number, (a, b) in enumerate(zip(got, expected)):
        assert len(a) == len(b), number
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), number  # bit for bit
            else:
                assert x == y, number


def check_resume(urls, stop: int, **kwargs) -> dict:
    whole = list(loader_of(urls, **kwargs))
    head, state = stopped(urls, stop, **kwargs)
    assert_same(head + resumed(urls, state, **kwargs), whole)
    return state


def mid_shard_with_buffer(state: dict) -> bool:
    return any(w["buffer"] and 0 < w["taken"] < PER_SHARD for w in state["workers"])


# Three workers on a two-core machine on purpose: DataLoader's advice to start fewer does not apply here.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(("workers", "stops"), [(0, (4, 6)), (1, (5,)), (2, (4, 7)), (3, (5, 6))])
def test_resumed_run_gives_the_uninterrupted_epoch(served_proxy: FakeProxy, workers: int, stops) -> None:
    urls = seeded_urls(served_proxy)
    whole = list(loader_of(urls, num_workers=workers))
    assert sorted(label for batch in whole for label in batch[1].tolist()) == list(range(SHARDS * PER_SHARD))
    for stop in stops:
        head, state = stopped(urls, stop, num_workers=workers)
        assert mid_shard_with_buffer(state), state  # a checkpoint inside a shard, samples in the buffer
        assert state["epoch"] == 1 and state["batches"] == stop and len(json.dumps(state)) < 4000
        assert_same(head + resumed(urls, state, num_workers=workers), whole)


@pytest.mark.parametrize("last_batch", ["partial", "drop", "pad"])
def test_resume_with_each_last_batch(served_proxy: FakeProxy, last_batch: str) -> None:
    urls = seeded_urls(served_proxy, shards=4)  # 20 samples, 2 workers, batches of 3: each worker ends short
    check_resume(urls, 5, last_batch=last_batch, batch_size=3)
    check_resume(urls, 1, last_batch=last_batch, batch_size=3, num_workers=0)


def test_resampled_draws_continue(served_proxy: FakeProxy) -> None:
    urls = seeded_urls(served_proxy, shards=3)
    state = check_resume(urls, 5, resampled=True, epoch_batches=9)
    assert state["batches"] == 5 and state["config"]["resampled"]
    assert mid_shard_with_buffer(state)


def test_epoch_batches_over_a_stream_that_starts_again(served_proxy: FakeProxy) -> None:
    urls = seeded_urls(served_proxy, shards=2)  # 10 samples: 4 batches per pass (2 workers, 5 samples each)
    state = check_resume(urls, 6, epoch_batches=10)
    assert state["passes"] == 1  # stopped in the second pass


def test_two_ranks_resume_their_own_shards(served_proxy: FakeProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = seeded_urls(served_proxy)
    labels = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        state = check_resume(urls, 2)
        assert (state["config"]["rank"], state["config"]["world_size"]) == (rank, 2)
        labels.append({label for batch in loader_of(urls) for label in batch[1].tolist()})
        monkeypatch.setenv("RANK", str(1 - rank))  # another rank's state is refused
        with pytest.raises(LoaderStateError, match=rf"rank \(saved {rank}, this loader {1 - rank}\)"):
            loader_of(urls).load_state_dict(state)
    assert not labels[0] & labels[1] and labels[0] | labels[1] == set(range(SHARDS * PER_SHARD))


def metric(service: Service, name: str, labels: str = "") -> float:
    import httpx  # the service's side (tests marked server): not on the GPU machine

    text = httpx.get(service.url + "/metrics", timeout=5.0).text
    found = re.search(re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def settled_samples(service: Service) -> float:
    deadline = time.monotonic() + 10
    while metric(service, "etl_inflight_shards") and time.monotonic() < deadline:
        time.sleep(0.05)
    return metric(service, "etl_samples_total", 'outcome="ok"')


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_reads_again_only_the_open_and_buffered_shards(served_proxy: FakeProxy, service: Service,
                                                              workers: int) -> None:
    urls = seeded_urls(served_proxy)
    head, state = stopped(urls, 6, num_workers=workers)
    delivered = {label for batch in head for label in batch[1].tolist()}
    served_proxy.requests.clear()
    before = settled_samples(service)
    rest = resumed(urls, state, num_workers=workers)
    transformed = settled_samples(service) - before
    assert delivered | {label for batch in rest for label in batch[1].tolist()} == set(range(SHARDS * PER_SHARD))

    # What the state says must be read again: per shard, the first sample needed (buffered, or the last taken).
    needed: dict[int, int] = {}
    for worker in state["workers"]:
        positions = [(int(key.split("-")[1]), key) for _, _, key in worker["buffer"]]
        if worker["taken"] and not worker["ended"]:
            positions.append((int(worker["last"].split("-")[1]), worker["last"]))
        for label, _ in positions:
            shard, position = divmod(label, PER_SHARD)
            needed[shard] = min(position, needed.get(shard, position))
    done = {s for s in range(SHARDS) if all(s * PER_SHARD + i in delivered for i in range(PER_SHARD))} - set(needed)
    assert done  # some shards were over at the checkpoint: they are not read again
    assert any(needed.values())  # and some are read again from the middle

    reads = {}
    for request in served_proxy.calls("GET", "/_target/v1/objects/"):
        shard = int(re.search(r"train-(\d+)\.tar", request.path).group(1))
        assert shard not in reads, f"shard {shard} read twice"
        reads[shard] = json.loads(request.query["etl_args"][0]).get("skip", 0)
    assert not set(reads) & done
    assert {s: skip for s, skip in reads.items() if s in needed} == needed  # the pod was asked to skip
    assert set(reads) - set(needed) == set(range(SHARDS)) - done - set(needed)  # the rest: fresh, from the start
    assert transformed <= sum(PER_SHARD - skip for skip in reads.values())  # the pod skipped them
    assert transformed < SHARDS * PER_SHARD


def test_the_prefetcher_saves_the_state_of_the_last_batch_it_handed_out(served_proxy: FakeProxy) -> None:
    urls = seeded_urls(served_proxy, shards=3)
    whole = list(loader_of(urls))
    prefetcher = CudaPrefetcher(loader_of(urls), normalize=False)
    batches = iter(prefetcher)
    head = [next(batches) for _ in range(2)]
    state = json.loads(json.dumps(prefetcher.state_dict()))
    assert state["batches"] == 2
    again = CudaPrefetcher(loader_of(urls), normalize=False)
    again.load_state_dict(state)
    rest = list(again)
    assert [b[2] for b in head + rest] == [b[2] for b in whole]
    assert again.state_dict()["epoch"] == 2  # the epoch is over: the next one from its start


def test_the_dali_source_resumes_with_the_same_arrays(served_proxy: FakeProxy) -> None:
    from transformer.client.dali import EtlBatchSource

    urls = seeded_urls(served_proxy, shards=3)

    def source():
        return EtlBatchSource(urls, 4, keys=("npy", "cls"), random_shuffle=True, initial_fill=5, seed=6,
                              pad_last_batch=True)

    whole = list(source())
    first = source()
    batches = iter(first)
    head = [next(batches) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["stream"]["buffer"] and 0 < state["stream"]["taken"] < PER_SHARD
    again = source()
    again.load_state_dict(state)
    got = head + list(again)
    assert len(got) == len(whole) == 4
    for (images, labels), (expected_images, expected_labels) in zip(got, whole):
        assert [int(x) for x in labels] == [int(x) for x in expected_labels]
        assert all(np.array_equal(a, b) for a, b in zip(images, expected_images))


def test_epoch_urls_give_each_epoch_its_state(served_proxy: FakeProxy) -> None:
    urls = seeded_urls(served_proxy, shards=2)
    loader = loader_of(urls)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["workers"] == []
    list(loader)
    state = loader.state_dict()
    assert state["epoch"] == 2 and state["batches"] == 0
    assert get_etl_args(urls(2)[0])["epoch"] == 2
    other = loader_of(urls, epoch=5)
    other.load_state_dict(state)  # the fingerprint is of the state's epoch's URLs
    assert other.epoch == 2
    other.set_epoch(3)  # another epoch, from its start: the loaded state is dropped
    assert other.state_dict()["epoch"] == 3


# ---- states that are refused (local shards: no service needed) ------------------------------------------


@pytest.fixture
def local_state(tmp_path: Path) -> tuple[list[str], dict]:
    urls = write_shards(tmp_path, 4, 5)
    loader = make_loader(urls, 3, keys=KEYS, num_workers=2, shuffle_buffer=4, seed=3)
    batches = iter(loader)
    next(batches)
    next(batches)
    return urls, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize(("change", "named"), [
    ({"seed": 4}, r"seed \(saved 3, this loader 4\)"),
    ({"batch_size": 4}, r"batch_size \(saved 3, this loader 4\)"),
    ({"num_workers": 1}, r"workers \(saved 2, this loader 1\)"),
    ({"shuffle_buffer": 8}, r"shuffle_buffer \(saved 4, this loader 8\)"),
    ({"last_batch": "drop"}, r"last_batch \(saved 'partial', this loader 'drop'\)"),
    ({"keys": ("npy", "cls")}, r"keys \(saved \['npy', 'cls', '__key__'\], this loader \['npy', 'cls'\]\)"),
    ({"epoch_batches": 5}, r"epoch_batches \(saved None, this loader 5\)"),
    ({"seed": 4, "batch_size": 2}, r"seed \(saved 3, this loader 4\); batch_size \(saved 3, this loader 2\)"),
])
def test_another_configuration_is_refused_naming_each_difference(local_state, change: dict, named: str) -> None:
    urls, state = local_state
    options = {"keys": KEYS, "num_workers": 2, "shuffle_buffer": 4, "seed": 3, "batch_size": 3, **change}
    loader = make_loader(urls, options.pop("batch_size"), **options)
    with pytest.raises(LoaderStateError, match=f"refusing a loader state made with another configuration: {named}"):
        loader.load_state_dict(state)
    assert loader.state_dict()["batches"] == 0  # nothing applied


def test_other_urls_are_refused(local_state, tmp_path: Path) -> None:
    urls, state = local_state
    (tmp_path / "other").mkdir()
    for others in (urls[:3], urls[::-1], write_shards(tmp_path / "other", 4, 5)):
        with pytest.raises(LoaderStateError, match=r"urls \(the epoch's 4 shard URLs were saved"):
            make_loader(others, 3, keys=KEYS, num_workers=2, shuffle_buffer=4, seed=3).load_state_dict(state)


def test_the_endpoint_may_change_but_not_the_objects_or_etl_args() -> None:
    from transformer.client.epoch import urls_digest

    a = ["http://proxy-1:8080/v1/objects/b/s.tar?provider=ais&etl_name=wds-etl"]
    assert urls_digest(a) == urls_digest(["https://proxy-2:51080/v1/objects/b/s.tar?provider=ais&etl_name=wds-etl"])
    assert urls_digest(a) != urls_digest(["http://proxy-1:8080/v1/objects/b/t.tar?provider=ais&etl_name=wds-etl"])
    assert urls_digest(a) != urls_digest([a[0] + "&etl_args=%7B%22seed%22%3A1%7D"])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update(format="ais-wds-loader-state/0"), "an older format .*'ais-wds-loader-state/0'"),
    (lambda s: s.update(format="ais-wds-loader-state/7"), "a newer format"),
    (lambda s: s.pop("format"), "not a loader state: no 'format'"),
    (lambda s: s.update(format="something-else/1"), "not a loader state: format 'something-else/1'"),
    (lambda s: s.update(kind="EtlBatchSource"), "a state of 'EtlBatchSource', not of 'make_loader'"),
    (lambda s: s.update(batches=-1), "'batches' is not a non-negative integer"),
    (lambda s: s.update(next_worker=2), "next_worker 2 is not one of 2 workers"),
    (lambda s: s["workers"][0].update(buffer=[[0, 1]]), r"worker \d: buffer entry \[0, 1\] is not"),
    (lambda s: s["workers"][0].update(buffer=[[9, 1, "k"]]), r"buffer entry \[9, 1, 'k'\] is not"),
    (lambda s: s["workers"][0].update(draws="3"), "'draws' is not a non-negative integer"),
    (lambda s: s["workers"].append(dict(s["workers"][0])), "or one twice"),
    (lambda s: s["workers"][0].update(open=[3, 0]), r"'open' is not a list of 2 row counts below 3"),
    (lambda s: s["workers"][0].update(open=[0, 0], buffer=[[0, 1, "k"]]), "'open' counts 0 rows, 'buffer' names 1"),
    (lambda s: s["workers"][0].update(buffer=[[0, 1, "k"]] * 7), "'buffer' is not a list of at most 6 samples"),
    (lambda s: s["config"].update(extra=1), "unknown fields extra"),
])
def test_a_state_of_another_format_or_a_broken_one_is_refused(local_state, edit, message: str) -> None:
    urls, state = local_state
    edit(state)
    loader = make_loader(urls, 3, keys=KEYS, num_workers=2, shuffle_buffer=4, seed=3)
    with pytest.raises(LoaderStateError, match=message):
        loader.load_state_dict(state)


def test_a_state_is_json_and_small(local_state) -> None:
    _, state = local_state
    assert state["format"] == "ais-wds-loader-state/2" and state["kind"] == "make_loader"
    assert set(state) == {"format", "kind", "epoch", "batches", "passes", "next_worker", "workers", "config"}
    assert [w["worker"] for w in state["workers"]] == [0, 1] and state["next_worker"] == 0
    assert set(state["workers"][0]) == {"worker", "batches", "shard", "taken", "last", "ended", "draws", "buffer",
                                        "open"}
    assert len(json.dumps(state)) < 2000


def test_after_the_last_batch_of_a_fixed_length_epoch_the_state_is_the_next_epoch(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 4, 5)

    def loader():
        return make_loader(urls, 3, keys=KEYS, num_workers=2, shuffle_buffer=4, seed=3, epoch_batches=4)

    first = loader()
    batches = iter(first)
    for _ in range(4):
        next(batches)
    state = first.state_dict()  # the generator has not seen the end yet: the count says it is over
    assert (state["epoch"], state["batches"], state["workers"]) == (1, 0, [])
    full = loader()
    full.load_state_dict(first.state_at(first._progress))  # epoch 0, its count already at the length
    assert list(full) == [] and full.epoch == 1
