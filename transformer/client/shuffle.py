"""Shuffle shards with AIS dSort (seed article 1): records stay whole, shards are re-cut at random.

The job spec is built with the SDK's ``DsortFramework`` (``POST /v1/sort``), the job is waited for
(``GET /v1/sort?uuid=``) and the output shards are listed. Input and output formats are dSort
templates *without* the extension (``train-{000..018}`` + ``.tar``), as in ``ais start dsort``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ShuffleError

if TYPE_CHECKING:
    from aistore.sdk import Client
    from aistore.sdk.dsort.framework import DsortFramework

log = logging.getLogger("transformer.client")


@dataclass(frozen=True)
class ShuffleResult:
    job_id: str
    bucket: str
    shards: list[str]  # output object names, sorted


def dsort_framework(
    bucket: str,
    inputs: str | Sequence[str],
    output_format: str,
    *,
    output_bucket: str | None = None,
    extension: str = ".tar",
    output_shard_size: str = "100MB",
    seed: int | str | None = None,
    provider: str = "ais",
    description: str = "shuffle WebDataset shards",
) -> DsortFramework:
    """The SDK's dSort job for a seeded shuffle of ``inputs`` (a template or object names);
    ``.to_spec()`` is the JSON that ``POST /v1/sort`` carries."""
    from aistore.sdk.dsort.framework import DsortAlgorithm, DsortFramework, DsortShardsGroup
    from aistore.sdk.multiobj import ObjectNames, ObjectRange
    from aistore.sdk.types import BucketModel

    def strip(name: str) -> str:
        return name[: -len(extension)] if extension and name.endswith(extension) else name

    if isinstance(inputs, str):
        if "{" not in inputs:
            raise ShuffleError(f"input template {inputs!r} has no brace range; pass a list of names instead")
        input_format = ObjectRange.from_string(strip(inputs))
    else:
        if not inputs:
            raise ShuffleError("no input shards to shuffle")
        input_format = ObjectNames([strip(name) for name in inputs])
    try:
        output = ObjectRange.from_string(strip(output_format))
    except ValueError:
        raise ShuffleError(
            f"output format {output_format!r} needs a brace range, e.g. shuffled-{{0000..9999}}"
        ) from None
    return DsortFramework(
        input_shards=DsortShardsGroup(BucketModel(name=bucket, provider=provider), "input", input_format, extension),
        output_shards=DsortShardsGroup(
            BucketModel(name=output_bucket or bucket, provider=provider), "output", output, extension
        ),
        algorithm=DsortAlgorithm(kind="shuffle", seed="" if seed is None else str(seed)),
        description=description,
        output_shard_size=output_shard_size,
    )


def shuffle_shards(
    client: Client,
    bucket: str,
    inputs: str | Sequence[str],
    output_format: str,
    *,
    output_bucket: str | None = None,
    extension: str = ".tar",
    output_shard_size: str = "100MB",
    seed: int | str | None = None,
    timeout: int = 600,
) -> ShuffleResult:
    """Run a seeded dSort shuffle, wait for it, and list the output shards."""
    framework = dsort_framework(bucket, inputs, output_format, output_bucket=output_bucket, extension=extension,
                                output_shard_size=output_shard_size, seed=seed)
    spec = framework.to_spec()
    dsort = client.dsort()
    job_id = dsort.start(framework)
    log.info("dSort job %s started: %s -> %s", job_id, spec["input_format"], spec["output_format"])
    result = dsort.wait(timeout=timeout, verbose=False)
    if not result.success:
        raise ShuffleError(f"dSort job {job_id} did not finish: {result.error or 'aborted'}")
    output = output_bucket or bucket
    prefix = output_format.split("{", 1)[0]
    names = sorted(entry.name for entry in client.bucket(output).list_all_objects(prefix=prefix)
                   if entry.name.endswith(extension))
    if not names:
        raise ShuffleError(f"dSort job {job_id} finished but {output}/{prefix}* holds no {extension} shard")
    return ShuffleResult(job_id=job_id, bucket=output, shards=names)

