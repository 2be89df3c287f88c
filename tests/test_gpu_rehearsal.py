"""The GPU run's dress rehearsal: the device-tool call docs/benchmarks.md gives for the lent GPU machine, run here
as written, offline, on a stand-in of that machine, up to the step that needs CUDA.

A GPU machine is lent rarely and briefly, so its one run must not fail on something this machine can show. The
stand-in: a Python 3.12 venv (the machine's Python) holding exactly the packages requirements/gpu-machine.txt says
the machine has, installed without their dependencies, so a package the list forgets is missing here too; torch and
torchvision are small stand-ins (PyPI's CUDA build cannot run here, and its wheels are gigabytes), with the
machine's versions and what the other packages take from them at import. The command runs in a copy of what
the tool sends (the tracked files, untracked ones git does not ignore, and the carried folder) with ``$OUT`` set,
in a network namespace of its own: it must install the carried wheels, import every module the run needs, and stop
at once at the CUDA step, its report under ``$OUT``.

Needs a Python 3.12 interpreter (``python3.12`` on PATH, pyenv's, or ``AIS_WDS_PYTHON312``) and skips, saying so,
where there is none (Debian 12 has 3.11 only): the carried wheels are CPython 3.12 builds, and building an
interpreter would cost the suite minutes. The venv is made once, with network, into
``~/.cache/ais-wds-transformer/gpu-machine-<hash>`` and renamed into place whole; the run itself takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench import gpu
from tests import gpu_wheels

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "docs" / "benchmarks.md"
MACHINE = REPO / "requirements" / "gpu-machine.txt"
CALL = re.compile(r'run\(command="(?P<command>[^"]+)", carry=\[(?P<carry>[^\]]*)\], timeout_s=(?P<timeout>\d+)\)')
STOOD_IN = ("torch", "torchvision")
# What the packages the run imports take from torch at import time (webdataset: ``from torch import Tensor``), and
# what bench.gpu reads of it before the CUDA step.
STAND_INS = {
    "torch": '"""A stand-in for the machine\'s torch: no CUDA here."""\n\n'
             "__version__ = {version!r}\n\n\nclass Tensor:\n    pass\n\n\n"
             "class _Cuda:\n    @staticmethod\n    def is_available() -> bool:\n        return False\n\n\n"
             "class _Version:\n    cuda = None\n\n\ncuda = _Cuda()\nversion = _Version()\n",
    "torchvision": '"""A stand-in for the machine\'s torchvision."""\n\n__version__ = {version!r}\n',
}


def documented_call() -> tuple[str, list[str], int]:
    """The one device-tool call docs/benchmarks.md's GPU section gives: command, carried paths, timeout."""
    section = BENCHMARKS.read_text().split("\n## GPU\n", 1)[1]
    calls = [c for c in CALL.finditer(section) if "bench.gpu" in c.group("command")]
    assert len(calls) == 1, "docs/benchmarks.md, GPU: one run(command=..., carry=[...], timeout_s=...) of bench.gpu"
    call = calls[0]
    carry = [item.strip().strip('"') for item in call.group("carry").split(",") if item.strip()]
    return call.group("command"), carry, int(call.group("timeout"))


def python312() -> str | None:
    """A Python 3.12 interpreter of this machine, or None."""
    candidates = [os.environ.get("AIS_WDS_PYTHON312"), shutil.which("python3.12"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip() == "True":
            return candidate
    return None


def machine_packages() -> tuple[list[str], dict[str, str]]:
    """What pip installs from requirements/gpu-machine.txt, and each stood-in package -> its version there."""
    names, versions = [], {}
    for line in MACHINE.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        requirement = Requirement(text)
        if requirement.name == "python":
            continue
        if requirement.name in STOOD_IN:
            versions[requirement.name] = str(next(iter(requirement.specifier)).version).replace("*", "0")
        else:
            names.append(str(requirement))
    return names, versions


def write_stand_ins(site: Path, versions: dict[str, str]) -> None:
    for name, version in versions.items():
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(STAND_INS[name].format(version=version))
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("tests/test_gpu_rehearsal.py\n")


@pytest.fixture(scope="module")
def machine() -> Path:
    """The stand-in machine's venv (made once per content of gpu-machine.txt and the stand-ins)."""
    interpreter = python312()
    if interpreter is None:
        pytest.skip("no Python 3.12 interpreter here (python3.12 on PATH, ~/.pyenv/versions/3.12*, or "
                    "AIS_WDS_PYTHON312): the GPU machine's Python, which its carried wheels are built for")
    key = hashlib.sha256((MACHINE.read_text() + json.dumps(STAND_INS) + interpreter).encode()).hexdigest()[:12]
    venv = gpu_wheels.cache_root() / f"gpu-machine-{key}"
    if (venv / "ready").exists():
        return venv
    partial = venv.with_name(f"{venv.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        make_machine(interpreter, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    (partial / "ready").write_text(f"{interpreter}\n")
    shutil.rmtree(venv, ignore_errors=True)
    partial.rename(venv)
    # A venv's scripts name its own path: the renamed venv's python is called by path, never through them.
    return venv


def make_machine(interpreter: str, partial: Path) -> None:
    """A venv of ``interpreter`` at ``partial`` with gpu-machine.txt's packages, torch and torchvision stood in."""
    subprocess.run([interpreter, "-m", "venv", str(partial)], check=True, timeout=300)
    names, versions = machine_packages()
    python = partial / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--only-binary=:all:", *names], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"installing gpu-machine.txt's packages failed:\n{done.stderr[-3000:]}"
    # Exactly the list: a requirement it forgets would have been installed beside it, and is missing there.
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True).stdout
    wanted = {canonicalize_name(Requirement(n).name) for n in names}
    more = sorted({canonicalize_name(p["name"]) for p in json.loads(listed)} - wanted)
    assert not more, f"requirements/gpu-machine.txt is not closed: its packages also need {', '.join(more)}"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    write_stand_ins(site, versions)


def what_travels(tree: Path, carry: list[str]) -> None:
    """A copy of what the device tool sends: tracked files, untracked ones git does not ignore, the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name)
    for path in carry:
        assert path == gpu.WHEELS.name, f"the call carries {path}: this rehearsal knows .gpu-wheels only"
        shutil.copytree(gpu_wheels.fetched(), tree / path)


def offline(command: str) -> list[str]:
    """``command`` under bash in a network namespace of its own (as root; else as root of a user namespace)."""
    probe = "python3 -c 'import socket; socket.getaddrinfo(\"pypi.org\", 443)' 2>/dev/null && exit 99"
    return ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "bash", "-c",
            f"{probe}; {command}"]


def test_the_documented_gpu_call_runs_here_offline_up_to_the_cuda_step(machine: Path, tmp_path: Path) -> None:
    command, carry, timeout = documented_call()
    assert carry == [gpu.WHEELS.name] and "$OUT/" in command and timeout <= 600
    tree, out = tmp_path / "tree", tmp_path / "out"
    tree.mkdir()
    out.mkdir()
    what_travels(tree, carry)
    env = {"PATH": f"{machine / 'bin'}:/usr/local/bin:/usr/bin:/bin", "OUT": str(out), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "TMPDIR": str(tmp_path)}
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to run the command without network")
    started = time.monotonic()
    done = subprocess.run(offline(command), cwd=tree, env=env, capture_output=True, text=True,
                          timeout=min(timeout, 300))
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 99, "the namespace reached the network: the rehearsal would not be offline"
    assert done.returncode == 1, f"exit {done.returncode}:\n{output[-4000:]}"
    report = out / "gpu"
    results = json.loads((report / "results.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["install", "imports", "cuda"], output[-4000:]
    install, imports = parts["install"], parts["imports"]
    assert install["status"] == "passed" and install["unmet"] == [], install
    assert len(install["wheels"]) == len(list((tree / gpu.WHEELS.name).glob("*.whl")))
    assert imports["status"] == "passed" and imports["failed"] == {}, imports
    assert {"tqdm", "skimage", "aistore", "webdataset", "hypothesis", "torch"} <= set(imports["modules"])
    assert parts["cuda"]["status"] == "failed" and parts["cuda"]["reason"].startswith("no CUDA device")
    assert results["environment"]["python"].startswith("3.12.") and results["environment"]["torch"].startswith("2.11")
    assert results["ok"] is False and results["meta"]["finished"] is True
    markdown = (report / "results.md").read_text()
    assert markdown.startswith("# GPU check: FAILED") and markdown in done.stdout  # printed last: the output tail
    assert seconds < 120, f"the run took {seconds:.0f} s to reach the CUDA step"


def test_the_rehearsal_sees_a_forgotten_package(machine: Path, tmp_path: Path) -> None:
    """The stand-in machine holds exactly the list: a module the run imports that the list lacks fails there."""
    python = machine / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import aistore"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "No module named 'aistore'" in done.stderr  # carried, never on the machine
    seen = subprocess.run([str(python), "-c", "import tqdm, skimage, torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0 and seen.stdout.strip() == "False", seen.stderr
