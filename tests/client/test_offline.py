"""Offline transforms against the fake proxy: an ETL'd copy of a bucket made by a pod started with the ETL's own
environment (AIS passes no etl_args to offline jobs), the options check, job errors, pod logs, pipeline URLs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from tests.shardgen import read_output
from transformer.client import (
    EtlSettings,
    OfflineOptionsMismatch,
    check_offline_options,
    etl_logs,
    object_errors,
    register,
    shard_urls,
    transform_bucket,
)

from .conftest import labelled_shard
from .fake_proxy import FakeProxy

if TYPE_CHECKING:
    from tests.contract.harness import Service

IMAGE = "registry.local/ais-wds-transformer:0.1.0"
VAL = EtlSettings(image=IMAGE, comm_type="hpush", transforms=[{"Resize": {"size": [16, 16]}}], dtype="uint8",
                  layout="HWC", obj_timeout="60s")
VAL_OPTIONS = {"transforms": [{"Resize": {"size": [16, 16]}}], "dtype": "uint8", "layout": "HWC"}


@pytest.fixture(scope="module")
def val_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """The pod AIS would start for the VAL ETL: the registered environment is all it knows."""
    from tests.contract.harness import base_env, start_transformer

    mountpath = tmp_path_factory.mktemp("offline-mountpath")
    env = base_env(**VAL.environment(), ETL_FQN_ROOTS=str(mountpath), ETL_WORKERS="2", ETL_LOG_LEVEL="warning")
    service = start_transformer("offline-val-pod", tmp_path_factory.mktemp("offline-logs"), env)
    yield service, mountpath
    service.stop()


@pytest.fixture
def val_proxy(val_pod: tuple[Service, Path]) -> Iterator[FakeProxy]:
    service, mountpath = val_pod
    with FakeProxy(mountpath, pod_url=service.url) as fake:
        yield fake
    assert fake.problems == [], fake.problems


def client_of(proxy: FakeProxy):
    from aistore.sdk import Client

    return Client(proxy.url, timeout=(2, 60))


def test_an_offline_copy_is_made_with_the_etls_own_settings(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    source = ais.bucket("imagenet").create()
    for i in range(2):
        source.object(f"val/shard-{i}.tar").get_writer().put_content(labelled_shard(4 * i, 4))
    source.object("val/broken.tar").get_writer().put_content(b"not a tar archive")
    source.object("train/shard-0.tar").get_writer().put_content(labelled_shard(100, 2))
    ais.bucket("imagenet-val").create()

    job = transform_bucket(ais, "wds-etl-val", "imagenet", "imagenet-val", options=VAL_OPTIONS, prefix="val/",
                           timeout=60)
    assert job.finished and job.success and job.error is None, job
    assert val_proxy.objects("imagenet-val") == ["val/shard-0.tar", "val/shard-1.tar"]  # the prefix only
    for i in range(2):
        members = read_output(val_proxy.fqn("imagenet-val", f"val/shard-{i}.tar").read_bytes())
        arrays = [np.load(__import__("io").BytesIO(data)) for name, data in members if name.endswith(".npy")]
        assert len(arrays) == 4 and all(a.shape == (16, 16, 3) and a.dtype == np.uint8 for a in arrays)
    (name, message), = job.object_errors  # continue on error: recorded, the job went on
    assert name == "val/broken.tar" and "not a tar archive" in message
    assert object_errors(ais, "wds-etl-val", job.job_id) == job.object_errors
    (start,) = [c for c in val_proxy.calls("POST", "/v1/buckets/imagenet") if c.body["action"] == "etl-bck"]
    assert start.body["value"]["id"] == "wds-etl-val" and "etl_args" not in str(start.body)


def test_options_the_etl_would_not_use_are_refused_before_any_job(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    assert check_offline_options(ais, "wds-etl-val", VAL_OPTIONS)["dtype"] == "uint8"
    with pytest.raises(OfflineOptionsMismatch) as failure:
        transform_bucket(ais, "wds-etl-val", "imagenet", "out", options={"preset": "imagenet-val", "dtype": "float32"})
    message = str(failure.value)
    assert "pipeline: the ETL uses \"'transforms'" in message
    assert "dtype: the ETL uses 'uint8', wanted 'float32'" in message
    assert "AIS passes no etl_args to offline transforms" in message
    assert "register(client, 'wds-etl-val-val'" in message
    assert val_proxy.calls("POST", "/v1/buckets/") == []  # nothing started
    with pytest.raises(ValueError, match="say which pipeline"):
        check_offline_options(ais, "wds-etl-val", {"dtype": "uint8"})
    with pytest.raises(ValueError, match="no epoch"):
        check_offline_options(ais, "wds-etl-val", {**VAL_OPTIONS, "epoch": 1})
    with pytest.raises(ValueError, match="unknown field 'size'"):
        check_offline_options(ais, "wds-etl-val", {**VAL_OPTIONS, "size": 1})
    with pytest.raises(Exception, match="is not registered"):
        check_offline_options(ais, "wds-etl-other", VAL_OPTIONS)


def test_defaults_count_as_the_etls_settings(val_proxy: FakeProxy, caplog: pytest.LogCaptureFixture) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-train", EtlSettings(image=IMAGE))  # imagenet-train, float32, CHW, no seed
    with caplog.at_level("WARNING", logger="transformer.client"):
        used = check_offline_options(ais, "wds-etl-train", {"preset": "imagenet-train", "dtype": "float32"})
    assert used == {"preset": "imagenet-train", "dtype": "float32", "layout": "CHW", "on_error": "skip", "seed": None}
    assert "one random draw" in caplog.text


def test_pod_logs(val_proxy: FakeProxy) -> None:
    ais = client_of(val_proxy)
    register(ais, "wds-etl-val", VAL)
    val_proxy.pod_logs = "INFO transformer: shard val/shard-0.tar: 4 samples\n"
    assert etl_logs(ais, "wds-etl-val") == {"t1": "INFO transformer: shard val/shard-0.tar: 4 samples\n"}


def test_pipeline_urls_carry_what_the_sdks_pipeline_sends(val_proxy: FakeProxy) -> None:
    from aistore.sdk.etl import ETLConfig

    ais = client_of(val_proxy)
    urls = shard_urls(ais, "imagenet", "wds-etl", names=["a.tar"], etl_args={"dtype": "uint8"},
                      pipeline=["wds-etl-next"])
    query = parse_qs(urlsplit(urls[0]).query)
    sdk: dict[str, str] = {}
    ETLConfig(ais.etl("wds-etl") >> ais.etl("wds-etl-next")).update_qparams(sdk)
    assert {k: v[0] for k, v in query.items() if k.startswith("etl_") and k != "etl_args"} == sdk
    assert query["etl_args"] == ['{"dtype":"uint8"}']
    with pytest.raises(ValueError, match="needs the first ETL"):
        shard_urls(ais, "imagenet", None, names=["a.tar"], pipeline=["wds-etl-next"])
