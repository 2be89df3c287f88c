"""Shuffle shards with AIS dSort: records stay whole, shards are re-cut at random.

The job spec is built with the SDK's ``DsortFramework`` (``POST /v1/sort``), the job is waited for
(``GET /v1/sort?uuid=``) and the output shards are listed. Input and output formats are dSort
templates *without* the extension (``train-{000..018}`` + ``.tar``), as in ``ais start dsort``;
input *names* are whole object names (AIS 5.0 appends the extension to template names only).

The seed fixes the permutation, not the output: AIS shuffles the records in the order its targets
extracted them, and input shards are extracted concurrently, so two runs with one seed may differ
(aisnode v1.5.0, ``ext/dsort/sort.go``). Without a seed AIS seeds with the current time.

dSort skips an input shard it cannot find when the cluster's ``distributed_sort.missing_shards``
is ``ignore`` (the default of AIS's deployments) and still reports success; ``shuffle_shards``
compares the shards the targets read with the shards it asked for, and raises when one is missing.

The spec names its dsorter (``dsorter_type``, ``dsort_general`` by default). Left out, AIS 5.0's
proxy picks one by asking every target for its memory over the intra-cluster control network
without the sender headers that network requires; the targets refuse, and the job fails to start
with ``stats.NodeStatus.Status: ReadString: expects " or n, but found 4`` (found against aisnode
v1.5.0). ``dsort_general`` is what AIS picks unless every target has more free memory than
``distributed_sort.dsorter_mem_threshold`` (100 GB by default); ``dsort_mem`` keeps the records in
memory.
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

DSORTERS = ("dsort_general", "dsort_mem")


@dataclass(frozen=True)
class ShuffleResult:
    job_id: str
    bucket: str
    shards: list[str]  # output object names, sorted
    input_shards: int | None = None  # read by the targets (None: the job's metrics did not say)
    members: int | None = None  # files (tar members, not samples) the targets extracted


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
    dsorter: str = "dsort_general",
) -> DsortFramework:
    """The SDK's dSort job for a seeded shuffle of ``inputs`` (a template or object names);
    ``.to_spec()`` is the JSON that ``POST /v1/sort`` carries, with ``dsorter_type`` (see the module)."""
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
        input_format = ObjectNames(list(inputs))
    try:
        output = ObjectRange.from_string(strip(output_format))
    except ValueError:
        raise ShuffleError(
            f"output format {output_format!r} needs a brace range, e.g. shuffled-{{0000..9999}}"
        ) from None
    if dsorter not in DSORTERS:
        raise ShuffleError(f"dsorter {dsorter!r} is not one of {', '.join(DSORTERS)}")

    class Framework(DsortFramework):
        # The SDK's framework has no dsorter_type; Dsort.start sends whatever to_spec returns.
        def to_spec(self) -> dict:
            return {**super().to_spec(), "dsorter_type": dsorter}

    return Framework(
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
    dsorter: str = "dsort_general",
) -> ShuffleResult:
    """Run a seeded dSort shuffle, wait for it, and list the output shards."""
    framework = dsort_framework(bucket, inputs, output_format, output_bucket=output_bucket, extension=extension,
                                output_shard_size=output_shard_size, seed=seed, dsorter=dsorter)
    spec = framework.to_spec()
    dsort = client.dsort()
    job_id = dsort.start(framework)
    log.info("dSort job %s started: %s -> %s", job_id, spec["input_format"], spec["output_format"])
    result = dsort.wait(timeout=timeout, verbose=False)
    if not result.success:
        raise ShuffleError(f"dSort job {job_id} did not finish: {result.error or 'aborted'}")
    asked, read, members = _extraction(dsort)
    if asked is not None and read is not None and read < asked:
        raise ShuffleError(f"dSort job {job_id} read {read} of its {asked} input shards: the others do not exist "
                           f"in {bucket} (AIS skips missing input shards when distributed_sort.missing_shards is "
                           "'ignore'); its output lacks their records")
    output = output_bucket or bucket
    prefix = output_format.split("{", 1)[0]
    names = sorted(entry.name for entry in client.bucket(output).list_all_objects(prefix=prefix)
                   if entry.name.endswith(extension))
    if not names:
        raise ShuffleError(f"dSort job {job_id} finished but {output}/{prefix}* holds no {extension} shard")
    return ShuffleResult(job_id=job_id, bucket=output, shards=names, input_shards=read, members=members)


def _extraction(dsort) -> tuple[int | None, int | None, int | None]:
    """(input shards asked for, input shards read, files extracted) from the job's per-target metrics.

    Every target walks the whole input list (``total_count``) and extracts the shards it holds
    (``extracted_count``); so the inputs asked for are the largest total, those read the sum.
    """
    try:
        jobs = dsort.get_job_info().values()
        totals = [int(job.metrics.local_extraction.total_count) for job in jobs]
        read = sum(int(job.metrics.local_extraction.extracted_count) for job in jobs)
        members = sum(int(job.metrics.local_extraction.extracted_record_count) for job in jobs)  # per file
    except Exception as exc:  # the check is an extra: never fail a finished job for its metrics
        log.warning("dSort job %s: no extraction metrics (%s); not checking for missing input shards",
                    dsort.dsort_id, exc)
        return None, None, None
    return (max(totals) if totals else None), read, members

