"""bench/through_ais.py, small: every case runs through the real cluster and reports its figures."""

from __future__ import annotations

import pytest

from bench.through_ais import CASES, markdown, measure
from testbed.etl_cluster import EtlCluster

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]


def test_through_ais_bench_measures_every_case(etl_client, etl_cluster: EtlCluster) -> None:
    # 64 images a case: about 90 ms of pod CPU (1.4 ms an image, bench/results/through-ais), so /proc's
    # 10 ms ticks cannot round a case's pod CPU down to 0 (6 images, about 9 ms, could).
    result = measure(etl_cluster, etl_client, shards=2, samples=32, rounds=1, progress=lambda line: None)
    assert [row["case"] for row in result["rows"]] == list(CASES)
    for row in result["rows"]:
        assert row["images_per_s"] > 0 and row["pod_cpu_ms_per_image"] > 0, row
    assert "| inline-hpush |" in markdown(result)


def test_sync_rerun_bench_reads_no_object_but_the_ledger(etl_client, etl_cluster: EtlCluster) -> None:
    from bench.sync_rerun import ETL, TRANSFORMS
    from bench.sync_rerun import markdown as sync_markdown
    from bench.sync_rerun import measure as sync_measure
    from testbed.etl_cluster import settings
    from transformer.client import register, unregister

    register(etl_client, ETL, settings("hpush", transforms=TRANSFORMS))
    try:
        result = sync_measure(etl_cluster, etl_client, shards=30, rounds=1, progress=lambda line: None)
    finally:
        unregister(etl_client, ETL)
    rerun = next(row for row in result["rows"] if row["case"] == "rerun")
    # nothing changed: the listings and one small object, the ledger; no tail, no probe, no PUT, no transform
    assert rerun["get_count"] == 1 and rerun["get_bytes"] == result["ledger_bytes"] and rerun["tail_reads"] == 0
    assert rerun["put_count"] == 0 and rerun["pod_transforms"] == 0 and rerun["list_count"] >= 2
    changed = next(row for row in result["rows"] if row["case"] == "one-changed")
    assert changed["pod_transforms"] == 1 and changed["stale"] == 1
    assert "| rerun |" in sync_markdown(result, "header")
