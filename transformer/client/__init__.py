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
(dSort), ``offline`` (an ETL'd copy of a bucket), ``copy_options`` (what a copy is made with, checked),
``jobs`` (AIS's jobs: waiting, their per-object errors, the pods' logs), ``whole_copy`` (a copy
proven whole from its tails), ``incremental`` (what of a copy is stale, orphans), ``ledger`` (the
markers of a copy already read), ``listing`` (listings with AIS's rebalance flag), ``download`` (links
fetched and transformed by the pods, stored in a bucket), ``sync`` (``wds-transform sync``'s work),
``dali`` (external_source feeder).

``__all__`` is what a training job uses (docs/client.md); each module's own names (the helpers
under these, job records, the wire's encoders) are imported from that module. The names the package
exported before it held only ``__all__`` still resolve, from their module, with a DeprecationWarning.
"""

import sys
import warnings

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
from .jobs import etl_logs
from .loader import make_loader
from .offline import transform_bucket
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

# Names once exported here, now imported from their module: each resolves lazily, with a warning.
_MOVED = {
    "Changes": "transformer.client.incremental",
    "ConvertError": "transformer.client.errors",
    "ConvertReport": "transformer.client.convert",
    "DownloadJob": "transformer.client.download",
    "EtlBatchSource": "transformer.client.dali",
    "EtlLoader": "transformer.client.loader",
    "EtlNameError": "transformer.client.errors",
    "EtlWebDataset": "transformer.client.webloader",
    "OfflineJob": "transformer.client.offline",
    "PrefetchStats": "transformer.client.prefetch",
    "Registration": "transformer.client.registration",
    "ResumeError": "transformer.client.errors",
    "ShuffleResult": "transformer.client.shuffle",
    "check_offline_options": "transformer.client.copy_options",
    "dsort_framework": "transformer.client.shuffle",
    "encode_etl_args": "transformer.client.urls",
    "find_changes": "transformer.client.incremental",
    "measure_seconds_per_image": "transformer.apply",
    "object_errors": "transformer.client.jobs",
    "open_shard": "transformer.client.reading",
    "path_escape": "transformer.client.urls",
    "pod_urls": "transformer.client.urls",
    "read_etl_shards": "transformer.client.dali",
    "set_etl_args": "transformer.client.urls",
    "shard_samples": "transformer.client.reading",
    "tarfile_to_whole_samples": "transformer.client.reading",
    "validate_name": "transformer.client.etlspec",
    "wait_download": "transformer.client.download",
    "wait_transform": "transformer.client.offline",
}


def __getattr__(name: str) -> object:
    """An old name, from the module that holds it now, with a DeprecationWarning naming that module."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"'from transformer.client import {name}' is deprecated: use 'from {module} import {name}'",
                  DeprecationWarning, stacklevel=2)
    # Imported by name in code, never by a string: the package imports no module a caller names.
    if module == "transformer.apply":
        from .. import apply as home
    elif module == "transformer.client.dali":
        from . import dali as home
    elif module == "transformer.client.incremental":
        from . import incremental as home
    else:
        home = sys.modules[module]  # imported above, with the names of __all__
    return getattr(home, name)
