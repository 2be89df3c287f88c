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
