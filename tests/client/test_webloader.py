"""The webdataset way: the articles' ``WebLoader`` code pointed at ETL'd URLs, over HTTP, reads shards
whole (``etl_dataset`` where ``wds.WebDataset`` stood, or ``web_loader``) and refuses a cut shard."""

from __future__ import annotations

import pytest
import torch
import webdataset as wds

from transformer.client import ErrorCounter, etl_dataset, web_loader
from transformer.client.webloader import EtlWebDataset

from .conftest import SAMPLES
from .test_whole_shards import TARGET_ERROR, members_of

LABELS = list(range(SAMPLES))  # the whole shard's labels: sample i has label i


def test_the_articles_webloader_code_reads_etl_urls(whole: bytes, served) -> None:
    server = served({f"/s-{i}.tar": [whole] for i in range(3)})
    urls = [f"{server.url}/s-{i}.tar" for i in range(3)]
    # The articles' code, with etl_dataset(urls) where wds.WebDataset(urls) stood.
    dataset = etl_dataset(urls, shardshuffle=100).shuffle(1000).decode().to_tuple("npy", "cls").batched(4)
    assert isinstance(dataset, EtlWebDataset) and isinstance(dataset, wds.FluidInterface)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    loader = loader.unbatched().shuffle(1000).batched(5).map(lambda batch: (batch[0].float() / 255, batch[1]))
    labels = []
    for images, classes in loader:
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 32, 32)
        labels += classes.tolist()
    assert sorted(labels) == sorted(LABELS * 3)


def test_web_loader_builds_the_same_loader(whole: bytes, served) -> None:
    server = served({f"/s-{i}.tar": [whole] for i in range(2)})
    loader = web_loader([f"{server.url}/s-{i}.tar" for i in range(2)], 4, keys=("npy", "cls"), num_workers=2)
    assert isinstance(loader, wds.WebLoader)
    labels = [label for _, classes in loader.unbatched().shuffle(10).batched(3) for label in classes.tolist()]
    assert sorted(labels) == sorted(LABELS * 2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cut_shard_is_an_error_naming_it_never_a_shorter_shard(whole: bytes, served, workers: int) -> None:
    cut = whole[:members_of(whole)[6].offset] + TARGET_ERROR  # 3 samples, then the target's error
    server = served({"/whole.tar": [whole], "/cut.tar": [cut]})
    urls = [server.url + "/whole.tar", server.url + "/cut.tar"]
    # Stock webdataset takes it for a shorter shard (tests/client/test_whole_shards.py); this raises.
    loader = web_loader(urls, 4, keys=("npy", "cls"), num_workers=workers, retries=0, shardshuffle=False)
    with pytest.raises(Exception, match=r"/cut\.tar'?: incomplete, 2 samples received"):
        for _ in loader.unbatched().shuffle(1000).batched(4):
            pass
    # Counted and skipped: one error for the shard; the samples before the cut arrived once.
    errors = ErrorCounter(log_first=0)
    loader = web_loader(urls, 4, keys=("npy", "cls"), num_workers=workers, retries=0, shardshuffle=False,
                        handler=errors)
    labels = [label for _, classes in loader for label in classes.tolist()]
    assert errors.count == 1 and sorted(labels) == sorted(LABELS + LABELS[:2])


def test_a_cut_read_is_continued_by_the_webloader_too(whole: bytes, served) -> None:
    cut = whole[:members_of(whole)[7].offset + 100] + TARGET_ERROR
    server = served({"/s.tar": [cut, whole]})
    loader = web_loader([server.url + "/s.tar"], 4, keys=("npy", "cls"), num_workers=0, shardshuffle=False,
                        shuffle_buffer=0)
    assert [label for _, classes in loader for label in classes.tolist()] == LABELS
    assert server.hits["/s.tar"] == 2
