"""What the contract fakes claim about AIS, checked once against the real target: the hpull 307 redirect to
``hostIP:nodePort``, a two-ETL pipeline inline and offline (the hops), and no ETL secret in any pod log as AIS
shows it (``secret_last.py`` checks every pod's whole log again once the package's tests are done)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
import requests

from testbed.etl_cluster import EtlCluster
from testbed.shardgen import read_output
from transformer.client import etl_logs, register, shard_urls, transform_bucket, unregister

from .conftest import put_shards, settings

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
SHARDS = [f"c-{i:03d}.tar" for i in range(6)]
OPTIONS = {"preset": "imagenet-val", "dtype": "uint8", "seed": 7}


@pytest.fixture(scope="module")
def pair(etl_client, etls: dict[str, str]):
    """The package's ETLs (A = its hpush one) and a second hpush ETL, B, to follow A in a pipeline."""
    put_shards(etl_client, "contract-src", SHARDS, 4)
    names = {"a": etls["hpush"], "b": "pipe-b", "pull": etls["hpull"], "ws": etls["ws"]}
    register(etl_client, names["b"], settings("hpush", env={"ETL_LOG_LEVEL": "debug"}))
    yield names
    unregister(etl_client, names["b"])


def test_hpull_inline_read_is_a_307_to_the_pod_on_the_targets_node(etl_client, etl_cluster: EtlCluster, pair) -> None:
    (url,) = shard_urls(etl_client, "contract-src", pair["pull"], names=[SHARDS[0]])
    first = requests.get(url, allow_redirects=False, timeout=30)  # the proxy sends the reader to a target
    assert first.status_code in (301, 307), first.status_code
    second = requests.get(first.headers["Location"], allow_redirects=False, timeout=30)
    assert second.status_code == 307, second.status_code
    pods = {(pod.host, pod.port) for pod in etl_cluster.kube.pods_of(pair["pull"])}
    location = urlsplit(second.headers["Location"])
    assert (location.hostname, location.port) in pods  # status.hostIP : the service's nodePort
    assert "etl_fqn=" in location.query
    read_output(requests.get(second.headers["Location"], timeout=60).content)


def test_pipeline_inline_and_offline(etl_client, pair) -> None:
    """A >> B: the target sends A the object and B's address (Ais-Node-Url); A's output goes to B."""
    (alone,) = shard_urls(etl_client, "contract-src", pair["a"], names=[SHARDS[1]])
    (piped,) = shard_urls(etl_client, "contract-src", pair["a"], names=[SHARDS[1]], pipeline=[pair["b"]])
    single = requests.get(alone, timeout=60).content
    both = requests.get(piped, timeout=60).content
    assert read_output(both) == read_output(single)  # B passes A's arrays and labels through byte-exact
    job = transform_bucket(etl_client, pair["a"], "contract-src", "contract-piped", options=OPTIONS,
                           pipeline=[pair["b"]], timeout=300)
    assert job.success and not job.object_errors and job.verified == len(SHARDS), job  # B's end markers
    for shard in SHARDS:
        data = etl_client.bucket("contract-piped").object(shard).get_reader().read_all()
        assert read_output(data), shard


def test_no_secret_in_any_pod_log(etl_client, etl_cluster: EtlCluster, pair) -> None:
    """After inline reads (hpush: the size check on the target; hpull; ws), an offline copy with direct puts
    and a pipeline, no log line of any pod holds its ETL secret or its full AIS_TARGET_URL (read through
    AIS, as ``ais etl view-logs`` shows them)."""
    for comm in ("a", "pull", "ws"):
        for url in shard_urls(etl_client, "contract-src", pair[comm], prefix=""):
            read_output(requests.get(url, timeout=60).content)
    transform_bucket(etl_client, pair["ws"], "contract-src", "contract-ws-copy", options=OPTIONS, timeout=300)
    transform_bucket(etl_client, pair["a"], "contract-src", "contract-a-copy", options=OPTIONS, timeout=300)
    for name in pair.values():
        target_url = pod_env(etl_cluster.kube.pods_of(name)[0])["AIS_TARGET_URL"]
        secret = target_url.rsplit("/", 1)[1]
        assert re.fullmatch(r"[\w-]{6,}", secret), target_url
        logs = etl_logs(etl_client, name)
        assert len(logs) == 2, name
        for target, text in logs.items():
            assert secret not in text, f"ETL {name}: the secret is in the log of the pod on {target}"
            assert target_url not in text
        if name != pair["b"]:  # B gets its input from A, never from a target: it has nothing to log here
            # the pods did log the requests that carry the secret (the size check on each etl_fqn), masked
            assert any(f"/v1/etl/_object/{name}/***" in text for text in logs.values()), name


def test_without_fqn_the_pod_gets_the_object_from_the_real_target(etl_client, etl_cluster: EtlCluster, pair) -> None:
    """With AIS's feature flag Do-not-Allow-Passing-FQN-to-ETL, hpush sends the object as the request body and
    an hpull pod GETs it from its target's ETL object route (``AIS_TARGET_URL``, the secret in its path): the
    same bytes as with ``etl_fqn``, and the fetch is logged with the secret masked, never raw."""
    before = {comm: [requests.get(url, timeout=60).content
                     for url in shard_urls(etl_client, "contract-src", pair[comm], names=SHARDS[:2])]
              for comm in ("a", "pull")}
    set_features(etl_client, "128")  # feat.DontAllowPassingFQNtoETL = 1 << 7 (cmn/feat/feat.go)
    try:
        for comm in ("a", "pull"):
            urls = shard_urls(etl_client, "contract-src", pair[comm], names=SHARDS[:2])
            if comm == "pull":  # the redirect no longer carries etl_fqn
                first = requests.get(urls[0], allow_redirects=False, timeout=30)
                second = requests.get(first.headers["Location"], allow_redirects=False, timeout=30)
                assert "etl_fqn=" not in second.headers["Location"], second.headers["Location"]
            assert [requests.get(url, timeout=60).content for url in urls] == before[comm], comm
    finally:
        set_features(etl_client, "0")
    logs = "\n".join(etl_logs(etl_client, pair["pull"]).values())
    for pod in etl_cluster.kube.pods_of(pair["pull"]):
        target_url = pod_env(pod)["AIS_TARGET_URL"]
        assert target_url.rsplit("/", 1)[1] not in logs and target_url not in logs, f"pod {pod.name}: secret logged"
    assert " DEBUG httpcore." in logs, logs[-2000:]  # the pods log at DEBUG: the fetch's traces were there to check
    assert re.search(r"HTTP Request: GET http://\S+/v1/etl/_object/etl-hpull/\*\*\*/ais%2F@%23%2Fcontract-src%2Fc-00[01]"
                     r"\.tar \"HTTP/1.1 200 OK\"", logs), logs[-2000:]


def pod_env(pod) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod.obj["spec"]["containers"][0]["env"]}


def set_features(client, value: str) -> None:
    client._request_client.request("PUT", path="cluster", json={"action": "set-config", "value": {"features": value}})
