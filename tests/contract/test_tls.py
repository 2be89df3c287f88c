"""TLS from the pod to AIS targets: CA, skip-verify and a client certificate (mutual TLS).

A TLS cluster gives the pod an ``https://`` ``AIS_TARGET_URL``, and destination entries of
``Ais-Node-Url`` are https too. Here the fake target is also served over https by a server that
requires a client certificate signed by a throwaway CA (``testbed/tlscerts.py``): the pod's hpull fetch
and direct put must succeed with ``AIS_CRT`` + ``AIS_CRT_KEY`` and fail with a message that says what
to check without them. ``/download`` origins are any host: verified against the default bundle plus
``AIS_CLIENT_CA``, never with skip-verify, and never shown the AIS client certificate.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest

from testbed.fake_ais import AisDisk, FakeTarget, _Served
from testbed.service import Service, start_transformer
from testbed.shardgen import imagenet_like_members, make_tar
from testbed.tlscerts import TlsFiles, make_tls_files
from transformer.errors import UpstreamError
from transformer.server.hops import put_stream

from .conftest import transformer_env
from .harness import escaped_uname, fqn_query, uname
from .outputs import assert_transformed, image_shard

NODE_URL = "Ais-Node-Url"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def https_target(target: FakeTarget, tls_files: TlsFiles) -> Iterator[_Served]:
    """The fake target (same objects, same request log) also on https, client certificate required."""
    served = _Served(target, ssl_certfile=str(tls_files.server_cert), ssl_keyfile=str(tls_files.server_key),
                     ssl_ca_certs=str(tls_files.ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    served.start()
    yield served
    served.stop()


def https_env(target: FakeTarget, https_target: _Served, disk: AisDisk, **tls: str) -> dict[str, str]:
    return transformer_env(target, disk, AIS_TARGET_URL=f"{https_target.base_url}{target.etl_path}", **tls)


@pytest.fixture(scope="module")
def mtls_service(target: FakeTarget, https_target: _Served, tls_files: TlsFiles, disk: AisDisk,
                 logs: Path) -> Iterator[Service]:
    env = https_env(target, https_target, disk, AIS_CLIENT_CA=str(tls_files.ca), AIS_CRT=str(tls_files.client_cert),
                    AIS_CRT_KEY=str(tls_files.client_key))
    server = start_transformer("transformer-mtls", logs, env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_cert_service(target: FakeTarget, https_target: _Served, tls_files: TlsFiles, disk: AisDisk,
                    logs: Path) -> Iterator[Service]:
    env = https_env(target, https_target, disk, AIS_CLIENT_CA=str(tls_files.ca), ETL_OBJ_TIMEOUT="4s")
    server = start_transformer("transformer-tls-no-cert", logs, env)
    yield server
    server.stop()


def destination(https_target: _Served, name: str) -> str:
    return f"{https_target.base_url}/{escaped_uname('dst', name)}?owt=3&uuid=tcb-tls"


def test_hpull_fetch_over_mutual_tls(mtls_service: Service, target: FakeTarget) -> None:
    inputs = imagenet_like_members(2)
    target.objects[uname("src", "tls/pulled.tar")] = make_tar(inputs)
    response = httpx.get(f"{mtls_service.url}/{escaped_uname('src', 'tls/pulled.tar')}", timeout=60)
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)
    (fetch,) = target.recorded("GET")
    assert fetch.raw_path == f"{target.etl_path}/{escaped_uname('src', 'tls/pulled.tar')}"


def test_direct_put_over_mutual_tls(mtls_service: Service, target: FakeTarget, https_target: _Served) -> None:
    inputs = imagenet_like_members(2)
    response = httpx.put(f"{mtls_service.url}/src/tls-put.tar", content=make_tar(inputs), timeout=60,
                         headers={NODE_URL: destination(https_target, "tls-put.tar")})
    assert response.status_code == 204, response.text
    (put,) = target.recorded("PUT")
    assert put.raw_path == f"{target.etl_path}/{escaped_uname('dst', 'tls-put.tar')}"
    assert put.query_pairs[:2] == [("owt", "3"), ("uuid", "tcb-tls")]
    assert_transformed(inputs, put.body)


def test_without_the_client_certificate_the_hpull_fetch_fails_saying_so(no_cert_service: Service,
                                                                       target: FakeTarget) -> None:
    target.objects[uname("src", "tls/refused.tar")] = image_shard(1)
    response = httpx.get(f"{no_cert_service.url}/{escaped_uname('src', 'tls/refused.tar')}", timeout=60)
    assert response.status_code == 502
    assert "client certificate" in response.text and "AIS_CRT" in response.text, response.text
    assert target.secret not in response.text
    assert target.recorded() == []  # the target never let the request through


def test_without_the_client_certificate_a_direct_put_fails_saying_so(no_cert_service: Service, target: FakeTarget,
                                                                     https_target: _Served, disk: AisDisk) -> None:
    fqn = disk.put("src", "tls-put-refused.tar", image_shard(1))
    started = time.monotonic()
    response = httpx.put(f"{no_cert_service.url}/src/tls-put-refused.tar?{fqn_query(fqn)}", content=b"",
                         headers={NODE_URL: destination(https_target, "tls-put-refused.tar")}, timeout=60)
    assert response.status_code == 502  # never 204: nothing was delivered
    assert "client certificate" in response.text and "AIS_CRT" in response.text, response.text
    assert time.monotonic() - started < 10  # within the 4 s object timeout, retries included
    assert target.recorded("PUT") == []


def test_a_certificate_refused_by_tls_is_not_retried(https_target: _Served, target: FakeTarget) -> None:
    # The fake's CA is in no default bundle: verification fails the same way every time, so the put
    # gives up at once, as a refusal AIS should not ask to re-send either.
    with httpx.Client() as client:
        started = time.monotonic()
        with pytest.raises(UpstreamError) as info:
            put_stream(client, f"{https_target.base_url}{target.etl_path}/{escaped_uname('dst', 'x.tar')}",
                       lambda: [b"data"], headers={}, deadline=time.monotonic() + 20, replayable=False)
    assert time.monotonic() - started < 5
    assert info.value.status == 502 and info.value.transient is False
    assert "CERTIFICATE_VERIFY_FAILED" in info.value.message and "AIS_CLIENT_CA" in info.value.message



@pytest.fixture(scope="module")
def https_origin(target: FakeTarget, tls_files: TlsFiles) -> Iterator[_Served]:
    """The fake's origin on https with a certificate of the throwaway CA, no client certificate asked."""
    served = _Served(target, ssl_certfile=str(tls_files.server_cert), ssl_keyfile=str(tls_files.server_key))
    served.start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def skip_verify_service(target: FakeTarget, https_origin: _Served, disk: AisDisk, logs: Path) -> Iterator[Service]:
    """Its AIS target is the same https server as the origin below, whose CA it is not given."""
    server = start_transformer("transformer-tls-skip-verify", logs,
                               https_env(target, https_origin, disk, AIS_SKIP_VERIFY_CRT="true"))
    yield server
    server.stop()


def download(service: Service, origin: _Served, name: str) -> httpx.Response:
    query = urlencode({"original_url": f"{origin.base_url}/origin/{name}", "object_to": name})
    return httpx.post(f"{service.url}/download?{query}", timeout=60)


def test_a_download_origin_is_verified_with_the_default_bundle_plus_ais_client_ca(
        mtls_service: Service, target: FakeTarget, https_origin: _Served) -> None:
    inputs = imagenet_like_members(2)
    target.origin["tls/origin.tar"] = make_tar(inputs)
    response = download(mtls_service, https_origin, "tls/origin.tar")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)


def test_skip_verify_applies_to_ais_targets_not_to_download_origins(
        skip_verify_service: Service, target: FakeTarget, https_origin: _Served) -> None:
    inputs = imagenet_like_members(1)
    target.objects[uname("src", "tls/unverified.tar")] = make_tar(inputs)  # hpull from the target: not verified
    response = httpx.get(f"{skip_verify_service.url}/{escaped_uname('src', 'tls/unverified.tar')}", timeout=60)
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)
    target.origin["tls/unverified-origin.tar"] = image_shard(1)
    response = download(skip_verify_service, https_origin, "tls/unverified-origin.tar")
    assert response.status_code == 502 and "CERTIFICATE_VERIFY_FAILED" in response.text, response.text
    assert "unverified-origin.tar" in response.text


def test_a_download_origin_is_never_shown_the_ais_client_certificate(
        mtls_service: Service, target: FakeTarget, https_target: _Served) -> None:
    target.origin["tls/wants-a-cert.tar"] = image_shard(1)
    response = download(mtls_service, https_target, "tls/wants-a-cert.tar")  # asks for a client certificate
    assert response.status_code == 502, response.text
    assert target.recorded("GET") == []  # the origin never let the request through: no certificate was sent
