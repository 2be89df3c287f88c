"""The contract harness's ``Service``: each keeps its own log file, every one is listed for the checks made at
the end, and a start that times out reports the process's log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from testbed.ports import free_port
from testbed.service import Service, base_env

SILENT = [sys.executable, "-c", "import sys, time; print('never healthy', flush=True); time.sleep(60)"]


def test_a_start_that_times_out_reports_the_log(tmp_path: Path) -> None:
    service = Service("silent", SILENT, base_env(), tmp_path, free_port())
    with pytest.raises(RuntimeError, match=r"silent not healthy within 2s:\n.*never healthy"):
        service.wait_healthy(2)
    assert service.process.poll() is not None


def test_services_of_one_name_keep_their_own_logs_and_are_all_listed(tmp_path: Path) -> None:
    made = []
    for _ in range(3):
        service = Service("twin", [sys.executable, "-c", "print('never healthy')"], base_env(), tmp_path, free_port())
        service.process.wait(timeout=60)
        service.stop()
        made.append(service)
    assert [s.log_path.name for s in made] == ["twin.log", "twin-2.log", "twin-3.log"]
    assert all(s.log_path.read_text() == "never healthy\n" for s in made) and made[0].log_path.is_file()
    assert Service.started[-3:] == made


def test_make_tests_scheduler_keeps_the_real_ais_tests_on_one_worker() -> None:
    """``make test`` (``-n 2 --dist loadfile``): one scope per file, and all of ``tests/ais/`` one scope, whose
    session and package fixtures must start once (tests/conftest.py); all of ``tests/reliability/`` too."""
    from types import SimpleNamespace

    from tests.conftest import pytest_xdist_make_scheduler

    config = SimpleNamespace(getvalue={"dist": "loadfile", "tx": ["2*popen"]}.get, option=SimpleNamespace(),
                             getoption=lambda *_, **__: None)
    scope = pytest_xdist_make_scheduler(config, None)._split_scope
    assert scope("tests/ais/etl/test_failures.py::test_a[ws]") == scope("tests/ais/test_client.py::b") == "tests/ais/"
    assert scope("tests/reliability/test_security.py::e") == scope("tests/reliability/test_faults.py::f") \
        == "tests/reliability/"  # its end-of-package secret check needs every test of the package
    assert scope("tests/contract/test_ws.py::TestX::test_c") == "tests/contract/test_ws.py"
    assert scope("tests/test_bench_soak_ais.py::test_d") == "tests/test_bench_soak_ais.py"
    assert pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "load"}.get), None) is None
