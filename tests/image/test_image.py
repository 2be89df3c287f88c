"""The image as AIS runs it: its user, entry command and settings, FQN reads through a read-only mount of
objects as AIS writes them, a read-only root with a writable /tmp, output byte-identical to the
installed package, the termination log, and SIGTERM."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
import tomllib

from testbed.aisnames import go_path_escape
from testbed.pods import podman
from testbed.shardgen import imagenet_like_members, make_tar, read_output
from tests.deploy_files import REPO, Dockerfile

SHARD = "shard-000000.tar"


def _inspect(image: str) -> dict:
    return json.loads(podman("image", "inspect", image).stdout)[0]


def _whole(data: bytes) -> list[str]:
    """The member names of a transformed shard whose end marker matches what precedes it (marker left out)."""
    return [name for name, _ in read_output(data)]


def _changed(container: str) -> list[str]:
    return [line.split()[-1] for line in podman("diff", container).stdout.splitlines()]


def _changed_by_podman(like: str) -> list[str]:
    """What podman itself changes in a container of the image (/etc/hosts and the like): one that runs nothing."""
    name = f"{like}-baseline"
    podman("run", "--name", name, "--network", "host", "--no-healthcheck", "--pull", "never", "--entrypoint", "true",
           podman("inspect", "--format", "{{.ImageName}}", like).stdout.strip())
    try:
        return _changed(name)
    finally:
        podman("rm", "--force", name, check=False)


def test_image_config_is_the_dockerfiles(image: str) -> None:
    dockerfile = Dockerfile.load()
    config = _inspect(image)["Config"]
    assert config["User"] == dockerfile.final.last("USER").value == "10001:0"
    assert config["Entrypoint"] == dockerfile.final.exec_form("ENTRYPOINT") == ["wds-transform"]
    assert config["Cmd"] == dockerfile.final.exec_form("CMD") == ["serve"]
    assert "8000/tcp" in config["ExposedPorts"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert not any(name.startswith("ETL_") for name in env)  # no setting fixed in the image: the pod's own defaults
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert config["Labels"]["org.opencontainers.image.version"] == version
    assert _inspect(image)["Healthcheck"]["Test"][0] == "CMD"  # kept: the image is built in Docker's format
    assert env["PATH"].split(":")[0] == "/opt/venv/bin" and env["PATH"].split(":").count("/opt/venv/bin") == 1


def test_image_holds_this_checkouts_package(image: str) -> None:
    """Every module of the installed package is the checkout's file, byte for byte: a build that reused a
    cached layer after a change in transformer/ would test, and ship, the old code."""
    listing = ("import hashlib, pathlib, transformer; root = pathlib.Path(transformer.__file__).parent; "
               "print('\\n'.join(f'{p.relative_to(root)} {hashlib.sha256(p.read_bytes()).hexdigest()}' "
               "for p in sorted(root.rglob('*.py'))))")
    done = podman("run", "--rm", "--network", "none", "--no-healthcheck", "--pull", "never", "--entrypoint",
                  "python", image, "-c", listing)
    installed = dict(line.split() for line in done.stdout.splitlines())
    package = REPO / "transformer"
    here = {str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest() for p in package.rglob("*.py")}
    stale = sorted(name for name in here.keys() | installed.keys() if here.get(name) != installed.get(name))
    assert not stale, f"the image's package differs from this checkout in: {stale} (rebuild: make image)"


def test_pod_is_wds_transform_serve_as_uid_10001_gid_0_writing_only_tmp(run_pod) -> None:
    pod = run_pod()
    print(f"/health answered {pod.wait_healthy():.2f} s after podman run")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pod.host_pid()}/status").read_text().splitlines())
    assert status["Uid"].split() == ["10001"] * 4 and status["Gid"].split() == ["0"] * 4
    assert status["Groups"].split() in ([], ["0"])
    argv = Path(f"/proc/{pod.host_pid()}/cmdline").read_bytes().split(b"\0")
    assert argv[1:3] == [b"/opt/venv/bin/wds-transform", b"serve"], argv  # PID 1: python running the script
    healthcheck = _inspect(podman("inspect", "--format", "{{.ImageName}}", pod.name).stdout.strip())["Healthcheck"]
    probe = podman("exec", pod.name, *healthcheck["Test"][1:], check=False)
    assert probe.returncode == 0, probe.stderr  # the HEALTHCHECK command, as Docker would run it
    reply = httpx.put(f"{pod.url}/bck/{SHARD}", content=make_tar(imagenet_like_members(2)), timeout=120)
    assert reply.status_code == 200, reply.text
    assert len(_whole(reply.content)) == 2 * 3
    written = set(_changed(pod.name)) - set(_changed_by_podman(pod.name))
    assert written and all(path == "/tmp" or path.startswith("/tmp/") for path in written), written


def test_output_is_byte_identical_to_the_installed_package(run_pod, tmp_path: Path) -> None:
    shard = tmp_path / SHARD
    shard.write_bytes(make_tar(imagenet_like_members(4)))
    pod = run_pod()
    pod.wait_healthy()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETL_")}
    for etl_args in ({"seed": 3}, {"seed": 5, "dtype": "uint8", "preset": "imagenet-val"}):
        query = urlencode({"etl_args": json.dumps(etl_args)})
        reply = httpx.put(f"{pod.url}/bck/{SHARD}?{query}", content=shard.read_bytes(), timeout=120)
        assert reply.status_code == 200, reply.text
        out = tmp_path / f"applied-{len(etl_args)}.tar"
        applied = subprocess.run([str(Path(sys.executable).parent / "wds-transform"), "apply", str(shard), str(out),
                                  "--etl-args", json.dumps(etl_args)], env=env, capture_output=True, timeout=300)
        assert applied.returncode == 0, applied.stderr[-2000:]
        assert reply.content == out.read_bytes(), etl_args


@pytest.fixture
def mountpath() -> Iterator[Path]:
    """A target's mountpath where a node's data disk would be (group 0 can reach it; not under /root)."""
    root = Path(tempfile.mkdtemp(prefix="ais-wds-mp-", dir="/var/tmp"))
    root.chmod(0o750)
    yield root / "mp1"
    shutil.rmtree(root, ignore_errors=True)


def test_fqn_read_through_a_read_only_mount_of_objects_as_ais_writes_them(run_pod, mountpath: Path) -> None:
    """AIS (as root) writes objects 0640 root:root under 0750 directories and mounts the target's volumes
    into the ETL pod read-only at the same path: uid 10001 reads them through group 0."""
    obj = mountpath / "@ais" / "bck" / "%ob" / "dir" / SHARD
    obj.parent.mkdir(parents=True)
    obj.write_bytes(make_tar(imagenet_like_members(3)))
    obj.chmod(0o640)
    for directory in (mountpath, *[p for p in obj.parents if mountpath in p.parents]):
        directory.chmod(0o750)
    assert (obj.stat().st_uid, obj.stat().st_gid) == (0, 0)
    query = urlencode({"etl_fqn": go_path_escape(str(obj))})
    mount = f"{mountpath.parent}:{mountpath.parent}:ro"
    pod = run_pod("-v", mount)
    pod.wait_healthy()
    reply = httpx.put(f"{pod.url}/bck/dir/{SHARD}?{query}", content=b"", timeout=120)
    assert reply.status_code == 200, reply.text
    assert len(_whole(reply.content)) == 3 * 3
    # The check can fail: the same user with a group of its own cannot read the object.
    other = run_pod("-v", mount, "--user", "10001:10001", port=8001)
    other.wait_healthy()
    refused = httpx.put(f"{other.url}/bck/dir/{SHARD}?{query}", content=b"", timeout=120)
    assert refused.status_code == 404 and "no such object file" in refused.text, refused.text


def test_read_only_root_with_a_writable_tmp_serves_every_caller(run_pod) -> None:
    """As k8s/standalone/deployment.yaml runs it: readOnlyRootFilesystem and an emptyDir on /tmp. A caller
    that sends the whole body before reading (httpx) has its output parked in /tmp."""
    pod = run_pod("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,size=256m,mode=1777")
    pod.wait_healthy()
    reply = httpx.put(f"{pod.url}/bck/{SHARD}", content=make_tar(imagenet_like_members(8)), timeout=120)
    assert reply.status_code == 200, reply.text
    assert len(_whole(reply.content)) == 8 * 3


def test_worker_processes_serve_the_same_bytes_from_a_read_only_root(run_pod) -> None:
    """ETL_PROCESSES (the default from 5 CPUs) in the image as the manifests run it: the fork server and its
    workers, as uid 10001 with only /tmp writable, give the bytes the threads give."""
    read_only = ("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,size=256m,mode=1777")
    threads = run_pod(*read_only, env={"ETL_WORKERS": "2", "ETL_PROCESSES": "0"})
    processes = run_pod(*read_only, env={"ETL_WORKERS": "2", "ETL_PROCESSES": "2"}, port=8001)
    threads.wait_healthy()
    processes.wait_healthy()
    shard = make_tar(imagenet_like_members(6))
    query = urlencode({"etl_args": json.dumps({"seed": 9})})
    replies = [httpx.put(f"{pod.url}/bck/{SHARD}?{query}", content=shard, timeout=120) for pod in (threads, processes)]
    assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
    assert replies[1].content == replies[0].content and len(_whole(replies[1].content)) == 6 * 3
    assert "2 worker processes" in processes.log()


def test_read_only_root_without_tmp_stops_at_import(run_pod) -> None:
    """Why /tmp must be writable: torch makes a temporary directory when torchvision imports it."""
    pod = run_pod("--read-only", "--read-only-tmpfs=false")
    assert pod.exit_code() != 0
    assert "No usable temporary directory" in pod.log(), pod.log()[-3000:]


def test_bad_setting_reaches_the_termination_log_and_exits_2(run_pod, tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    message.touch()
    message.chmod(0o666)  # as the kubelet's file: writable by the container's user
    pod = run_pod("-v", f"{message}:/dev/termination-log", env={"ETL_DTYPE": "float64"})
    assert pod.exit_code() == 2, pod.log()
    assert "ETL_DTYPE" in message.read_text(), (message.read_text(), pod.log())


def test_sigterm_stops_the_pod_with_exit_0(run_pod) -> None:
    pod = run_pod()
    pod.wait_healthy()
    started = time.monotonic()
    podman("stop", "--time", "30", pod.name, timeout=90)
    assert pod.exit_code() == 0, pod.log()[-3000:]
    took = time.monotonic() - started
    print(f"stopped by SIGTERM in {took:.2f} s")
    assert took < 10, took
