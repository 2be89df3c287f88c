"""The ``image`` tests: the image ``make image`` built, run with podman as Kubernetes would run it.

They run under ``make test-image`` (``pytest -m image``), never in ``make test``. Without podman, runc,
root or the image they fail with what is missing, never skip. Every container runs in a network
namespace of this test process's main thread (``--network host`` joins it), so nothing listens on
the host's network, and is removed when its test ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from scripts.image import IMAGE, container_env
from testbed.netns import NamespaceUnavailable, enter_network_namespace
from testbed.pods import LABEL, ContainerRuntime, PodRuntimeUnavailable, listen_args, podman

PORT = 8000  # what AIS connects to; nothing else listens in the test's namespace


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marked ``image``, and left out of any run whose ``-m`` does not name ``image`` (``make test``,
    ``pytest -m 'not ais'``): they need root, podman and the built image."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    for item in mine:
        item.add_marker(pytest.mark.image)
    if mine and "image" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if item not in mine]


@pytest.fixture(scope="package")
def image() -> str:
    try:
        ContainerRuntime.checked()
    except PodRuntimeUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    return IMAGE


@pytest.fixture(scope="package")
def network(image: str) -> Iterator[None]:
    try:
        namespace = enter_network_namespace([])
    except NamespaceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            namespace.leave()


@dataclass
class Pod:
    """One container of the image, started as ``podman run`` with ``args`` before the image name."""

    name: str
    process: subprocess.Popen
    log_path: Path
    started: float
    port: int = PORT
    ready_after: float = field(default=0.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 60) -> float:
        while time.monotonic() - self.started < timeout:
            if self.process.poll() is not None:
                raise AssertionError(f"the container exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_after = time.monotonic() - self.started
                    return self.ready_after
            time.sleep(0.1)
        raise AssertionError(f"no /health within {timeout} s:\n{self.log()[-4000:]}")

    def exit_code(self, timeout: float = 60) -> int:
        return self.process.wait(timeout=timeout)

    def host_pid(self) -> int:
        out = podman("inspect", "--format", "{{.State.Pid}}", self.name, check=False).stdout.strip()
        return int(out) if out.isdigit() else 0


@pytest.fixture
def run_pod(image: str, network: None, tmp_path: Path) -> Iterator:
    """``run_pod(*podman_args, command=())`` starts a container of the image, attached, output to a log; without
    ``command``, the image's own (``wds-transform serve``) on 127.0.0.1:``port``."""
    pods: list[Pod] = []

    def start(*podman_args: str, command: tuple[str, ...] = (), env: dict[str, str] | None = None,
              port: int = PORT) -> Pod:
        name = f"image-test-{os.getpid()}-{len(pods)}"
        log_path = tmp_path / f"{name}.log"
        argv = ["podman", "run", "--rm", "--name", name, "--label", f"{LABEL}={os.getpid()}", "--network", "host",
                "--no-healthcheck", "--pull", "never", "--log-driver", "none", *podman_args]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        argv += [image, *(command or ("serve", *listen_args(("127.0.0.1", port))))]  # the image's CMD, on this port
        with open(log_path, "wb") as sink:
            process = subprocess.Popen(argv, env=container_env(), stdin=subprocess.DEVNULL, stdout=sink,
                                       stderr=subprocess.STDOUT)
        pod = Pod(name, process, log_path, time.monotonic(), port)
        pods.append(pod)
        return pod

    yield start
    for pod in pods:
        if pod.process.poll() is None:
            podman("rm", "--force", "--time", "0", pod.name, check=False)
            pod.process.wait(timeout=30)
    left = [pod.name for pod in pods if podman("container", "exists", pod.name, check=False).returncode == 0]
    assert not left, f"containers left behind: {left}"
