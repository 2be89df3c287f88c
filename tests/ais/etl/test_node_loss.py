"""A node lost in the middle of an offline job (``make test-k8s``): node-1's kubelet, containerd, kube-proxy and
every pod on it (an AIS target, the ETL's pod) killed at once, as a machine that loses power.

What a user must get: every read and the job end with errors that name the object, within the ETL's object
timeout, and nothing short that looks whole; the objects on node-0 are untouched; once node-1 is back (its
kubelet restarts its AIS target, which rejoins with its disk), the ETL starts again and a job completes.

What AIS 5.0 does meanwhile (seen here): until the proxy drops the lost target from its cluster map, reads of its
objects are sent to its node and fail to connect; then they are 404s from the other target. The lost target's
leaving aborts every ETL ("smap-changed"), the other node's pod is deleted, and an inline read through the
aborted ETL fails after AIS's retries to reach that pod. The target's return starts a rebalance, and AIS refuses
a new offline job until it ends.

The node-loss test runs last in the package (``conftest.py``): it aborts every ETL the package shares.
"""

from __future__ import annotations

import time

import pytest
from aistore.sdk.errors import ErrBckNotFound

from testbed.shardgen import read_output
from transformer.client import IncompleteCopy, register, shard_urls, transform_bucket, unregister
from transformer.client.errors import EtlRequestError, ShardFetchError
from transformer.client.offline import wait_transform
from transformer.client.reading import whole_shard_samples
from transformer.errors import IncompleteShard

from .conftest import owner_of, put_shards, settings
from .test_register import stage, wait_stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl, pytest.mark.k8s]
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what settings() registers
OBJ_TIMEOUT = 60  # settings()' obj_timeout, in seconds
LOST = "node-1"  # node-0 holds the control plane and AIS's proxy
SAMPLES = 4


def read_through(client, bucket: str, name: str, etl: str) -> tuple[str, float]:
    """A shard read through ``etl`` as training code reads it (``whole_shard_samples``: the end marker checked):
    'whole' with every sample, or the error's text; and the seconds it took."""
    (url,) = shard_urls(client, bucket, etl, names=[name])
    started = time.monotonic()
    try:
        samples = list(whole_shard_samples(url))
    except (ShardFetchError, IncompleteShard) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    assert len(samples) == SAMPLES, (name, len(samples))  # read whole, or not at all
    return "whole", time.monotonic() - started


def job_outcome(client, job) -> list[str]:
    """The objects a job that lost a node left in its destination, each proven whole. The client names what is
    not: the objects missing (``IncompleteCopy``), or the job itself when AIS no longer knows it (its 404 for
    a job whose listener it dropped, ``EtlRequestError``)."""
    with pytest.raises((IncompleteCopy, EtlRequestError)) as caught:
        wait_transform(client, job, timeout=300)
    if isinstance(caught.value, IncompleteCopy):
        assert caught.value.missing and not caught.value.cut, caught.value  # each stored copy was checked whole
    else:
        assert job.job_id in str(caught.value), caught.value
    bucket = client.bucket(job.destination)
    try:
        stored = [entry.name for entry in bucket.list_all_objects()]
    except ErrBckNotFound:  # nothing was stored
        return []
    for name in stored:
        read_output(bucket.object(name).get_reader().read_all())
    return stored


def test_a_node_lost_mid_job_fails_by_name_spares_the_other_node_and_the_etl_starts_again(etl_client, etl_cluster):
    name, lost = "node-loss", next(i for i, target in enumerate(etl_cluster.targets) if target.node == LOST)
    register(etl_client, name, settings("hpush"))
    try:
        shards = put_shards(etl_client, "loss-src", [f"loss-{i:03d}.tar" for i in range(200)], SAMPLES)
        owners = {shard: owner_of(etl_cluster, "loss-src", shard) for shard in shards}
        kept = [shard for shard, owner in owners.items() if owner != lost]
        on_disk = {shard: (etl_cluster.mountpaths[1 - lost] / "@ais" / "loss-src" / "%ob" / shard).read_bytes()
                   for shard in kept}
        job = transform_bucket(etl_client, name, "loss-src", "loss-dst", options=OPTIONS, wait=False)
        time.sleep(1)
        etl_cluster.lose_node(LOST)

        # an object of the lost node fails, naming it; one of the other node is read whole until AIS aborts the ETL,
        # then fails the same way: never late, never short
        outcome, seconds = read_through(etl_client, "loss-src", next(s for s in shards if owners[s] == lost), name)
        assert outcome != "whole" and "loss-src" in outcome and seconds < OBJ_TIMEOUT, (outcome, seconds)
        for shard in kept[:2]:
            outcome, seconds = read_through(etl_client, "loss-src", shard, name)
            assert (outcome == "whole" or shard in outcome) and seconds < OBJ_TIMEOUT, (shard, outcome, seconds)
        stored = job_outcome(etl_client, job)
        assert len(stored) < len(shards)
        for shard in kept:  # node-0's objects, read plainly, are what was put; its disk is as it was
            assert etl_client.bucket("loss-src").object(shard).get_reader().read_all() == shards[shard]
            assert (etl_cluster.mountpaths[1 - lost] / "@ais" / "loss-src" / "%ob" / shard).read_bytes() \
                == on_disk[shard]
        wait_stage(etl_client, name, "Aborted", timeout=120)  # once the proxy drops the lost target

        etl_cluster.bring_back(LOST)
        assert etl_cluster.cluster.nodes[LOST].alive()
        assert not register(etl_client, name, settings("hpush")).created and stage(etl_client, name) == "Running"
        pods = etl_cluster.kube.running_pods(name)
        assert sorted(pod.node for pod in pods) == sorted(target.node for target in etl_cluster.targets)
        done = transform_bucket(etl_client, name, "loss-src", "loss-dst-again", options=OPTIONS, timeout=600)
        assert done.success and not done.object_errors and done.verified == len(shards), done
    finally:
        if not etl_cluster.cluster.nodes[LOST].alive():  # the test failed half-way: the package still needs it
            etl_cluster.bring_back(LOST)
        unregister(etl_client, name)
