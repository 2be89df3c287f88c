"""``make image``: build the pod's image from the Dockerfile, with Docker or, where no engine runs, buildah.

    python3 -m scripts.image            # build localhost/ais-wds-transformer:dev (standard library only)
    python3 -m scripts.image --print    # what it would use (engine, base, torch index), nothing built

What it decides, in order:

* **Engine.** ``docker build`` when a Docker engine answers; otherwise ``buildah bud`` as root with
  runc and the settings in ``scripts/containers.conf`` (Debian: ``apt-get install buildah podman runc
  mmdebstrap``). Everything is kept in ``/var/lib/containers/storage``.
* **Base** (``BASE_IMAGE``). Yours, if set. Otherwise the Dockerfile's default
  (``python:3.11-slim-trixie``) when it is already local or can be pulled; where the registry cannot
  be reached, a stand-in made from Debian's packages (``mmdebstrap``: Debian 12, whose Python is the
  3.11 the lock files are for, with this host's extra CA certificates so that pip trusts the index
  this host is configured to use), kept as ``localhost/ais-wds-transformer-base:py3.11-bookworm``.
* **Torch index** (``TORCH_INDEX``). Yours, if set; otherwise the Dockerfile's default (PyTorch's CPU
  wheels) when it answers, else the index pip is configured to use here (then the image holds
  PyPI's CUDA build of torch: about 6 GB instead of about 1.5 GB).

After a build, older images of the project and dangling build layers are removed (``--keep`` keeps
them), so the project's images and build cache stay bounded however often it is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = REPO / "scripts" / "containers.conf"
# The one local name of the built image: the fake kubelet (testbed/pods.py) runs it for any
# image AIS asks for whose repository is ais-wds-transformer (k8s/etl-spec.yaml's, the tests').
IMAGE = os.environ.get("AIS_WDS_IMAGE", "localhost/ais-wds-transformer:dev")
STAND_IN = "localhost/ais-wds-transformer-base:py{python}-{suite}"
DEBIAN_SUITES = {"3.11": "bookworm", "3.13": "trixie"}  # the release whose python3 is that version
APT_PACKAGES = "buildah podman runc mmdebstrap"


class ImageError(RuntimeError):
    """The image cannot be built here; the message says what is missing and how to get it."""


def log(message: str) -> None:
    print(f"[image] {message}", file=sys.stderr, flush=True)


def dockerfile_args() -> dict[str, str]:
    """The Dockerfile's global ARG defaults, ``${NAME}`` references resolved."""
    args: dict[str, str] = {}
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            break
        match = re.match(r"ARG (\w+)=(\S+)", line)
        if match:
            args[match.group(1)] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), match.group(2))
    return args


def container_env() -> dict[str, str]:
    """This environment plus ``CONTAINERS_CONF`` (podman, buildah), unless the caller chose their own."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def _quiet(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=container_env())


def engine() -> str:
    """``docker`` when an engine answers, else ``buildah`` (with podman beside it, which runs the image)."""
    if shutil.which("docker"):
        try:
            if _quiet(["docker", "info", "--format", "{{.ServerVersion}}"], 20).returncode == 0:
                return "docker"
        except subprocess.TimeoutExpired:
            pass
    missing = [tool for tool in ("buildah", "podman", "runc") if not shutil.which(tool)]
    if missing:
        raise ImageError(f"no Docker engine answers and {', '.join(missing)} is not installed: "
                         f"apt-get install -y {APT_PACKAGES} (Debian, as root)")
    if os.geteuid() != 0:
        raise ImageError("buildah builds here as root (rootless storage needs subuids this script does not set "
                         "up): run make image as root, or with a Docker engine")
    return "buildah"


def image_exists(tool: str, name: str) -> bool:
    if tool == "docker":
        return _quiet(["docker", "image", "inspect", name]).returncode == 0
    return _quiet(["podman", "image", "exists", name]).returncode == 0


def _pull(tool: str, name: str, timeout: float) -> bool:
    command = [tool, "pull", name] if tool == "docker" else ["podman", "pull", "--quiet", name]
    try:
        result = _quiet(command, timeout)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def _qualified(name: str) -> str:
    """Docker Hub's spelling of a short name (``python:3.11`` -> ``docker.io/library/python:3.11``)."""
    first = name.split("/", 1)[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def base_image(tool: str) -> str:
    """The base the build starts from (see the module docstring)."""
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    args = dockerfile_args()
    default = _qualified(args["BASE_IMAGE"])
    stand_in = STAND_IN.format(python=args["PYTHON_VERSION"], suite=DEBIAN_SUITES.get(args["PYTHON_VERSION"], "?"))
    for name in (default, stand_in):
        if image_exists(tool, name):
            return name
    log(f"pulling {default}")
    if _pull(tool, default, timeout=120):
        return default
    log(f"{default} cannot be pulled here: making a stand-in from Debian's packages")
    make_stand_in(tool, args["PYTHON_VERSION"], stand_in)
    return stand_in


def make_stand_in(tool: str, python: str, name: str) -> None:
    """A minimal Debian with ``python`` and its venv module, trusting this host's extra CA certificates."""
    suite = DEBIAN_SUITES.get(python)
    if suite is None:
        raise ImageError(f"no Debian release ships Python {python}: set BASE_IMAGE to an image with it")
    if not shutil.which("mmdebstrap"):
        raise ImageError(f"the stand-in base needs mmdebstrap: apt-get install -y {APT_PACKAGES}")
    started = time.monotonic()
    extra_certs = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    with tempfile.TemporaryDirectory(prefix="ais-wds-base-") as work:
        certs = Path(work) / "certs"
        certs.mkdir()
        for cert in extra_certs:  # none is fine: then the index is trusted through Debian's own bundle
            shutil.copy(cert, certs / cert.name)
        rootfs = Path(work) / "rootfs.tar"
        hooks = [
            f'cp {certs}/. "$1/usr/local/share/ca-certificates/" -r && chroot "$1" update-ca-certificates',
            'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
        ]
        packages = "python3,python3-venv,python-is-python3,ca-certificates"
        command = ["mmdebstrap", "--variant=minbase", f"--include={packages}",
                   *[f"--customize-hook={hook}" for hook in hooks], suite, str(rootfs)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        if result.returncode != 0:
            raise ImageError(f"mmdebstrap failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        imported = _quiet([tool if tool == "docker" else "podman", "import", "--change", 'CMD ["python3"]',
                           "--change", "ENV LANG=C.UTF-8", str(rootfs), name], 600)
        if imported.returncode != 0:
            raise ImageError(f"importing the stand-in base failed:\n{imported.stderr[-2000:]}")
    log(f"stand-in base {name} made in {time.monotonic() - started:.0f} s "
        f"({len(extra_certs)} extra CA certificate(s) from this host)")


def _answers(url: str, timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as response:
            return response.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pip_index() -> str:
    """The index pip is configured to use on this host (its configuration or PIP_INDEX_URL), else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    for python in (sys.executable, "python3"):
        try:
            result = subprocess.run([python, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                                    text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    return "https://pypi.org/simple"


def torch_index() -> str | None:
    """``TORCH_INDEX`` for the build: None keeps the Dockerfile's default (PyTorch's CPU wheels)."""
    if os.environ.get("TORCH_INDEX"):
        return os.environ["TORCH_INDEX"]
    default = re.search(r"ARG TORCH_INDEX=(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    if _answers(default.rstrip("/") + "/torch/"):
        return None
    index = pip_index()
    log(f"{default} does not answer here: torch from {index} (its CUDA build: a larger image)")
    return index


@dataclass
class Plan:
    tool: str
    base: str
    torch_index: str | None
    tag: str

    def command(self) -> list[str]:
        args = ["--build-arg", f"BASE_IMAGE={self.base}"]
        if self.torch_index:
            args += ["--build-arg", f"TORCH_INDEX={self.torch_index}"]
        if self.tool == "docker":
            return ["docker", "build", *args, "-t", self.tag, str(REPO)]
        # --layers: reuse unchanged steps; --force-rm: a failed build leaves no working container;
        # --network host: pip reaches the index as this host does; --format docker keeps HEALTHCHECK.
        return ["buildah", "bud", "--layers", "--force-rm", "--pull=never", "--format", "docker", "--network", "host",
                *args, "-t", self.tag, "-f", str(REPO / "Dockerfile"), str(REPO)]


def plan(tag: str = IMAGE) -> Plan:
    tool = engine()
    return Plan(tool, base_image(tool), torch_index(), tag)


def build(chosen: Plan) -> float:
    """Run the build, its output streamed; seconds taken."""
    log(f"building {chosen.tag} with {chosen.tool} from {chosen.base}")
    started = time.monotonic()
    result = subprocess.run(chosen.command(), env=container_env(), cwd=REPO)
    if result.returncode != 0:
        raise ImageError(f"{chosen.tool} build failed (exit {result.returncode}): see its output above")
    return time.monotonic() - started


def prune(chosen: Plan) -> None:
    """Older images of the project (other IDs under the same repository) and dangling layers, removed."""
    if chosen.tool == "docker":
        _quiet(["docker", "image", "prune", "--force"], 600)
        return
    repository = chosen.tag.rsplit(":", 1)[0]
    current = _quiet(["podman", "image", "inspect", "--format", "{{.Id}}", chosen.tag]).stdout.strip()
    listed = _quiet(["podman", "images", "--noheading", "--format", "{{.Id}} {{.Repository}}:{{.Tag}}",
                     "--filter", f"reference={repository}"]).stdout.split("\n")
    stale = {line.split()[0] for line in listed if line.strip() and not current.startswith(line.split()[0])}
    for image in stale:
        _quiet(["podman", "rmi", "--force", image], 600)
    _quiet(["podman", "image", "prune", "--force"], 600)


def storage_bytes(chosen: Plan) -> int:
    """What the container storage holds now (images, layers, build cache)."""
    if chosen.tool == "docker":
        return 0
    info = json.loads(_quiet(["podman", "info", "--format", "json"]).stdout or "{}")
    root = Path(info.get("store", {}).get("graphRoot", "/var/lib/containers/storage"))
    result = subprocess.run(["du", "-sbx", str(root)], capture_output=True, text=True, timeout=600)
    return int(result.stdout.split()[0]) if result.returncode == 0 and result.stdout else 0


def image_bytes(chosen: Plan) -> int:
    tool = "docker" if chosen.tool == "docker" else "podman"
    out = _quiet([tool, "image", "inspect", "--format", "{{.Size}}", chosen.tag]).stdout.strip()
    return int(out) if out.isdigit() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=IMAGE, help=f"the image's name (default {IMAGE}; env AIS_WDS_IMAGE)")
    parser.add_argument("--print", action="store_true", dest="dry", help="say what would be used; build nothing")
    parser.add_argument("--keep", action="store_true", help="keep older images and dangling layers")
    args = parser.parse_args(argv)
    try:
        chosen = plan(args.tag)
        if args.dry:
            print(json.dumps({"engine": chosen.tool, "base": chosen.base, "torch_index": chosen.torch_index,
                              "tag": chosen.tag, "command": chosen.command()}, indent=1))
            return 0
        seconds = build(chosen)
        if not args.keep:
            prune(chosen)
    except ImageError as exc:
        log(f"error: {exc}")
        return 1
    size = image_bytes(chosen)
    stored = storage_bytes(chosen)
    log(f"{chosen.tag} built in {seconds:.0f} s: {size / 1e9:.2f} GB"
        + (f"; container storage holds {stored / 1e9:.1f} GB" if stored else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
