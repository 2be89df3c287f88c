"""Part 0: the carried wheels installed and checked against their pins, every module the run imports
imported, and the rest of the run handed to a child with the wheels first on its path."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from .budget import Budget, check
from .constants import ABSENT, CARRIED, INSTALLED, NEVER_CALLED, REPO, WHEELS

# ---- 0. the carried wheels, and every module the run imports ----------------------------------------------


def run_files() -> list[Path]:
    """The files the run starts from: this package, the example it runs and the tests it collects."""
    tests = REPO / "tests"
    return [*sorted((REPO / "bench" / "gpu").glob("*.py")), REPO / "examples" / "prefetch_overlap.py",
            tests / "conftest.py", *sorted((tests / "client").glob("*.py"))]


def needed_modules() -> dict[str, str]:
    """Each third-party module the run imports (inside functions too, the pod's side left out) -> where; without
    the ``ABSENT`` ones."""
    from ..imports import third_party_imports

    found = third_party_imports(run_files(), follow_functions=True, never_called=NEVER_CALLED)
    return {module: where for module, where in sorted(found.items()) if module not in ABSENT}


def wheels_problem(wheels: Path, carried: Path = CARRIED) -> str | None:
    """Why ``wheels`` is not the set of ``carried``'s pins (missing, empty, a pin without its wheel, a wheel
    without its pin), or None. Checked before anything else: the run cannot work without them."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    fix = (f"run `make gpu-wheels` in the checkout the call is made from, and carry the folder: "
           f"run(command=..., carry=[\"{WHEELS.name}\"], ...)")
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels}: {fix}"
    pins = {}
    for line in carried.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            requirement = Requirement(text)
            pins[canonicalize_name(requirement.name)] = str(next(iter(requirement.specifier)).version)
    found = {str(parse_wheel_filename(f.name)[0]): str(parse_wheel_filename(f.name)[1]) for f in files}
    if found != pins:
        missing = sorted(f"{n}=={v}" for n, v in pins.items() if found.get(n) != v)
        extra = sorted(f"{n}=={v}" for n, v in found.items() if pins.get(n) != v)
        return (f"{wheels} is not {carried.relative_to(REPO)}: missing {', '.join(missing) or 'none'}; not pinned "
                f"{', '.join(extra) or 'none'}: {fix}")
    return None


def import_all(modules: dict[str, str]) -> dict:
    """Each module of ``modules`` imported here (the machine's packages and the carried wheels): a missing one
    fails the run in seconds instead of half-way through."""
    import importlib

    failed = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import error names what to carry or install
            failed[module] = f"{type(exc).__name__}: {exc}"[:300]
    result = {"modules": sorted(modules), "failed": failed}
    check(result, "every module the run imports is there", not failed,
          "; ".join(f"{m} (imported at {modules[m]}): {why}" for m, why in failed.items()))
    return result


def install(wheels: Path, site: Path) -> dict:
    """The wheels in ``wheels`` installed into ``site`` (no index, no dependencies resolved: the
    machine's own packages stay); and every requirement of an installed wheel that ``site`` and this
    process's path together do not meet. The run goes on in a child with ``site`` first on its path
    (``carried_env``)."""
    from importlib import metadata

    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise RuntimeError(f"no wheels in {wheels} (make gpu-wheels fetches them)")
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(site), *map(str, files)],
                   check=True, timeout=120)
    from packaging.requirements import Requirement
    from packaging.version import Version

    search = [str(site), *sys.path]  # the child's path: the carried wheels first
    unmet = []
    installed = []
    for dist in metadata.distributions(path=[str(site)]):
        installed.append(f"{dist.metadata['Name']}=={dist.version}")
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            found = next((d.version for d in metadata.distributions(name=requirement.name, path=search)), None)
            if found is None:
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(Version(found), prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {requirement}: {found} is installed")
    result = {"wheels": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files),
              "installed": sorted(installed), "unmet": sorted(unmet)}
    check(result, "every requirement of the wheels met", not unmet, "; ".join(sorted(unmet)))
    return result


def carried_env(site: Path, **extra: str) -> dict[str, str]:
    """This environment with ``site`` first on PYTHONPATH: a child imports the carried wheels before the machine's."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
            **extra}


def on_carried_wheels(argv: list[str], site: Path, work: Path, budget: Budget, results: dict, started: float) -> int:
    """The rest of the run in a child whose path has the carried wheels first; the child writes the results.

    It gets the same arguments, the same work folder and the budget left; ``INSTALLED`` hands it what this
    process measured so far (the install part, the start time, the command as given)."""
    state = {"parts": results["parts"], "meta": results["meta"], "started": started}
    command = [sys.executable, "-m", "bench.gpu", *argv, "--work", str(work), "--budget", f"{budget.left():.1f}"]
    return subprocess.run(command, cwd=REPO, env=carried_env(site, **{INSTALLED: json.dumps(state)})).returncode


def environment(smoke: bool) -> dict:
    import importlib.metadata as metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    return {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpus": os.cpu_count(), "dev_shm_gib": round(shm.total / 2**30, 1) if shm else None,
        "packages": {name: version(name) for name in ("torchvision", "numpy", "webdataset", "aistore", "pydantic",
                                                      "requests", "urllib3", "pytest")},
        "smoke": smoke,
    }
