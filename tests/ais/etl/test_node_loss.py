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
import requests
from aistore.sdk.errors import AISError
from aistore.sdk.etl import ETLConfig

from testbed.shardgen import read_output
from transformer.client import IncompleteCopy, register, transform_bucket, unregister
from transformer.client.offline import wait_transform

from .conftest import owner_of, put_shards, settings
from .test_register import stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl, pytest.mark.k8s]
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}  # what settings() registers
OBJ_TIMEOUT = 60  # settings()' obj_timeout, in seconds
LOST = "node-1"  # node-0 holds the control plane and AIS's proxy


def read_through(client, bucket: str, name: str, etl: str | None) -> tuple[str, float]:
    """'whole' (the end marker checked) or the error's text, and the seconds it took."""
    started = time.monotonic()
    reader = client.bucket(bucket).object(name).get_reader(etl=ETLConfig(etl) if etl else None)
    try:
        data = reader.read_all()
    except (AISError, requests.RequestException) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    if etl:
        read_output(data)  # a shard that looks whole must be whole: its end marker says so
    return "whole", time.monotonic() - started


def test_a_node_lost_mid_job_fails_by_name_spares_the_other_node_and_the_etl_starts_again(etl_client, etl_cluster):
    name, lost = "node-loss", next(i for i, target in enumerate(etl_cluster.targets) if target.node == LOST)
    register(etl_client, name, settings("hpush"))
    try:
        shards = put_shards(etl_client, "loss-src", [f"loss-{i:03d}.tar" for i in range(200)], 4)
        owners = {shard: owner_of(etl_cluster, "loss-src", shard) for shard in shards}
        kept = [shard for shard, owner in owners.items() if owner != lost]
        on_disk = {shard: (etl_cluster.mountpaths[1 - lost] / "@ais" / "loss-src" / "%ob" / shard).read_bytes()
                   for shard in kept}
        job = transform_bucket(etl_client, name, "loss-src", "loss-dst", options=OPTIONS, wait=False)
        time.sleep(1)
        etl_cluster.lose_node(LOST)

        for shard in (next(s for s in shards if owners[s] == lost), kept[0]):  # one object on each node
            outcome, seconds = read_through(etl_client, "loss-src", shard, name)
            assert outcome != "whole" and shard in outcome and seconds < OBJ_TIMEOUT, (shard, outcome, seconds)
        with pytest.raises(IncompleteCopy) as caught:  # the job names what is not in the destination
            wait_transform(etl_client, job, timeout=300)
        assert caught.value.missing and not caught.value.cut, caught.value
        for entry in etl_client.bucket("loss-dst").list_all_objects():  # what was stored is whole
            read_output(etl_client.bucket("loss-dst").object(entry.name).get_reader().read_all())
        for shard in kept:  # node-0's objects, read plainly, are what was put; its disk is as it was
            assert read_through(etl_client, "loss-src", shard, None)[0] == "whole"
            assert etl_client.bucket("loss-src").object(shard).get_reader().read_all() == shards[shard]
            assert (etl_cluster.mountpaths[1 - lost] / "@ais" / "loss-src" / "%ob" / shard).read_bytes() \
                == on_disk[shard]
        assert stage(etl_client, name) == "Aborted"

        etl_cluster.bring_back(LOST)
        assert not register(etl_client, name, settings("hpush")).created and stage(etl_client, name) == "Running"
        pods = etl_cluster.kube.running_pods(name)
        assert sorted(pod.node for pod in pods) == sorted(target.node for target in etl_cluster.targets)
        done = transform_bucket(etl_client, name, "loss-src", "loss-dst-again", options=OPTIONS, timeout=600)
        assert done.success and not done.object_errors and done.verified == len(shards), done
    finally:
        unregister(etl_client, name)
