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
"""

from ..cli import measure_seconds_per_image
from ..integrity import IncompleteShard
from ..wire import path_escape
from .convert import ConvertReport, convert
from .dali import EtlBatchSource, read_etl_shards
from .download import DownloadJob, download, wait_download
from .epoch import ErrorCounter
from .errors import (
    ClientError,
    ConvertError,
    EtlNameError,
    EtlRequestError,
    EtlSpecMismatch,
    IncompleteCopy,
    LoaderStateError,
    SampleError,
    ShardFetchError,
    SharedMemoryError,
    ShuffleError,
)
from .etlspec import EtlSettings, obj_timeout_for, runtime_spec_yaml, validate_name
from .incremental import Changes, find_changes
from .loader import EtlLoader, make_loader
from .offline import (
    OfflineJob,
    OfflineOptionsMismatch,
    check_offline_options,
    etl_logs,
    object_errors,
    transform_bucket,
    wait_transform,
)
from .prefetch import CudaPrefetcher, PrefetchStats
from .reading import open_shard, shard_samples, tarfile_to_whole_samples, whole_shard_samples
from .registration import Registration, register, unregister
from .shuffle import ShuffleResult, dsort_framework, shuffle_shards
from .stream import ResumeError
from .urls import EpochUrls, encode_etl_args, etl_args, pod_urls, set_etl_args, shard_urls
from .webloader import EtlWebDataset, etl_dataset, web_loader

__all__ = [
    "Changes",
    "ClientError",
    "ConvertError",
    "ConvertReport",
    "CudaPrefetcher",
    "DownloadJob",
    "EpochUrls",
    "ErrorCounter",
    "EtlBatchSource",
    "EtlLoader",
    "EtlNameError",
    "EtlRequestError",
    "EtlSettings",
    "EtlSpecMismatch",
    "EtlWebDataset",
    "IncompleteCopy",
    "LoaderStateError",
    "OfflineJob",
    "OfflineOptionsMismatch",
    "PrefetchStats",
    "Registration",
    "ResumeError",
    "SampleError",
    "ShardFetchError",
    "SharedMemoryError",
    "ShuffleError",
    "ShuffleResult",
    "check_offline_options",
    "download",
    "convert",
    "dsort_framework",
    "encode_etl_args",
    "etl_args",
    "etl_dataset",
    "etl_logs",
    "find_changes",
    "make_loader",
    "measure_seconds_per_image",
    "obj_timeout_for",
    "object_errors",
    "open_shard",
    "IncompleteShard",
    "shard_samples",
    "tarfile_to_whole_samples",
    "whole_shard_samples",
    "path_escape",
    "pod_urls",
    "read_etl_shards",
    "register",
    "runtime_spec_yaml",
    "set_etl_args",
    "shard_urls",
    "shuffle_shards",
    "transform_bucket",
    "unregister",
    "validate_name",
    "wait_download",
    "wait_transform",
    "web_loader",
]
