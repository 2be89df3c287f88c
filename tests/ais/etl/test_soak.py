"""bench/soak_ais.py for 20 seconds through the package's cluster: an ETL of its own read inline and
copied offline, hostile shards among the good ones, one of its pods killed and the ETL started again.
Nothing lost or wrong, every error naming its shard, the kill recovered, AIS's stages seen; and the
package's shared ETLs, their pods and the cluster's buckets as they were.

The 30-minute run and its bounds are in docs/reliability.md; here the /health and growth bounds are
reported, not required: a 20-second run on shared CI cores says little about either.
"""

from __future__ import annotations

import pytest

from bench.soak_ais import Soak
from bench.soak_plan import Options
from testbed.etl_cluster import EtlCluster

from .test_register import stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]


def test_soak_through_ais_loses_nothing_when_a_pod_is_killed(etl_client, etl_cluster: EtlCluster,
                                                             etls: dict[str, str], tmp_path) -> None:
    shared = {name: sorted((pod.name, pod.pid) for pod in etl_cluster.kube.running_pods(name))
              for name in etls.values()}
    buckets = sorted(bucket.name for bucket in etl_client.cluster().list_buckets())
    options = Options(duration=20, warm_up=3, settle=2, kill_every=600, quiet_every=600, shards=2, samples=3,
                      offline_every=3, patience=120, comms=("hpush",), prefix="smoke")
    soak = Soak(etl_cluster, etl_client, options, tmp_path, progress=lambda line: None)
    try:
        report = soak.run()
    finally:
        soak.teardown()
    criteria = report["criteria"]
    for held in ("samples_delivered_none_lost_or_wrong", "every_error_names_its_shard", "every_kill_recovered",
                 "no_error_while_the_etl_is_up", "every_aisnode_stayed_up", "every_worker_ran_and_drained"):
        assert criteria[held], (held, report["reads"]["examples"], report["offline"], report["failures"],
                                report["aisnode_exits"])
    samples, reads = report["samples"], report["reads"]
    assert samples["delivered"] > 0 and samples["lost"] == 0 and samples["wrong"] == 0
    assert set(reads["shards_refused"]) == {"hostile-not-a-tar.tar", "hostile-cut-header.tar",
                                            "hostile-cut-member.tar", "hostile-broken-images.tar@fail"}
    assert report["offline"]["copies"] >= 1 and report["offline"]["objects_whole"] >= 1
    (kill,) = report["kills"]
    assert kill["etl"] == "smoke-hpush" and kill["aborted_s"] is not None and kill["recovered"]
    seen = [(old, new) for _, etl, old, new in report["stage_transitions"] if etl == "smoke-hpush"]
    assert seen[:2] == [("Running", "Aborted"), ("Aborted", "Initializing")] and seen[-1] == ("Initializing",
                                                                                             "Running")
    assert report["health"]["probes_while_up"] > 0 and report["health"]["failures_while_up"] == 0
    assert {"proxy", "target1", "target2"} <= set(report["processes"])
    assert set(report["aisnode_panics_recovered"]) == {"proxy", "target1", "target2"}
    assert [q["label"] for q in report["quiet_points"]] == ["warm-up", "end"]
    # The package's ETLs and the cluster as they were: same pods, Running; the soak's ETL and buckets gone.
    assert {name: sorted((pod.name, pod.pid) for pod in etl_cluster.kube.running_pods(name))
            for name in etls.values()} == shared
    assert all(stage(etl_client, name) == "Running" for name in etls.values())
    assert stage(etl_client, "smoke-hpush") == ""
    etl_cluster.kube.wait(lambda: not etl_cluster.kube.pods_of("smoke-hpush"), 30, "the soak's pods deleted")
    assert sorted(bucket.name for bucket in etl_client.cluster().list_buckets()) == buckets
