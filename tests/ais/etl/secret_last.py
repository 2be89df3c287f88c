"""The real-ETL package's last check: the ETL secret in no line of any pod's whole log, nor in any error body
the tests received (``tests/secret_check.py``), after every test ran and the cluster stopped.

Every pod that ever ran counts, deleted ones too (``kube.started``, each log read from the pod's folder,
process and container pods alike). Each of the package's shared ETLs (``etls``) whose pods served objects
must have a pod that used the secret at DEBUG; the README's ETL, registered with its spec as a user
would, logs at INFO.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.secret_check import BodyRecorder, PodLog, check_last

SHARED_ETLS = ("etl-hpush", "etl-hpull", "etl-ws")  # conftest.etls
USER_ETLS = ("wds-transform",)  # test_readme: k8s/etl-spec.yaml as written


def pod_logs(kube) -> list[PodLog]:
    """Every pod whose container started, deleted ones too, with its AIS_TARGET_URL and log level."""
    logs = []
    for pod in kube.started:
        env = {e["name"]: e.get("value", "") for e in pod.obj["spec"]["containers"][0].get("env", [])}
        etl = pod.name.rsplit("-", 1)[0]  # AIS names pods <etl>-<target id>
        logs.append(PodLog(pod.name, pod.log, env.get("AIS_TARGET_URL", ""), env.get("ETL_LOG_LEVEL", "info"), etl))
    return logs


@pytest.fixture(scope="package", autouse=True)
def secret_checked_last() -> Iterator[SimpleNamespace]:
    """Records the error bodies this package's tests receive; at its very end (set up before the cluster, so
    torn down after it stopped) checks them and every pod's whole log. A failure shows as an error at the
    teardown of the package's last test."""
    watched = SimpleNamespace(cluster=None, recorder=BodyRecorder().install())
    try:
        yield watched
    finally:
        watched.recorder.uninstall()
    if watched.cluster is not None:  # else the cluster never started: its own failure says why
        check_last(pod_logs(watched.cluster.kube), watched.recorder.bodies, SHARED_ETLS, USER_ETLS)


@pytest.fixture(autouse=True)
def _secret_watches_the_cluster(request: pytest.FixtureRequest, secret_checked_last: SimpleNamespace) -> None:
    if "etl_cluster" in request.fixturenames and secret_checked_last.cluster is None:
        secret_checked_last.cluster = request.getfixturevalue("etl_cluster")
