"""The loopback cluster itself: up, on 127.0.0.1, a mountpath under the run's folder; stopped without a trace;
and without Go the tests fail saying how to get it, without ``openssl`` the real-ETL tests fail naming it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import cluster as ais
from testbed.cluster import LocalCluster, start_cluster

pytestmark = pytest.mark.ais
REPO = Path(__file__).resolve().parents[2]


def test_cluster_is_a_proxy_and_a_target_on_loopback(ais_cluster: LocalCluster, ais_client) -> None:
    smap = ais_client.cluster().get_info()
    assert len(smap.pmap) == 1 and len(smap.tmap) == 1
    (target,) = smap.tmap.values()
    assert target.public_net.direct_url.startswith("http://127.0.0.1:")
    assert ais_client.cluster().is_ready()
    assert ais_cluster.mountpath.is_dir() and ais_cluster.mountpath.is_relative_to(ais_cluster.root)
    bucket = ais_client.bucket("cluster-check").create(exist_ok=True)
    bucket.object("a/b.txt").get_writer().put_content(b"written by the test")
    assert ais_cluster.fqn("cluster-check", "a/b.txt").read_bytes() == b"written by the test"


def test_a_stopped_cluster_leaves_no_process_and_frees_its_ports(aisnode: Path, tmp_path: Path) -> None:
    cluster = start_cluster(aisnode, tmp_path / "second")
    pids = [p.pid for p in cluster.processes()]
    ports = [int(url.rsplit(":", 1)[1]) for url in (cluster.proxy.url, cluster.target.url)]
    cluster.stop()
    assert all(p.poll() is not None for p in cluster.processes())
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    for port in ports:
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still accepts connections"
    assert "Terminated OK" in (tmp_path / "second" / "target" / "log" / "aistarget.INFO").read_text()


def test_without_go_they_fail_saying_how_to_get_it(tmp_path: Path) -> None:
    """A run with no aisnode cached and no Go: the ``ais`` tests FAIL (never skip) with the how-to."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIS_WDS_")}
    env.update({ais.CACHE_ENV: str(tmp_path / "empty-cache"), ais.GO_ENV: str(tmp_path / "no-go"),
                "PATH": os.path.dirname(sys.executable)})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
         "tests/ais/test_cluster.py::test_cluster_is_a_proxy_and_a_target_on_loopback"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "1 error" in output and "skipped" not in output, output
    assert "https://go.dev/dl" in output and "pytest -m 'not ais'" in output, output
    assert not (tmp_path / "empty-cache" / "bin").exists()


def test_without_openssl_the_real_etl_tests_fail_naming_it(aisnode: Path, tmp_path: Path) -> None:
    """``ip``, ``unshare`` and ``mount`` are found in /usr/sbin and /usr/bin too; ``openssl`` (the fake
    Kubernetes API's TLS files) only on PATH: a PATH without it fails the real-ETL tests, never skips them."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), ais.BINARY_ENV: str(aisnode)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--basetemp={tmp_path / 'run'}",
         "tests/ais/etl/test_register.py::test_stopped_etl_comes_back_with_the_same_spec"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "1 error" in output and "skipped" not in output, output
    assert "the real-ETL cluster needs openssl, not found" in output, output


def test_how_to_get_go_names_the_cache_and_the_alternatives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ais.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(ais.GO_ENV, str(tmp_path / "no-go"))
    monkeypatch.delenv(ais.BINARY_ENV, raising=False)
    with pytest.raises(ais.AisnodeUnavailable) as failure:
        ais.install_aisnode()
    message = str(failure.value)
    assert f"{ais.AISNODE_PACKAGE}@{ais.AISNODE_VERSION}" in message
    assert str(tmp_path) in message and ais.BINARY_ENV in message and "go.dev/dl" in message
