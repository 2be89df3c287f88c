"""How the fake kubelet (``testbed/fake_kube.py``) runs an ETL pod's container: as a process, or as a container.

``ProcessRuntime`` (the default of ``make test``) runs the container's command as a local process of
the development venv. ``ContainerRuntime`` (``make test-image``; ``AIS_WDS_POD_RUNTIME=container``)
runs it with podman as a container of the image ``make image`` built, as a kubelet would:

* the image's ENTRYPOINT and CMD, or the spec's ``command``/``args`` in their place; its USER
  (uid 10001, gid 0);
* the spec's env; the pod listens on the node's address and the service's NodePort (``serve --host --port``:
  several pods share this machine, where a real pod has 0.0.0.0:8000 of its own network);
* host networking, i.e. the network namespace of the thread that runs the kubelet (the test's own);
* every ``hostPath`` volume the spec mounts, at its ``mountPath`` and read-only where the spec says
  so (AIS copies the target pod's volumes into the ETL pod read-only: its objects are read by FQN
  through them);
* ``/dev/termination-log``, a file of the pod's own, for the termination message;
* the container's output as the pod's log, its exit status as the container's.

Each container carries the label ``ais-wds-test`` with the pid of the test process, and is removed
when its pod is deleted, when the fixture ends, and, should a test process die without cleaning up
(podman's conmon outlives it), by the next run.

Image names: AIS asks for the spec's ``runtime.image`` (``k8s/etl-spec.yaml``: a registry name; the
tests: ``ais-wds-transformer:test``). Every image whose repository is ``ais-wds-transformer``, whatever
its registry or tag, runs as the locally built ``scripts.image.IMAGE`` (``AIS_WDS_IMAGE``); any other
name is run as given, never pulled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from scripts.image import IMAGE, container_env

from .cluster import _die_with_parent, owner_gone

LABEL = "ais-wds-test"
PROJECT_REPOSITORY = "ais-wds-transformer"


class PodRuntimeUnavailable(RuntimeError):
    """Container pods cannot run here; the message says what is missing."""


def _own_group_dying_with_parent() -> None:  # between fork and exec
    _die_with_parent()
    os.setpgrp()  # its own group, so a kill reaches what it started too


def listen_args(listen: tuple[str, int]) -> list[str]:
    """``wds-transform serve``'s arguments for the address a pod listens on."""
    return ["--host", listen[0], "--port", str(listen[1])]


class Container(Protocol):
    """What the kubelet needs of one running container."""

    process: subprocess.Popen  # its ``wait()`` is the container's exit status

    @property
    def pid(self) -> int: ...

    def signal(self, number: int) -> None: ...

    def stop(self, grace: float) -> None: ...


class PodRuntime(Protocol):
    kind: str  # "process" or "container"

    def start(self, name: str, image: str, command: Sequence[str], args: Sequence[str], env: dict[str, str],
              mounts: Sequence[tuple[str, str, bool]], termination_log: Path, log: Path, cwd: Path,
              listen: tuple[str, int]) -> Container: ...

    def leftovers(self) -> list[str]: ...

    def remove_all(self) -> None: ...


# --- processes -------------------------------------------------------------------------------------------


class LocalProcess:
    def __init__(self, process: subprocess.Popen):
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, number)

    def stop(self, grace: float) -> None:
        if self.process.poll() is not None:
            return
        self.signal(signal.SIGTERM if grace else signal.SIGKILL)
        try:
            self.process.wait(timeout=grace or 10)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=10)


class ProcessRuntime:
    """The container's command as a local process: the image's entry point is ``entrypoint``; a spec's
    ``command`` has its first word mapped through ``commands`` (``wds-transform`` -> this venv's)."""

    kind = "process"

    def __init__(self, entrypoint: list[str], commands: dict[str, list[str]], base_env: dict[str, str]):
        self.entrypoint = entrypoint
        self.commands = commands
        self.base_env = base_env
        self.started: list[LocalProcess] = []

    def start(self, name: str, image: str, command: Sequence[str], args: Sequence[str], env: dict[str, str],
              mounts: Sequence[tuple[str, str, bool]], termination_log: Path, log: Path, cwd: Path,
              listen: tuple[str, int]) -> LocalProcess:
        argv = [*self.commands.get(command[0], [command[0]]), *command[1:], *args] if command else \
            [*self.entrypoint, *(args or listen_args(listen))]
        # Every process shares this machine's /dev: the termination-message path is a file of the pod's own.
        full_env = {**self.base_env, **env, "ETL_TERMINATION_LOG": str(termination_log), "HOSTNAME": name}
        with open(log, "wb") as sink:
            process = subprocess.Popen(argv, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=sink,
                                       stderr=subprocess.STDOUT, preexec_fn=_own_group_dying_with_parent)
        started = LocalProcess(process)
        self.started.append(started)
        return started

    def leftovers(self) -> list[str]:
        return [f"pid {p.pid}" for p in self.started if p.process.poll() is None]

    def remove_all(self) -> None:
        for started in self.started:
            started.stop(grace=0)


# --- containers ------------------------------------------------------------------------------------------


def local_image(requested: str, built: str = IMAGE) -> str:
    """The image podman runs for the image a pod spec names (see the module docstring)."""
    repository = requested.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    return built if repository == PROJECT_REPOSITORY else requested


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=container_env())
    if check and result.returncode != 0:
        raise PodRuntimeUnavailable(f"podman {' '.join(args[:3])} ... failed (exit {result.returncode}): "
                                    f"{result.stderr.strip()[-2000:]}")
    return result


class PodmanContainer:
    def __init__(self, name: str, process: subprocess.Popen):
        self.name = name
        self.process = process
        self._pid = 0

    @property
    def pid(self) -> int:
        """The container's PID 1 as this host sees it (waits for the container to start)."""
        deadline = time.monotonic() + 30
        while not self._pid:
            state = podman("inspect", "--format", "{{.State.Pid}}", self.name, check=False)
            if state.returncode == 0 and state.stdout.strip().isdigit() and int(state.stdout.strip()) > 0:
                self._pid = int(state.stdout.strip())
            elif self.process.poll() is not None or time.monotonic() > deadline:
                raise ProcessLookupError(f"container {self.name} is not running")
            else:
                time.sleep(0.05)
        return self._pid

    def signal(self, number: int) -> None:
        podman("kill", "--signal", str(number), self.name, check=False)

    def stop(self, grace: float) -> None:
        if self.process.poll() is None:
            podman("stop", "--time", str(int(grace)), self.name, timeout=grace + 60, check=False)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                podman("rm", "--force", "--time", "0", self.name, check=False)
                self.process.kill()
                self.process.wait(timeout=10)
        podman("rm", "--force", "--ignore", "--time", "0", self.name, check=False)


class ContainerRuntime:
    """Pods as podman containers of the project's image (``make image``)."""

    kind = "container"

    def __init__(self, image: str = IMAGE):
        self.image = image
        self.owner = str(os.getpid())
        self.started: list[PodmanContainer] = []

    @classmethod
    def checked(cls, image: str = IMAGE) -> ContainerRuntime:
        """The runtime, once podman, runc and the image are known to be there; else why not."""
        missing = [tool for tool in ("podman", "runc", "conmon") if not shutil.which(tool)
                   and not Path(f"/usr/libexec/podman/{tool}").exists() and not Path(f"/usr/bin/{tool}").exists()]
        if missing:
            raise PodRuntimeUnavailable(f"container pods need {', '.join(missing)}: apt-get install -y buildah "
                                        "podman runc mmdebstrap (Debian, as root)")
        if os.geteuid() != 0 or Path("/proc/self/uid_map").read_text().split()[:3] != ["0", "0", "4294967295"]:
            raise PodRuntimeUnavailable("container pods run as real root (podman's storage in /var/lib/containers)")
        if podman("image", "exists", image, check=False).returncode != 0:
            raise PodRuntimeUnavailable(f"no image {image}: build it first (make image)")
        runtime = cls(image)
        runtime.remove_orphans()
        return runtime

    def start(self, name: str, image: str, command: Sequence[str], args: Sequence[str], env: dict[str, str],
              mounts: Sequence[tuple[str, str, bool]], termination_log: Path, log: Path, cwd: Path,
              listen: tuple[str, int]) -> PodmanContainer:
        container = f"{name}-{os.urandom(3).hex()}"
        termination_log.touch()
        termination_log.chmod(0o666)  # written by the container's user, as a kubelet's file is
        argv = ["podman", "run", "--rm", "--name", container, "--label", f"{LABEL}={self.owner}",
                "--network", "host", "--no-healthcheck", "--pull", "never", "--hostname", name,
                "--log-driver", "none", "-v", f"{termination_log}:/dev/termination-log"]
        for host_path, mount_path, read_only in mounts:
            argv += ["-v", f"{host_path}:{mount_path}:{'ro' if read_only else 'rw'}"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        if command:
            argv += ["--entrypoint", command[0]]
        argv += [local_image(image, self.image), *command[1:], *(args or ("serve", *listen_args(listen)))]
        with open(log, "wb") as sink:
            process = subprocess.Popen(argv, env=container_env(), cwd=cwd, stdin=subprocess.DEVNULL, stdout=sink,
                                       stderr=subprocess.STDOUT, preexec_fn=_own_group_dying_with_parent)
        started = PodmanContainer(container, process)
        self.started.append(started)
        return started

    def _listed(self, owner: str | None = None) -> list[tuple[str, str]]:
        label = f"{LABEL}={owner}" if owner else LABEL
        out = podman("ps", "--all", "--filter", f"label={label}", "--format",
                     f'{{{{.Names}}}} {{{{index .Labels "{LABEL}"}}}}', check=False).stdout
        return [tuple(line.split(" ", 1)) for line in out.splitlines() if " " in line]

    def leftovers(self) -> list[str]:
        return [name for name, _ in self._listed(self.owner)]

    def remove_all(self) -> None:
        for started in self.started:
            started.stop(grace=0)
        names = [name for name, _ in self._listed(self.owner)]
        if names:
            podman("rm", "--force", "--time", "0", *names, check=False)

    def remove_orphans(self) -> None:
        """Containers that a test process, now gone, left behind."""
        names = [name for name, owner in self._listed() if not owner.isdigit() or owner_gone(owner)]
        if names:
            podman("rm", "--force", "--time", "0", *names, check=False)
