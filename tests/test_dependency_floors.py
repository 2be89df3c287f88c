"""The declared version floors are enough: the service runs on them.

``pyproject.toml`` says ``uvicorn>=X``; a user whose resolver picks X must get a working pod. Here the
pure-Python server dependencies are installed at exactly their declared floors (``pip install
--no-deps --target``, cached under ``~/.cache/ais-wds-transformer``), put before the venv on
``PYTHONPATH``, and the service is run the way the pod runs it (``python -m transformer serve``, with
the direct-send and ws protocols) and asked for a shard over HTTP and over ws. The compiled and heavy
dependencies (torch, torchvision, numpy, Pillow, pydantic, httptools, uvloop) come from the venv.

Needs PyPI (CI has it): without it the test fails and says so.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest
from packaging.version import Version
from websockets.sync.client import connect

from tests.contract.harness import free_port
from tests.shardgen import imagenet_like_members, make_tar

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ais-wds-transformer"

# The server's pure-Python dependencies whose floors are checked (names as in pyproject.toml).
CHECKED = ("fastapi", "uvicorn", "httpx", "h11", "websockets", "prometheus-client")
# What those floors need beside them, at versions the floors accept: fastapi 0.115.0 wants starlette
# >=0.37.2,<0.39; httpx 0.27.0 wants httpcore 1.* (whose 1.0.x wants h11 <0.15) and sniffio.
COMPANIONS = {"starlette": "0.37.2", "httpcore": "1.0.5", "sniffio": "1.3.1"}


def declared_floors() -> dict[str, str]:
    """``name: floor`` for each ``"name>=floor..."`` of the ``server`` extra in pyproject.toml.

    Read with a pattern, not tomllib, which Python 3.10 (the declared minimum) does not have.
    """
    text = (REPO / "pyproject.toml").read_text()
    server = re.search(r"^server = \[(.*?)^\]", text, re.M | re.S)
    assert server, "no server extra in pyproject.toml"
    requirements = re.findall(r'^\s*"([^"]+)"', server.group(1), re.M)
    floors = {}
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
        if match:
            floors[match.group(1).lower()] = match.group(2)
    return floors


def test_every_checked_dependency_declares_a_floor() -> None:
    floors = declared_floors()
    assert [name for name in CHECKED if name not in floors] == [], f"no '>=' floor in pyproject.toml: {floors}"


@pytest.fixture(scope="module")
def floors_dir() -> Path:
    floors = declared_floors()
    pins = [f"{name}=={floors[name]}" for name in CHECKED] + [f"{n}=={v}" for n, v in COMPANIONS.items()]
    folder = CACHE / f"floors-{hashlib.sha256(' '.join(pins).encode()).hexdigest()[:12]}"
    if not (folder / ".complete").exists():
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                               str(partial), *pins], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"could not install the declared floors {pins} from PyPI (this test needs PyPI):\n"
                        f"{done.stderr[-2000:]}")
        (partial / ".complete").write_text(" ".join(pins))
        if folder.exists():  # another run finished first
            subprocess.run(["rm", "-rf", str(partial)], check=False)
        else:
            partial.rename(folder)
    return folder


def floor_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(REPO)])
    return env


def test_the_service_runs_on_the_declared_floors(floors_dir: Path, tmp_path: Path) -> None:
    floors = declared_floors()
    env = floor_env(floors_dir)
    probe = subprocess.run(
        [sys.executable, "-c", "import json, sys, importlib.metadata as m, uvicorn; "
         f"print(json.dumps({{n: m.version(n) for n in {list(CHECKED)!r}}}))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = {name: Version(version) for name, version in json.loads(probe.stdout).items()}
    assert found == {name: Version(floors[name]) for name in CHECKED}  # the floors, not the venv's versions

    port = free_port()
    log = (tmp_path / "service.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "transformer", "serve", "--host", "127.0.0.1", "--port",
                               str(port)], env={**env, "ETL_WORKERS": "2"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if server.poll() is not None:
                break
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            subprocess.run(["sleep", "0.1"], check=True)
        text = (tmp_path / "service.log").read_text()
        assert server.poll() is None, f"the service does not start on the declared floors:\n{text[-3000:]}\n" \
                                      "raise the floor in pyproject.toml to a version that has what the code uses"
        shard = make_tar(imagenet_like_members(3))
        etl_args = json.dumps({"preset": "imagenet-val"})  # deterministic: the ws reply must be the same bytes
        response = httpx.put(f"{url}/train/floors.tar", params={"etl_args": etl_args}, content=shard, timeout=120)
        assert response.status_code == 200, response.text[:500]
        names = tarfile.open(fileobj=io.BytesIO(response.content)).getnames()
        assert sum(name.endswith(".npy") for name in names) == 3 and names[-1] == "__etl__/end.json", names
        with connect(f"ws://127.0.0.1:{port}/ws", max_size=None, compression=None, open_timeout=30) as ws:
            ws.send(json.dumps({"path": "train/floors.tar", "etl_args": etl_args}).encode())
            ws.send(shard)
            assert ws.recv(timeout=120) == response.content
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
