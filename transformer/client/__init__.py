"""The training side: register the ETL, list ETL'd shard URLs, load batches, prefetch to the GPU.

Imports none of the server's dependencies (FastAPI, uvicorn, torchvision); the ``client`` extra is
torch, webdataset and the aistore SDK. DALI (``transformer.client.dali``) is optional and imported
only when a DALI pipeline is built.

Modules: ``etlspec`` (EtlSettings, name checks, obj_timeout, runtime spec YAML), ``registration``
(register/unregister, AIS's errors), ``urls`` (etl_args, shard and pod URLs), ``reading`` (whole
shards: end marker checked, a cut one continued, ``.npy`` read in one copy), ``stream`` (one
resumable stream of samples), ``epoch`` (an epoch's shard order, ErrorCounter), ``batchmemory``
(batch memory filled again once let go), ``batching`` (samples read into batch rows, the shuffle),
``resume`` (a loader's saved state and its checks), ``loader`` (make_loader), ``webloader`` (the
webdataset way: ``web_loader``, ``etl_dataset``, a ``wds.WebLoader`` over whole shards),
``prefetch`` (CudaPrefetcher), ``convert`` (folder datasets -> shards in a bucket), ``shuffle``
(dSort), ``offline`` (an ETL'd copy of a bucket, job errors, pod logs), ``download`` (links fetched
and transformed by the pods, stored in a bucket), ``dali`` (external_source feeder).

``__all__`` is what a training job uses (docs/client.md); each module's own names (the helpers
under these, job records, the wire's encoders) are imported from that module.
"""

from ..errors import IncompleteShard
from .convert import convert
from .download import download
from .epoch import ErrorCounter
from .errors import (
    ClientError,
    EtlRequestError,
    EtlSpecMismatch,
    IncompleteCopy,
    LoaderStateError,
    OfflineOptionsMismatch,
    SampleError,
    ShardFetchError,
    SharedMemoryError,
    ShuffleError,
)
from .etlspec import EtlSettings, obj_timeout_for, runtime_spec_yaml
from .loader import make_loader
from .offline import etl_logs, transform_bucket
from .prefetch import CudaPrefetcher
from .reading import whole_shard_samples
from .registration import register, unregister
from .shuffle import shuffle_shards
from .urls import EpochUrls, etl_args, shard_urls
from .webloader import etl_dataset, web_loader

__all__ = [
    "ClientError",
    "CudaPrefetcher",
    "EpochUrls",
    "ErrorCounter",
    "EtlRequestError",
    "EtlSettings",
    "EtlSpecMismatch",
    "IncompleteCopy",
    "IncompleteShard",
    "LoaderStateError",
    "OfflineOptionsMismatch",
    "SampleError",
    "ShardFetchError",
    "SharedMemoryError",
    "ShuffleError",
    "convert",
    "download",
    "etl_args",
    "etl_dataset",
    "etl_logs",
    "make_loader",
    "obj_timeout_for",
    "register",
    "runtime_spec_yaml",
    "shard_urls",
    "shuffle_shards",
    "transform_bucket",
    "unregister",
    "web_loader",
    "whole_shard_samples",
]
