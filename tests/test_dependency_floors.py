"""The server runs on exactly the floors pyproject.toml declares for its light dependencies.

A floor such as ``uvicorn[standard]>=0.52.1`` is a promise: any version from there on has what the code
uses. The rest of the suite runs on the venv's (newest) versions, so it cannot see a floor that is too low.
Here the declared floors of the light server dependencies (``FLOOR_PACKAGES``) are installed from PyPI
into a cache folder, with what pip resolves for them (the newest versions that fit; numpy, pillow and
pyyaml are held at the venv's versions and taken from the venv, like torch and torchvision), and put
first on the path of:

* the service, started the way the pod starts it (``wds-transform serve``: uvicorn with the direct-send
  httptools protocol and the fragmenting websockets protocol). One small shard then goes through every
  path that uses these packages: PUT (httptools, direct send), ws (websockets' sans-I/O protocol, a
  fragmented reply), a pipeline hop to a next stage (h11), ``/download`` (httpx) and ``/metrics``
  (prometheus-client);
* the in-memory tests of the protocol subclasses (``IN_MEMORY``), which check what they take from
  uvicorn and websockets exactly, e.g. that writing waits while uvicorn's transport is paused.

Each of those processes first checks that every floor package is imported from the folder at its floor,
so the venv's newer versions cannot stand in. Fails, never skips, without PyPI (CI reaches it). The
folder is ``~/.cache/ais-wds-transformer/floors-<hash of the pins>``, made once and renamed into place whole.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from websockets.sync.client import connect

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

from testbed.httpserve import StaticServer
from testbed.ports import free_port
from testbed.service import Service, base_env
from testbed.shardgen import imagenet_like_members, make_tar, read_tar

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "ais-wds-transformer"
# Pure-Python or small, and what the serving code imports or runs on: installed at their floors.
FLOOR_PACKAGES = ("fastapi", "starlette", "uvicorn", "websockets", "httpx", "h11", "prometheus-client", "simplejpeg")
# Heavy or shared with torch/torchvision: held at the venv's versions while resolving, taken from the venv.
FROM_VENV = ("numpy", "pillow", "pyyaml")
SAMPLES = 4
HOW_TO_FIX = (
    "Raise that package's floor in pyproject.toml ([project] dependencies or the [server] extra) to the first "
    "version that has what the code uses (its changelog, or `pip download --no-deps <name>==<version>` and "
    "read the source), then run this test again: it installs exactly the declared floors."
)

IN_MEMORY = ("tests/server/test_protocols.py", "tests/server/test_wsreply.py", "tests/server/test_direct.py")

# Run first by every python started on the floors: are the floors what it imports? Then the given code.
_CHECK_FLOORS = r"""
import importlib, importlib.metadata, json, os, sys
site, repo = os.path.realpath(os.environ["FLOORS_SITE"]), os.path.realpath(os.environ["FLOORS_REPO"])
wrong = []
for name, version in json.loads(os.environ["FLOORS_PINS"]).items():
    found = importlib.metadata.version(name)
    where = os.path.realpath(importlib.import_module(name.replace("-", "_")).__file__)
    if found != version or not where.startswith(site + os.sep):
        wrong.append(f"{name} {found} from {where} (expected the floor {version} from {site})")
import transformer
if not os.path.realpath(transformer.__file__).startswith(repo + os.sep):
    wrong.append(f"transformer from {transformer.__file__} (expected {repo})")
if wrong:
    sys.exit("FLOORS NOT IN USE: " + "; ".join(wrong))
"""
_SERVE = _CHECK_FLOORS + "from transformer.cli import main\nsys.exit(main(sys.argv[1:]))\n"
_PYTEST = _CHECK_FLOORS + "import pytest\nsys.exit(pytest.main(sys.argv[1:]))\n"


def declared_floors() -> dict[str, str]:
    """name -> the requirement pinned at its declared floor, e.g. ``uvicorn[standard]==0.52.1``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for text in project["dependencies"] + project["optional-dependencies"]["server"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name not in FLOOR_PACKAGES:
            continue
        lows = [s.version for s in requirement.specifier if s.operator in (">=", "==", "~=", "===")]
        assert len(lows) == 1, f"pyproject.toml: {text!r} must declare one floor (>=) for this test to install"
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        floors[name] = f"{requirement.name}{extras}=={lows[0]}"
    missing = sorted(set(FLOOR_PACKAGES) - set(floors))
    assert not missing, (
        f"{missing} not declared in pyproject.toml's dependencies or [server] extra, but the server imports "
        "them: declare each with its floor"
    )
    return floors


_NOT_FOR_PIP = ("PYTHONPATH", "PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_USER", "PIP_REQUIRE_VIRTUALENV",
                "PIP_NO_DEPS", "PIP_DRY_RUN")


def _pip(args: list[str], what: str) -> None:
    # pip's own settings stay (certificates, index); none that would install elsewhere or refuse --target.
    env = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_PIP}
    command = [sys.executable, "-m", "pip", *args, "--only-binary=:all:", "--disable-pip-version-check",
               "--no-input", "--retries", "1", "--timeout", "30"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        pytest.fail(
            f"could not {what} from PyPI; this test needs PyPI (CI reaches it) and fails without it. If PyPI "
            f"is reachable, a floor in pyproject.toml may name a version that does not exist, has no wheel for "
            f"this Python, or conflicts with another floor.\n$ {' '.join(command)}\n{result.stderr[-3000:]}",
            pytrace=False,
        )


def floors_site(floors: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """The folder holding the floors and what pip resolved with them; and the floor packages' versions."""
    held = [f"{name}=={importlib.metadata.version(name)}" for name in FROM_VENV]
    requested = sorted(floors.values()) + held
    key = hashlib.sha256(json.dumps([requested, sys.implementation.cache_tag, platform.machine()]).encode())
    folder = CACHE / f"floors-{key.hexdigest()[:16]}"
    if not (folder / "resolved.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=CACHE))
        partial.chmod(0o755)
        try:
            report = partial / "report.json"
            _pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *requested],
                 "resolve the declared floors")
            resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                        for item in json.loads(report.read_text())["install"]}
            wanted = [f"{name}=={version}" for name, version in sorted(resolved.items()) if name not in FROM_VENV]
            _pip(["install", "--no-deps", "--quiet", "--target", str(partial / "site"), *wanted],
                 "install the declared floors")
            (partial / "resolved.json").write_text(json.dumps({"requested": requested, "resolved": resolved},
                                                              indent=1))
            report.unlink()
            try:
                partial.rename(folder)  # whole or not at all; another run may have won the race
            except OSError:
                if not (folder / "resolved.json").is_file():
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    resolved = json.loads((folder / "resolved.json").read_text())["resolved"]
    return folder / "site", {name: resolved[name] for name in floors}


@pytest.fixture(scope="module")
def floors() -> dict[str, str]:
    return declared_floors()


@pytest.fixture(scope="module")
def at_floors(floors: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of a python that runs on the floors (the venv for the rest), and the pins."""
    site, pins = floors_site(floors)
    env = base_env(PYTHONPATH=f"{site}{os.pathsep}{REPO}", PYTHONNOUSERSITE="1", FLOORS_SITE=str(site),
                   FLOORS_REPO=str(REPO), FLOORS_PINS=json.dumps(pins))
    return env, pins


@pytest.fixture(scope="module")
def served(at_floors: tuple[dict, dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, dict]]:
    floor_env, pins = at_floors
    port = free_port()
    env = {**floor_env, "ETL_WORKERS": "2", "ETL_OBJ_TIMEOUT": "60s", "ETL_PRESET": "imagenet-val",
           "ETL_LOG_LEVEL": "warning"}
    command = [sys.executable, "-c", _SERVE, "serve", "--host", "127.0.0.1", "--port", str(port)]
    log_dir = tmp_path_factory.mktemp("floors")
    try:
        service = Service("transformer-at-floors", command, env, log_dir, port).wait_healthy(180)
    except RuntimeError as exc:
        if "FLOORS NOT IN USE" in str(exc):
            pytest.fail(f"the service did not import the installed floors, so this test would not test them:\n{exc}",
                        pytrace=False)
        pytest.fail(f"the service does not start on the declared floors {_shown(pins)}: the code needs more than "
                    f"a floor promises. {HOW_TO_FIX}\n{exc}", pytrace=False)
    yield service, pins
    service.stop()


def _shown(pins: dict[str, str]) -> str:
    return ", ".join(f"{name}=={version}" for name, version in pins.items())


def _shard() -> bytes:
    return make_tar(imagenet_like_members(SAMPLES, extra=False))


def _check_tar(step: str, service: Service, pins: dict[str, str], status: int, body: bytes) -> None:
    expected = [f"sample-{i:06d}.{ext}" for i in range(SAMPLES) for ext in ("npy", "cls")]
    try:
        names = [name for name, _ in read_tar(body)] if status == 200 else None
    except Exception as exc:  # any unreadable reply is the failure reported
        names = f"no tar ({exc!r})"
    if names != expected:
        pytest.fail(
            f"{step} failed on the declared floors {_shown(pins)}: status {status}, members {names}, body "
            f"{body[:300]!r}. The code needs more than one of these floors promises (the service's log below "
            f"names the package in its traceback). {HOW_TO_FIX}\n--- service log ---\n{service.log_tail()}",
            pytrace=False,
        )


def test_the_installed_versions_are_the_declared_floors(floors: dict[str, str], served: tuple[Service, dict]) -> None:
    """What pip installed is the floor itself (the service's process checked that it imports these)."""
    _, pins = served
    for name, requirement in floors.items():
        assert Requirement(requirement).specifier.contains(pins[name]), (name, requirement, pins[name])


def test_hpush_over_http_at_the_floors(served: tuple[Service, dict]) -> None:
    service, pins = served
    response = httpx.put(f"{service.url}/bck/floors.tar", content=_shard(), timeout=90)
    _check_tar("PUT /bck/floors.tar (httptools protocol, direct send)", service, pins, response.status_code,
               response.content)


def test_ws_at_the_floors(served: tuple[Service, dict]) -> None:
    service, pins = served
    url = service.url.replace("http://", "ws://") + "/ws"
    try:
        with connect(url, max_size=None, compression=None, open_timeout=30, close_timeout=5) as ws:
            ws.send(json.dumps({"path": "bck/floors.tar"}).encode())
            ws.send(_shard())
            reply = ws.recv(timeout=90)
    except Exception as exc:  # a failed connection is the failure reported
        _check_tar("ws /ws (websockets sans-I/O protocol, fragmented reply)", service, pins, 0,
                   f"{exc!r}".encode())
        return
    _check_tar("ws /ws (websockets sans-I/O protocol, fragmented reply)", service, pins,
               200 if isinstance(reply, bytes) else 0, reply if isinstance(reply, bytes) else reply.encode())


def test_pipeline_hop_at_the_floors(served: tuple[Service, dict]) -> None:
    """The service is its own next stage: its output goes there over the hand-written duplex PUT (h11)."""
    service, pins = served
    before = _hpush_shards(service)
    response = httpx.put(f"{service.url}/bck/hop.tar", content=_shard(), headers={"Ais-Node-Url": service.url},
                         timeout=90)
    _check_tar("PUT with Ais-Node-Url (pipeline hop: duplex PUT, h11)", service, pins, response.status_code,
               response.content)
    deadline = time.monotonic() + 10  # each stage counts its shard once its driver thread is done
    while _hpush_shards(service) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _hpush_shards(service) == before + 2, "the shard did not go through both stages"


def _hpush_shards(service: Service) -> float:
    text = httpx.get(f"{service.url}/metrics", timeout=30).text
    return sum(float(n) for n in re.findall(r'^etl_shards_total\{comm="hpush"[^}]*\} (\S+)$', text, re.M))


def test_download_at_the_floors(served: tuple[Service, dict]) -> None:
    service, pins = served
    origin = StaticServer(every=_shard())  # the origin of a /download: one shard for every path
    try:
        response = httpx.post(f"{service.url}/download", params={"original_url": f"{origin.url}/floors.tar"},
                              timeout=90)
    finally:
        origin.close()
    _check_tar("POST /download (the origin fetched with httpx)", service, pins, response.status_code,
               response.content)


def test_metrics_at_the_floors(served: tuple[Service, dict]) -> None:
    service, pins = served
    response = httpx.get(f"{service.url}/metrics", timeout=30)
    if response.status_code != 200 or "etl_shards_total" not in response.text:
        pytest.fail(f"GET /metrics failed on the declared floors {_shown(pins)}: {response.status_code} "
                    f"{response.text[:300]!r}. {HOW_TO_FIX}\n--- service log ---\n{service.log_tail()}",
                    pytrace=False)


def test_protocol_subclasses_in_memory_at_the_floors(at_floors: tuple[dict, dict]) -> None:
    """The in-memory tests of what server/protocols.py, direct.py and wsreply.py take from uvicorn and websockets."""
    env, pins = at_floors
    command = [sys.executable, "-c", _PYTEST, "-q", "-p", "no:cacheprovider", *IN_MEMORY]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        protocols = ", ".join(f"{name}=={pins[name]}" for name in ("uvicorn", "websockets"))
        pytest.fail(f"{' '.join(IN_MEMORY)} fail on the declared floors {_shown(pins)}. These tests check what "
                    f"server/protocols.py, direct.py and wsreply.py take from uvicorn's protocols and websockets, so "
                    f"most likely one of {protocols} is a floor too low for the code. {HOW_TO_FIX}\n"
                    f"{done.stdout[-4000:]}{done.stderr[-2000:]}", pytrace=False)
