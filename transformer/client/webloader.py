"""The webdataset way: a ``wds.WebLoader`` with its fluid interface over ETL'd shards, read whole.

For training code written against webdataset (``WebDataset(urls).shuffle(...).decode().to_tuple(...)``
then ``WebLoader(...).unbatched().shuffle(...).batched(...)``): ``etl_dataset(urls)`` stands where
``wds.WebDataset(urls)`` stood and is the same kind of object (a ``DataPipeline`` with the fluid
interface), but reads each shard with ``reading.tarfile_to_whole_samples``: the end marker is checked,
a cut read is fetched again and continued, and a shard still cut is an error naming it (webdataset's
own tar reader takes many cuts for a shorter shard). ``web_loader`` builds the whole loader.

What this path does not do: exact resume (webdataset keeps no position; ``make_loader`` does), and
reading ``.npy`` straight into batch tensors (samples reach ``.decode()`` as bytes, as webdataset's
stages expect them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import webdataset as wds

from .loader import DEFAULT_KEYS
from .reading import tarfile_to_whole_samples

Handler = Callable[[BaseException], bool]


class EtlWebDataset(wds.DataPipeline, wds.FluidInterface):
    """``wds.WebDataset(urls)``'s pipeline head over ETL'd shards, read whole.

    URLs (a list, or webdataset's brace notation in one string) -> split by node (``RANK``/``WORLD_SIZE``
    or ``torch.distributed``) -> split by DataLoader worker -> a seeded shuffle of each worker's
    shards (``shardshuffle``: the buffer size; 0 or False: in order) -> each shard read whole. With
    ``resampled`` shards are drawn with replacement forever (use ``.with_epoch(n)``). Errors go to
    ``handler`` (webdataset's: ``wds.reraise_exception`` by default; an ``ErrorCounter`` counts and skips).
    """

    def __init__(self, urls: str | Sequence[str], *, shardshuffle: int | bool = False, seed: int = 0,
                 resampled: bool = False, handler: Handler = wds.reraise_exception, retries: int = 2,
                 require_marker: bool = True, timeout: tuple[float, float] = (10.0, 300.0),
                 nodesplitter: Callable[..., Any] | None = wds.split_by_node,
                 workersplitter: Callable[..., Any] | None = wds.split_by_worker):
        super().__init__()
        urls = list(wds.shardlists.expand_urls(urls)) if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("etl_dataset: no shard URLs")
        if resampled:
            self.append(wds.ResampledShards(urls, seed=seed, deterministic=True))
        else:
            self.append(wds.SimpleShardList(urls))
            if nodesplitter is not None:
                self.append(nodesplitter)
            if workersplitter is not None:
                self.append(workersplitter)
            if shardshuffle:
                self.append(wds.shuffle(100 if shardshuffle is True else int(shardshuffle), seed=seed))
        self.append(tarfile_to_whole_samples(handler=handler, retries=retries, require_marker=require_marker,
                                             timeout=timeout))


def etl_dataset(urls: str | Sequence[str], **kwargs: Any) -> EtlWebDataset:
    """``wds.WebDataset(urls)`` for ETL'd shards: the same fluid interface, shards read whole (see
    ``EtlWebDataset`` for the options)."""
    return EtlWebDataset(urls, **kwargs)


def web_loader(urls: str | Sequence[str], batch_size: int, *, keys: Sequence[str] = DEFAULT_KEYS,
               num_workers: int = 2, shuffle_buffer: int = 1000, shardshuffle: int | bool = 100, seed: int = 0,
               handler: Handler = wds.reraise_exception, retries: int = 2, require_marker: bool = True,
               timeout: tuple[float, float] = (10.0, 300.0), resampled: bool = False,
               **loader_kwargs: Any) -> wds.WebLoader:
    """A ``wds.WebLoader`` of ``(images, labels, ...)`` batches built in its workers, as the webdataset
    articles build one: ``etl_dataset(urls).shuffle(shuffle_buffer).decode().to_tuple(*keys)
    .batched(batch_size)`` in ``WebLoader(..., batch_size=None, num_workers=num_workers)``.

    The fluid interface goes on from there (``.unbatched().shuffle(1000).batched(64)``, ``.map(...)``,
    ``.with_epoch(n)``). Pass an ``ErrorCounter`` as ``handler`` to count and skip errors instead of
    raising. Extra keyword arguments go to the ``DataLoader`` (``pin_memory``, ``prefetch_factor``, ...).
    """
    if batch_size < 1:
        raise ValueError("web_loader: batch_size must be at least 1")
    dataset = etl_dataset(urls, shardshuffle=shardshuffle, seed=seed, resampled=resampled, handler=handler,
                          retries=retries, require_marker=require_marker, timeout=timeout)
    if shuffle_buffer > 1:
        dataset = dataset.shuffle(shuffle_buffer)
    dataset = dataset.decode(handler=handler).to_tuple(*keys, handler=handler).batched(batch_size)
    return wds.WebLoader(dataset, batch_size=None, num_workers=num_workers, **loader_kwargs)
