"""The DALI feeder: its generator logic without DALI, and a real CPU-only DALI pipeline when installed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transformer.client import LoaderStateError
from transformer.client.dali import EtlBatchSource

from .test_loader import write_shards

try:
    import nvidia.dali as dali
except ImportError:  # the tests of EtlBatchSource need no DALI
    dali = None
needs_dali = pytest.mark.skipif(dali is None, reason="DALI (the dali extra) is not installed")


def test_batch_source_shuffles_each_sample_once_seeded(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 5, 20)

    def labels(seed: int, fill: int) -> list[int]:
        source = EtlBatchSource(urls, 7, keys=("npy", "cls"), random_shuffle=True, initial_fill=fill, seed=seed)
        return [int(label) for _, batch in source for label in batch]

    first = labels(1, 16)
    assert sorted(first) == list(range(100))  # each sample once, the last batch partial
    assert first == labels(1, 16) and first != labels(2, 16) and first != sorted(first)
    assert sorted(labels(1, 500)) == list(range(100))  # a buffer larger than the epoch
    plain = [int(label) for _, batch in EtlBatchSource(urls, 7, keys=("npy", "cls")) for label in batch]
    assert plain == list(range(100))
    with pytest.raises(ValueError, match="initial_fill"):
        EtlBatchSource(urls, 4, random_shuffle=True, initial_fill=0)


def test_batch_source_epochs_shards_and_padding(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 4, 5)
    source = EtlBatchSource(urls, 6, keys=("npy", "cls"), random_shuffle=True, initial_fill=8, seed=3,
                            pad_last_batch=True)
    first = [int(label) for batch in source for label in batch[1]]
    second = [int(label) for batch in source for label in batch[1]]
    assert len(first) == len(second) == 24  # 20 samples padded to 4 batches of 6
    assert sorted(set(first)) == sorted(set(second)) == list(range(20))
    assert first != second  # each iter() is a new epoch with a new shuffle
    halves = [{int(label) for batch in EtlBatchSource(urls, 4, shard_id=i, num_shards=2) for label in batch[1]}
              for i in range(2)]
    assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(20))
    image, label = next(iter(EtlBatchSource(urls, 2)))
    assert image[0].shape == (3, 4, 4) and label[0].dtype == np.int64 and label[0].shape == ()


def source_of(urls: list[str], **kwargs) -> EtlBatchSource:
    options = {"keys": ("npy", "cls"), "random_shuffle": True, "initial_fill": 6, "seed": 2, "pad_last_batch": True,
               **kwargs}
    return EtlBatchSource(urls, 4, **options)


def labels_of(batches) -> list[list[int]]:
    return [[int(label) for label in labels] for _, labels in batches]


@pytest.mark.parametrize("stop", [1, 3, 5])
def test_batch_source_resumes_mid_epoch(tmp_path: Path, stop: int) -> None:
    urls = write_shards(tmp_path, 4, 5)
    whole = labels_of(source_of(urls))
    assert len(whole) == 5 and len(whole[-1]) == 4  # 20 samples, the last batch padded
    source = source_of(urls)
    batches = iter(source)
    head = labels_of(next(batches) for _ in range(stop))
    state = json.loads(json.dumps(source.state_dict()))
    assert state["kind"] == "EtlBatchSource" and state["batches"] == stop and state["epoch"] == 0
    resumed = source_of(urls)
    resumed.load_state_dict(state)
    assert head + labels_of(resumed) == whole
    assert resumed.epoch == 1 and resumed.state_dict()["batches"] == 0  # the next epoch, from its start


def test_batch_source_holds_the_states_of_its_last_batches(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 3, 5)
    source = source_of(urls)
    batches = iter(source)
    for _ in range(3):
        next(batches)
    assert source.state_dict(epoch=0, batches=1)["batches"] == 1
    assert source.state_dict(epoch=0, batches=0)["stream"] is None  # the epoch's start
    with pytest.raises(ValueError, match="batch 7 of epoch 0 is not held"):
        source.state_dict(epoch=0, batches=7)
    with pytest.raises(ValueError, match="give epoch and batches"):
        source.state_dict(epoch=0)
    other = source_of(urls, shard_id=1, num_shards=2)
    with pytest.raises(LoaderStateError, match=r"shard_id \(saved 0, this loader 1\); num_shards"):
        other.load_state_dict(source.state_dict())


def build(urls: list[str], batch_size: int, **kwargs):
    import nvidia.dali.fn as fn

    from transformer.client.dali import read_etl_shards

    @dali.pipeline_def(batch_size=batch_size, num_threads=1, device_id=None)  # CPU-only mode: no GPU needed
    def pipeline():
        images, labels = read_etl_shards(urls, keys=("npy", "cls"), **kwargs)
        return fn.cast(images, dtype=dali.types.FLOAT) * 2, labels

    pipe = pipeline()
    pipe.build()
    return pipe


def run_epoch(pipe) -> list[tuple[np.ndarray, int]]:
    seen = []
    for _ in range(100):  # bounded: an epoch here is a handful of batches
        try:
            images, labels = pipe.run()
        except StopIteration:
            return seen
        seen += [(np.array(images[i]), int(np.array(labels[i]))) for i in range(len(labels))]
    raise AssertionError("cycle='raise' never ended the epoch")


@needs_dali
def test_dali_pipeline_raise_ends_each_epoch(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 3, 5)
    pipe = build(urls, 4, random_shuffle=True, initial_fill=6, seed=1, cycle="raise")
    first = run_epoch(pipe)
    assert sorted(label for _, label in first) == list(range(15))
    assert all(np.array_equal(image, np.full((3, 4, 4), 2.0 * label, np.float32)) for image, label in first)
    pipe.reset()
    second = run_epoch(pipe)
    assert sorted(label for _, label in second) == list(range(15))
    assert [label for _, label in first] != [label for _, label in second]


@needs_dali
def test_dali_pipeline_pads_the_last_batch_and_quiet_cycles(tmp_path: Path) -> None:
    urls = write_shards(tmp_path, 1, 6)
    padded = build(urls, 4, pad_last_batch=True, cycle="raise")
    sizes = []
    for _ in range(5):
        try:
            sizes.append(len(padded.run()[1]))
        except StopIteration:
            break
    assert sizes == [4, 4]  # 6 samples padded to 8
    quiet = build(urls, 4, pad_last_batch=True, cycle="quiet")
    labels = []
    for _ in range(4):
        _, batch = quiet.run()
        labels += [int(np.array(batch[i])) for i in range(len(batch))]
    assert labels == [0, 1, 2, 3, 4, 5, 5, 5] * 2  # epochs follow each other without StopIteration


@needs_dali
def test_dali_pipeline_resumes_from_the_state_of_the_last_batch_it_returned(tmp_path: Path) -> None:
    import nvidia.dali.fn as fn

    urls = write_shards(tmp_path, 3, 5)

    def pipe_of(source: EtlBatchSource):
        @dali.pipeline_def(batch_size=4, num_threads=1, device_id=None)
        def pipeline():
            return tuple(fn.external_source(source=source, num_outputs=2, batch=True, cycle="raise"))

        pipe = pipeline()
        pipe.build()
        return pipe

    whole = [label for _, label in run_epoch(pipe_of(source_of(urls)))]
    source = source_of(urls)
    pipe = pipe_of(source)
    head = []
    for _ in range(2):
        _, labels = pipe.run()
        head += [int(np.array(labels[i])) for i in range(len(labels))]
    assert source.state_dict()["batches"] >= 2  # DALI asks for batches ahead of the ones run() returned
    state = json.loads(json.dumps(source.state_dict(epoch=0, batches=2)))
    fresh = source_of(urls)
    fresh.load_state_dict(state)
    assert head + [label for _, label in run_epoch(pipe_of(fresh))] == whole
