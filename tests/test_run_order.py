"""The real-ETL tests are a process's last when it cannot leave their network namespace (tests/conftest.py):
make test's scheduler, run on a small suite of its own as root in a user namespace, as an unprivileged run is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TESTBED = TESTS.parent / "testbed"
RECORD = '''
import os, time
def _record(name):
    with open(os.environ["ORDER_LOG"], "a") as log:
        log.write(f"{os.getpid()} {name}\\n")
'''


def _copy_conftest(root: Path) -> None:
    """The tests' conftest and the user-namespace module it enters first, as packages under ``root``."""
    (root / "testbed").mkdir()
    for name in ("userns.py", "__init__.py"):
        shutil.copy(TESTBED / name, root / "testbed" / name)
    for name in ("conftest.py", "__init__.py"):
        shutil.copy(TESTS / name, root / "tests" / name)


def _suite(root: Path) -> None:
    (root / "tests" / "ais").mkdir(parents=True)
    _copy_conftest(root)
    (root / "tests" / "ais" / "__init__.py").write_text("")
    (root / "tests" / "ais" / "test_real_etl.py").write_text(RECORD + "".join(
        f"def test_etl_{i}():\n    time.sleep(0.3)\n    _record('ais/{i}')\n" for i in range(4)))
    for f in range(6):
        (root / "tests" / f"test_other_{f}.py").write_text(RECORD + "".join(
            f"def test_{i}():\n    time.sleep(0.1)\n    _record('other/{f}')\n" for i in range(2)))


def _run(root: Path, *prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "ORDER_LOG": str(root / "order.log"), "AIS_WDS_NO_USERNS": "1"}
    return subprocess.run([*prefix, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "tests"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)


def test_an_unprivileged_worker_takes_no_file_after_the_real_ais_ones(tmp_path: Path) -> None:
    _suite(tmp_path)
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    done = _run(tmp_path, unshare, "--user", "--map-root-user", "--")  # uid_map "0 <uid> 1": cannot leave
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in (tmp_path / "order.log").read_text().splitlines()]
    assert len(rows) == 4 + 12
    ais_worker = {pid for pid, name in rows if name.startswith("ais/")}
    assert len(ais_worker) == 1, rows
    after = [name for pid, name in rows if pid in ais_worker][4:]
    assert [name for pid, name in rows if pid in ais_worker][-4:] == [f"ais/{i}" for i in range(4)], rows
    assert not after, rows


def test_a_test_after_a_namespace_that_could_not_be_left_fails_naming_why(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    _copy_conftest(tmp_path)
    (tmp_path / "tests" / "test_stuck.py").write_text(
        "from testbed import userns\n\n"
        "def test_leaves_badly():\n    userns.stuck_in.append('setns: Operation not permitted')\n\n"
        "def test_after():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "AIS_WDS_NO_USERNS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "1 passed, 1 error" in done.stdout, done.stdout[-3000:]
    assert ("::test_after would run inside the real-ETL tests' network namespace, which this "
            "process could not leave (setns: Operation not permitted)") in done.stdout
