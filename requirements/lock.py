"""Lock every dependency, then write what is generated from the lock: ``python requirements/lock.py`` (``make lock``).

One lock, ``uv.lock`` beside pyproject.toml, holds the exact versions and the sha256 of every file of each, for
CPython on x86-64 Linux and every Python the project supports, every extra and dependency group; ``uv lock``
resolves it from pyproject.toml (uv itself comes from the lock's ``lock`` group). From it this script writes:

* ``requirements/dev.txt``: what ``make install`` installs into ``.venv`` with ``pip --require-hashes --no-deps``:
  the extras in ``DEV_EXTRAS`` and the ``install`` and ``lock`` groups (pip, the build backend, uv), each line
  with its environment marker (``uv export``);
* ``requirements/server.txt``: the image's runtime packages except torch and torchvision (the dependencies,
  the ``server`` extra and the build backend), each with the sha256 of every wheel of its version, installed
  with ``--no-deps --require-hashes``;
* ``requirements/torch.txt``: ``torch`` and ``torchvision``, installed from PyTorch's own index (CPU wheels by
  default, a CUDA index via the Dockerfile's ``TORCH_INDEX``). No hashes: the CPU and CUDA builds of one version
  are different files. PyPI's torch is the CUDA build; its CUDA runtime requirements (``nvidia-*``, ``cuda-*``,
  ``triton``) are left out of the image's files because the CPU wheel has none and a CUDA index brings its own;
* the ``==`` pins of ``requirements/gpu-check.txt`` and ``requirements/scaling-check.txt``: the wheels carried
  to the CPython 3.12 device machine are the lock's versions for 3.12.

So the venv, the image and the carried wheels share one resolution, and a new release on PyPI changes none of
them until the lock is made again.

    python requirements/lock.py           # uv lock, then every file above
    python requirements/lock.py --check   # offline: exit 1 naming each file that is not what uv.lock gives
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10: the lock installs tomli there (pytest needs it)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "uv.lock"
REQUIREMENTS = ROOT / "requirements"
DEV = REQUIREMENTS / "dev.txt"
SERVER = REQUIREMENTS / "server.txt"
TORCH = REQUIREMENTS / "torch.txt"
CARRIED = (REQUIREMENTS / "gpu-check.txt", REQUIREMENTS / "scaling-check.txt")
PROJECT = "ais-wds-transformer"
# What make install puts in .venv: every extra but fuzz (atheris, for long runs outside the suite).
DEV_EXTRAS = ("server", "client", "demo", "bench", "dali", "test")
DEV_GROUPS = ("install", "lock")
PYTHON = "3.11"  # the image's: must match the Dockerfile's PYTHON_VERSION (tests/test_deploy.py checks)
PYTHON_FULL = "3.11.14"
DEVICE_PYTHON_FULL = "3.12.3"  # the device machine's (requirements/gpu-machine.txt)
TORCH_PACKAGES = ("torch", "torchvision")
_CUDA_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


def environment(python_full: str) -> dict[str, str]:
    """The marker environment of CPython ``python_full`` on x86-64 Linux."""
    return {"implementation_name": "cpython", "implementation_version": python_full, "os_name": "posix",
            "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": python_full,
            "python_version": ".".join(python_full.split(".")[:2]), "sys_platform": "linux", "extra": ""}


def _applies(marker: str | None, env: dict[str, str]) -> bool:
    return marker is None or Marker(marker).evaluate(env)


@dataclass
class Locked:
    """One package of uv.lock as installed in one environment, and what pulled it in."""

    name: str
    version: str
    entry: dict
    parents: set[str] = field(default_factory=set)

    def hashes(self, wheels_only: bool = True) -> list[str]:
        files = list(self.entry.get("wheels", []))
        if not wheels_only and "sdist" in self.entry:
            files.append(self.entry["sdist"])
        return sorted(f["hash"].removeprefix("sha256:") for f in files)


def read_lock(path: Path = LOCK) -> list[dict]:
    """The ``[[package]]`` tables of uv.lock."""
    return tomllib.loads(path.read_text())["package"]


def _entry(packages: list[dict], name: str, version: str | None, env: dict[str, str]) -> dict:
    """The lock's table for ``name`` (at ``version`` where the dependency names one; else the one whose
    resolution markers hold in ``env``)."""
    found = [p for p in packages if p["name"] == name and (version is None or p["version"] == version)]
    if len(found) > 1:
        found = [p for p in found if any(_applies(m, env) for m in p.get("resolution-markers", [None]))]
    if len(found) != 1:
        raise SystemExit(f"uv.lock: {len(found)} entries for {name}{'==' + version if version else ''} in this "
                         "environment: run python requirements/lock.py")
    return found[0]


def installed(packages: list[dict], env: dict[str, str], extras: tuple[str, ...] = (),
              groups: tuple[str, ...] = (), base: bool = True, prune=None) -> dict[str, Locked]:
    """Every package of the lock that installing the project (its dependencies when ``base``, ``extras`` and
    dependency ``groups``) pulls into ``env``, walking the lock's dependency edges with their markers.
    ``prune(parent, child)`` true leaves a child and what only it pulls in out."""
    project = next(p for p in packages if p["name"] == PROJECT)
    roots = list(project.get("dependencies", [])) if base else []
    for extra in extras:
        roots += project["optional-dependencies"][extra]
    for group in groups:
        roots += project["dev-dependencies"][group]
    found: dict[str, Locked] = {}
    seen: set[tuple[str, str]] = set()
    pending = [(dependency, PROJECT) for dependency in roots]
    while pending:
        dependency, parent = pending.pop()
        name = dependency["name"]
        if not _applies(dependency.get("marker"), env) or (prune and prune(parent, name)):
            continue
        entry = _entry(packages, name, dependency.get("version"), env)
        locked = found.setdefault(name, Locked(name, entry["version"], entry))
        if locked.version != entry["version"]:
            raise SystemExit(f"uv.lock: two versions of {name} in one environment")
        locked.parents.add(parent)
        for extra in ["", *dependency.get("extra", [])]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            children = entry.get("dependencies", []) if not extra else entry.get("optional-dependencies", {})[extra]
            pending += [(child, name) for child in children]
    return found


def build_backend() -> tuple[str, ...]:
    """The names pyproject.toml's ``[build-system] requires`` lists (the image builds the package's wheel)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return tuple(canonicalize_name(Requirement(text).name) for text in project["build-system"]["requires"])


def image_packages(packages: list[dict]) -> dict[str, Locked]:
    """What the image installs: the dependencies, the server extra and the build backend, without the CUDA
    runtime that PyPI's torch requires."""
    env = environment(PYTHON_FULL)
    found = installed(packages, env, ("server",), prune=lambda parent, child: parent == "torch"
                      and bool(_CUDA_RUNTIME.match(child)))
    backend = installed(packages, env, groups=("install",), base=False)
    for name in build_backend():
        found.setdefault(name, backend[name]).parents.add("pyproject.toml")
    return found


def server_text(packages: list[dict]) -> str:
    found = image_packages(packages)
    lines = [
        "# Runtime packages of the image except torch/torchvision (requirements/torch.txt), pinned with",
        "# the sha256 of every wheel of each release. Generated from uv.lock by `python requirements/lock.py`",
        "# (the dependencies + [server] extra + build backend); do not edit by hand.",
        f"# python: {PYTHON}",
        "",
    ]
    for name in sorted(found):
        if name in TORCH_PACKAGES:
            continue
        locked = found[name]
        hashes = locked.hashes()
        if not hashes:
            raise SystemExit(f"uv.lock: {name}=={locked.version} has no wheels; the image installs wheels only")
        lines.append(f"{name}=={locked.version} \\")
        lines.extend(f"    --hash=sha256:{digest} \\" for digest in hashes[:-1])
        lines.append(f"    --hash=sha256:{hashes[-1]}")
        parents = sorted("pyproject.toml" if p == PROJECT else p for p in locked.parents)
        lines.append(f"    # via {', '.join(parents)}")
    return "\n".join(lines) + "\n"


def torch_text(packages: list[dict]) -> str:
    found = image_packages(packages)
    return "\n".join([
        "# torch and torchvision from PyTorch's wheel index (Dockerfile build argument TORCH_INDEX; CPU",
        "# wheels by default). No hashes: the CPU and CUDA builds of a version are different files.",
        "# Generated from uv.lock by `python requirements/lock.py`; do not edit by hand.",
        *(f"{name}=={found[name].version}" for name in TORCH_PACKAGES),
    ]) + "\n"


def device_version(packages: list[dict], name: str) -> str:
    """The lock's version of ``name`` for the device machine's Python."""
    env = environment(DEVICE_PYTHON_FULL)
    found = [p for p in packages if p["name"] == name]
    if len(found) > 1:
        found = [p for p in found if any(_applies(m, env) for m in p.get("resolution-markers", [None]))]
    if len(found) != 1:
        raise SystemExit(f"{name} is carried to the device machine but uv.lock has no single version of it for "
                         f"Python {DEVICE_PYTHON_FULL}: add it to an extra or group of pyproject.toml, then lock")
    return found[0]["version"]


def carried_text(path: Path, packages: list[dict]) -> str:
    """``path`` with each ``name==version`` pin set to the lock's version for the device; comments kept."""
    lines = []
    for line in path.read_text().splitlines():
        text, _, comment = line.partition("#")
        if text.strip():
            requirement = Requirement(text.strip())
            pinned = device_version(packages, canonicalize_name(requirement.name))
            extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
            line = f"{requirement.name}{extras}=={pinned}" + (f"  #{comment}" if comment else "")
        lines.append(line)
    return "\n".join(lines) + "\n"


def uv() -> str:
    """The uv that make install put beside this Python (the lock group), else one on PATH."""
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if found is None:
        raise SystemExit("uv not found: make install installs it into .venv (the lock group of pyproject.toml)")
    return found


def dev_text() -> str:
    """requirements/dev.txt as ``uv export`` writes it from uv.lock (offline: ``--frozen``)."""
    command = [uv(), "export", "--frozen", "--no-emit-project", "--no-default-groups", "--quiet",
               *(f"--extra={extra}" for extra in DEV_EXTRAS), *(f"--group={group}" for group in DEV_GROUPS)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    header = ("# What make install installs into .venv, exactly: generated from uv.lock by `python "
              "requirements/lock.py`\n# (uv export); do not edit by hand.\n")
    return header + "\n".join(line for line in done.stdout.splitlines() if not line.startswith("#    uv ")
                              and not line.startswith("# This file was autogenerated")) + "\n"


def dev_problems(text: str, packages: list[dict], env: dict[str, str]) -> list[str]:
    """Where requirements/dev.txt (``text``) is not the lock in ``env``: each line that applies there must be a
    package the lock installs there, at its version, with the sha256 of every one of its files; and every such
    package must have its line. Read without uv, so that it runs offline anywhere."""
    wanted = installed(packages, env, DEV_EXTRAS, DEV_GROUPS)
    problems, seen = [], set()
    for line in text.replace("\\\n", " ").splitlines():
        requirement_text, _, _ = line.partition("#")
        if not requirement_text.strip():
            continue
        requirement = Requirement(requirement_text.split(" --hash=", 1)[0].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        name = canonicalize_name(requirement.name)
        seen.add(name)
        hashes = sorted(re.findall(r"--hash=sha256:([0-9a-f]{64})", requirement_text))
        (specifier,) = requirement.specifier
        if name not in wanted:
            problems.append(f"{name}: in dev.txt, not installed by the lock here")
        elif specifier.operator != "==" or specifier.version != wanted[name].version:
            problems.append(f"{name}: dev.txt says {specifier}, the lock =={wanted[name].version}")
        elif hashes != wanted[name].hashes(wheels_only=False):
            problems.append(f"{name}=={specifier.version}: dev.txt's hashes are not the lock's")
    problems += [f"{name}=={wanted[name].version}: installed by the lock here, missing from dev.txt"
                 for name in sorted(set(wanted) - seen)]
    return problems


def generated(packages: list[dict]) -> dict[Path, str]:
    """Each file generated from the lock, but dev.txt (uv export writes it) -> its content."""
    files = {SERVER: server_text(packages), TORCH: torch_text(packages)}
    files.update({path: carried_text(path, packages) for path in CARRIED})
    return files


def stale(envs: tuple[str, ...] = ("3.10.18", PYTHON_FULL, DEVICE_PYTHON_FULL, "3.13.9")) -> list[str]:
    """The generated files that are not what uv.lock gives (dev.txt: in each Python of ``envs``)."""
    packages = read_lock()
    problems = [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} is not what uv.lock gives: "
                "python requirements/lock.py"
                for path, text in generated(packages).items() if path.read_text() != text]
    for python in envs:
        problems += [f"requirements/dev.txt, Python {python}: {problem} (python requirements/lock.py)"
                     for problem in dev_problems(DEV.read_text(), packages, environment(python))]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python requirements/lock.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the generated files with uv.lock")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    subprocess.run([uv(), "lock"], cwd=ROOT, check=True)
    packages = read_lock()
    DEV.write_text(dev_text())
    for path, text in generated(packages).items():
        path.write_text(text)
    found = image_packages(packages)
    print(f"uv.lock: {len(packages)} packages; requirements/dev.txt, server.txt ({len(found) - len(TORCH_PACKAGES)} "
          f"packages), torch.txt ({', '.join(f'{n}=={found[n].version}' for n in TORCH_PACKAGES)}) and the carried "
          "wheels' pins written from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
