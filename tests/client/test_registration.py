"""Registration against the fake AIS proxy: the init message, idempotency, replace, unregister, YAML."""

from __future__ import annotations

import pytest
import requests
import yaml

from testbed.fake_proxy import FakeProxy
from transformer.client import EtlSettings, EtlSpecMismatch, obj_timeout_for, register, runtime_spec_yaml, unregister
from transformer.client.errors import EtlNameError
from transformer.client.registration import validate_name

IMAGE = "registry.local/ais-wds-transformer:0.1.0"


@pytest.mark.parametrize(
    ("name", "reason"),
    [("short", "too short"), ("x" * 33, "too long"), ("Wds-etl", "lowercase"), ("-wds-etl", "start and end"),
     ("wds_etl", "lowercase"), ("wds-etl-", "start and end")],
)
def test_names_ais_refuses_are_refused(name: str, reason: str) -> None:
    with pytest.raises(EtlNameError, match=reason):
        validate_name(name)


@pytest.mark.parametrize("name", ["wds-etl", "a" * 32, "etl-224", "123456"])
def test_names_ais_accepts_are_accepted(name: str) -> None:
    assert validate_name(name) == name


def test_obj_timeout_rule() -> None:
    assert obj_timeout_for(1000) == "45s"  # 1000 x 4 ms x 4 = 16 s: the SDK's 45 s floor
    assert obj_timeout_for(10_000) == "160s"  # 10000 x 4 ms x safety 4
    assert obj_timeout_for(10_000, 0.004, workers=2, concurrent_shards=4) == "320s"  # pool shared by 4 shards
    assert obj_timeout_for(5000, 0.002, workers=8, reader_images_per_second=100) == "200s"  # a slow reader rules
    assert obj_timeout_for(100, 0.001, safety=1, minimum=1) == "1s"  # rounded up, never 0
    with pytest.raises(ValueError):
        obj_timeout_for(0)


def test_settings_derive_the_timeout_and_the_pod_environment() -> None:
    settings = EtlSettings(image=IMAGE, images_per_shard=20_000, seconds_per_image=0.003, workers=4,
                           dtype="uint8", seed=7, env={"ETL_MAX_IMAGE_PIXELS": "16000000"})
    assert settings.effective_obj_timeout == "60s"  # 20000 x 3 ms / 4 workers x 4
    assert settings.environment() == {
        "ETL_PRESET": "imagenet-train", "ETL_DTYPE": "uint8", "ETL_LAYOUT": "CHW", "ETL_ON_ERROR": "skip",
        "ETL_SEED": "7", "ETL_WORKERS": "4", "ETL_OBJ_TIMEOUT": "60s", "ETL_MAX_IMAGE_PIXELS": "16000000"}
    with pytest.raises(ValueError, match="unknown service variable ETL_WINDOW"):
        EtlSettings(image=IMAGE, env={"ETL_WINDOW": "16"})
    with pytest.raises(ValueError, match="through its own field"):
        EtlSettings(image=IMAGE, env={"ETL_DTYPE": "uint8"})
    with pytest.raises(ValueError, match="ws:// requires direct_put"):
        EtlSettings(image=IMAGE, comm_type="ws", direct_put=False)
    with pytest.raises(ValueError, match="dtype"):
        EtlSettings(image=IMAGE, dtype="int8")


def test_register_sends_the_init_message_through_the_sdk(ais, proxy: FakeProxy) -> None:
    settings = EtlSettings(image=IMAGE, comm_type="hpull", preset="imagenet-val", obj_timeout="2m")
    result = register(ais, "wds-etl", settings)
    assert result.created and result.job_id == proxy.etls["wds-etl"].xaction
    (init,) = proxy.calls("PUT", "/v1/etl")
    assert init.body == settings.init_message("wds-etl")
    assert init.body["communication"] == "hpull://" and init.body["obj_timeout"] == "2m"
    assert init.body["runtime"] == {"image": IMAGE, "env": [
        {"name": "ETL_PRESET", "value": "imagenet-val"}, {"name": "ETL_DTYPE", "value": "float32"},
        {"name": "ETL_LAYOUT", "value": "CHW"}, {"name": "ETL_ON_ERROR", "value": "skip"},
        {"name": "ETL_OBJ_TIMEOUT", "value": "2m"}]}


def test_register_waits_for_ais_past_init_timeout_rather_than_sending_the_init_again(ais, proxy: FakeProxy,
                                                                                   monkeypatch) -> None:
    """AIS answers an init after its pods are ready or it gave up, which is later than init_timeout: a client
    that stops waiting at init_timeout sends the init again and AIS refuses it as already existing."""
    from transformer.client import registration

    monkeypatch.setattr(registration, "INIT_REPLY_MARGIN_S", 3.0)
    proxy.init_seconds = 1.5
    result = register(ais, "wds-slow", EtlSettings(image=IMAGE, init_timeout="1s"))
    assert result.created and len(proxy.calls("PUT", "/v1/etl")) == 1


def test_register_is_idempotent_for_the_same_spec(ais, proxy: FakeProxy) -> None:
    settings = EtlSettings(image=IMAGE, obj_timeout="60s")
    register(ais, "wds-etl", settings)
    again = register(ais, "wds-etl", settings)  # AIS echoes obj_timeout as "1m0s": same value, same spec
    assert not again.created
    assert len(proxy.calls("PUT", "/v1/etl")) == 1


def test_register_starts_a_stopped_etl_with_the_same_spec(ais, proxy: FakeProxy) -> None:
    settings = EtlSettings(image=IMAGE)
    register(ais, "wds-etl", settings).etl.stop()
    assert proxy.etls["wds-etl"].stage == "Aborted"
    assert not register(ais, "wds-etl", settings).created
    assert proxy.etls["wds-etl"].stage == "Running"
    assert len(proxy.calls("POST", "/v1/etl/wds-etl/start")) == 1


def test_a_stopped_etl_with_another_spec_is_refused_and_left_stopped(ais, proxy: FakeProxy) -> None:
    # AIS answers a stopped ETL's details with 404: register starts it to read its spec, then stops it again
    register(ais, "wds-etl", EtlSettings(image=IMAGE)).etl.stop()
    with pytest.raises(EtlSpecMismatch, match="env ETL_DTYPE"):
        register(ais, "wds-etl", EtlSettings(image=IMAGE, dtype="uint8"))
    assert proxy.etls["wds-etl"].stage == "Aborted"
    assert register(ais, "wds-etl", EtlSettings(image=IMAGE, dtype="uint8"), replace=True).created
    assert proxy.etls["wds-etl"].message == EtlSettings(image=IMAGE, dtype="uint8").init_message("wds-etl")


def test_unregister_removes_a_stopped_etl(ais, proxy: FakeProxy) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE)).etl.stop()
    assert unregister(ais, "wds-etl") is True
    assert "wds-etl" not in proxy.etls


def test_register_refuses_a_different_spec_unless_replacing(ais, proxy: FakeProxy) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE))
    changed = EtlSettings(image=IMAGE, dtype="uint8")
    with pytest.raises(EtlSpecMismatch, match="env ETL_DTYPE: running 'float32', wanted 'uint8'") as info:
        register(ais, "wds-etl", changed)
    assert set(info.value.differences) == {"env ETL_DTYPE"}
    result = register(ais, "wds-etl", changed, replace=True)
    assert result.created
    order = [(r.method, r.path) for r in proxy.requests if r.method != "GET"]
    assert order == [("PUT", "/v1/etl"), ("POST", "/v1/etl/wds-etl/stop"), ("DELETE", "/v1/etl/wds-etl"),
                     ("PUT", "/v1/etl")]
    assert proxy.etls["wds-etl"].message == changed.init_message("wds-etl")


def test_resources_go_in_the_same_message(ais, proxy: FakeProxy) -> None:
    resources = {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"cpu": "8", "memory": "8Gi"}}
    settings = EtlSettings(image=IMAGE, workers=8, resources=resources, command=["wds-transform", "serve"])
    register(ais, "wds-etl", settings)
    (init,) = proxy.calls("PUT", "/v1/etl")
    assert init.body == settings.init_message("wds-etl")
    assert init.body["resources"] == resources and init.body["runtime"]["command"] == ["wds-transform", "serve"]


def test_the_fake_proxy_reports_the_whole_init_message_as_ais_does(ais, proxy: FakeProxy) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE, direct_put=False, obj_timeout="60s"))
    reported = requests.get(f"{proxy.url}/v1/etl/wds-etl", timeout=10).json()["init_msg"]
    assert "support_direct_put" not in reported  # Go's omitempty drops false
    assert reported["resources"] == {}  # a Go struct: never omitted
    assert reported["obj_timeout"] == "1m0s" and reported["init_timeout"] == "5m0s"
    assert reported["runtime"] == EtlSettings(image=IMAGE, obj_timeout="60s").init_message("wds-etl")["runtime"]
    resources = {"requests": {"cpu": "0.5", "memory": "1024Mi"}, "limits": {"cpu": "2", "memory": "1.5Gi"}}
    register(ais, "other-etl", EtlSettings(image=IMAGE, resources=resources))
    reported = requests.get(f"{proxy.url}/v1/etl/other-etl", timeout=10).json()["init_msg"]
    assert reported["support_direct_put"] is True
    assert reported["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                     "limits": {"cpu": "2", "memory": "1536Mi"}}


@pytest.mark.parametrize("running, wanted", [(True, False), (False, True)])
def test_register_compares_support_direct_put(ais, proxy: FakeProxy, running: bool, wanted: bool) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE, direct_put=running))
    with pytest.raises(EtlSpecMismatch, match=f"support_direct_put: running {running}, wanted {wanted}") as info:
        register(ais, "wds-etl", EtlSettings(image=IMAGE, direct_put=wanted))
    assert set(info.value.differences) == {"support_direct_put"}
    assert len(proxy.calls("PUT", "/v1/etl")) == 1


def test_register_compares_resources_field_by_field(ais, proxy: FakeProxy) -> None:
    running = {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"cpu": "8", "memory": "8Gi"}}
    register(ais, "wds-etl", EtlSettings(image=IMAGE, resources=running))
    wanted = {"requests": {"cpu": "4"}, "limits": {"cpu": "6", "memory": "8Gi", "nvidia.com/gpu": "1"}}
    with pytest.raises(EtlSpecMismatch, match="resources limits.cpu: running '8', wanted '6'") as info:
        register(ais, "wds-etl", EtlSettings(image=IMAGE, resources=wanted))
    assert info.value.differences == {"resources limits.cpu": ("8", "6"),
                                      "resources limits.nvidia.com/gpu": (None, "1"),
                                      "resources requests.memory": ("4Gi", None)}
    with pytest.raises(EtlSpecMismatch) as info:
        register(ais, "wds-etl", EtlSettings(image=IMAGE))  # none asked for, where the ETL has some
    assert set(info.value.differences) == {"resources requests.cpu", "resources requests.memory",
                                           "resources limits.cpu", "resources limits.memory"}
    result = register(ais, "wds-etl", EtlSettings(image=IMAGE, resources=wanted), replace=True)
    assert result.created


def test_register_takes_equal_quantities_written_differently_as_the_same(ais, proxy: FakeProxy) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE, resources={"requests": {"cpu": "0.5", "memory": "1024Mi"}}))
    # AIS reports them as 500m and 1Gi (K8s's canonical form).
    again = register(ais, "wds-etl", EtlSettings(image=IMAGE, resources={"requests": {"cpu": "500m",
                                                                                      "memory": "1Gi"}}))
    assert not again.created
    assert len(proxy.calls("PUT", "/v1/etl")) == 1


def test_unregister_stops_and_deletes(ais, proxy: FakeProxy) -> None:
    register(ais, "wds-etl", EtlSettings(image=IMAGE))
    assert unregister(ais, "wds-etl") is True
    assert "wds-etl" not in proxy.etls
    assert unregister(ais, "wds-etl") is False
    with pytest.raises(EtlNameError, match="not a registered ETL"):
        unregister(ais, "wds-etl", missing_ok=False)


def test_runtime_spec_yaml_is_the_init_message(proxy: FakeProxy) -> None:
    settings = EtlSettings(image=IMAGE, comm_type="ws", transforms=[{"Resize": {"size": 256}}, "CenterCrop"],
                           resources={"limits": {"cpu": "2"}})
    text = runtime_spec_yaml("wds-etl", settings)
    spec = yaml.safe_load(text)
    assert spec == settings.init_message("wds-etl")
    assert {"name": "ETL_TRANSFORMS", "value": '[{"Resize":{"size":256}},"CenterCrop"]'} in spec["runtime"]["env"]
    # What `ais etl init -f` would send is accepted by the proxy as an init message.
    response = requests.put(f"{proxy.url}/v1/etl", json=spec, timeout=10)
    assert response.status_code == 200, response.text
    assert proxy.etls["wds-etl"].message == settings.init_message("wds-etl")


def test_fake_proxy_flags_a_message_ais_would_misread(proxy: FakeProxy) -> None:
    """The contract checks can fail: an unknown field (AIS ignores it silently) is a 400 and a problem."""
    message = EtlSettings(image=IMAGE).init_message("wds-etl") | {"argument": "fqn"}
    response = requests.put(f"{proxy.url}/v1/etl", json=message, timeout=10)
    assert response.status_code == 400 and "argument" in response.text
    assert proxy.problems
    proxy.problems.clear()


def test_ais_refusals_become_etl_request_errors_with_the_clusters_message() -> None:
    from aistore.sdk.errors import AISError

    from transformer.client import EtlRequestError
    from transformer.client.registration import ais_errors

    body = ('{"message":"use ETL in a build without ETL support","method":"PUT","url_path":"/v1/etl",'
            '"node":"p[xyz]","status":501}')
    with pytest.raises(EtlRequestError) as failure, ais_errors("wds-etl", "registration"):
        raise AISError(501, body, "http://10.0.0.1:51080/v1/etl", None)
    error = failure.value
    assert (error.status, error.node, error.ais_message) == (501, "p[xyz]", "use ETL in a build without ETL support")
    assert str(error).startswith("ETL 'wds-etl': registration at http://10.0.0.1:51080 failed (HTTP 501 from "
                                 "p[xyz]): use ETL in a build without ETL support. This aisnode was built without")
    assert error.cannot_run_etl
    with pytest.raises(EtlRequestError) as other, ais_errors("wds-etl", "registration"):
        raise AISError(409, "etl wds-etl already exists", "http://10.0.0.1:51080/v1/etl", None)
    assert str(other.value) == ("ETL 'wds-etl': registration at http://10.0.0.1:51080 failed (HTTP 409): "
                                "etl wds-etl already exists")
    assert not other.value.cannot_run_etl
