"""What python -m bench.gpu needs on the GPU machine is there: every requirement of the carried wheels
(requirements/gpu-check.txt, read from their METADATA) and every import of the code that runs there, inside
functions too, is met by a carried wheel or by the machine's own packages (requirements/gpu-machine.txt), for
Python 3.12 on Linux; and the wheels `make gpu-wheels` fetched are the pins, of the size docs/benchmarks.md says."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from bench import gpu
from bench.imports import LOCAL, third_party_imports
from bench.imports import imports as _imports  # noqa: F401  (tests/test_scaling_wheels.py reads them from here)
from bench.imports import local_file as _local_file  # noqa: F401
from tests import gpu_wheels

REPO = Path(__file__).resolve().parents[1]
CARRIED = REPO / "requirements" / "gpu-check.txt"
MACHINE = REPO / "requirements" / "gpu-machine.txt"
WHEELS = REPO / ".gpu-wheels"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
TRAVELS = 64 * 2**20  # the working tree and the carried paths together, per call of the device tool
# The GPU machine's interpreter and platform, for environment markers.
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
assert LOCAL  # the crawl's own packages, shared with tests/test_scaling_wheels.py


def lines(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines())
            if line]


def carried() -> dict[str, Version]:
    pins = {}
    for requirement in lines(CARRIED):
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{CARRIED.name}: {requirement} is not pinned with =="
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def machine() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in lines(MACHINE)}


def requires_dist(name: str, version: Version, wheels: Path = WHEELS, target: str = "gpu-wheels") -> list[Requirement]:
    """The Requires-Dist of ``name==version``: from its wheel in ``wheels`` (``make target``), else from the same
    version installed here (the pins are uv.lock's, and so is the venv: tests/test_lock.py)."""
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if wheel_name == name and wheel_version == version:
            with zipfile.ZipFile(wheel) as archive:
                member = next(m for m in archive.namelist() if m.endswith(".dist-info/METADATA"))
                message = email.parser.Parser().parsestr(archive.read(member).decode())
            return [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    try:
        installed = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or Version(installed.version) != version:
        pytest.fail(f"cannot read {name}=={version}'s requirements: no wheel in {wheels.name}/ and "
                    f"{'not installed' if installed is None else f'{installed.version} installed'} here; the "
                    f"pin is not the venv's: make install installs the lock, make lock pins the lock's versions; "
                    f"or make {target}")
    return [Requirement(r) for r in installed.requires or []]


def unmet(requirement: Requirement, pins: dict[str, Version], there: dict[str, Requirement]) -> str | None:
    """Why ``requirement`` is not met on the GPU machine, or None."""
    if requirement.marker is not None and not requirement.marker.evaluate(MARKERS):
        return None
    return unmet_there(requirement, pins, there)


def unmet_there(requirement: Requirement, pins: dict[str, Version], there: dict[str, Requirement]) -> str | None:
    """Why ``requirement`` (its marker already judged) is not met by the carried ``pins`` or the machine's
    packages ``there``, or None."""
    name = canonicalize_name(requirement.name)
    if name in pins:
        if requirement.specifier.contains(pins[name], prereleases=True):
            return None
        return f"carried {name}=={pins[name]} does not satisfy it"
    if name not in there:
        return "neither carried nor on the machine"
    if not requirement.specifier:
        return None
    known = [s for s in there[name].specifier if s.operator == "=="]
    if known and requirement.specifier.contains(Version(known[0].version.replace(".*", ".0")), prereleases=True):
        return None
    return f"the machine's {name} is of unknown or other version ({there[name]}): carry it"


def test_every_requirement_of_the_carried_wheels_is_met_there() -> None:
    pins, there = carried(), machine()
    problems = []
    for name, version in pins.items():
        for requirement in requires_dist(name, version):
            why = unmet(requirement, pins, there)
            if why:
                problems.append(f"{name}=={version} needs {requirement}: {why}")
    assert not problems, "\n".join(problems)


def provided(module: str, pins: dict, there: dict) -> bool:
    """Whether the distribution that holds ``module`` (as installed here) is carried or on the machine."""
    names = {canonicalize_name(n) for n in metadata.packages_distributions().get(module, [module])}
    return bool(names & (set(pins) | set(there)))


def test_every_import_of_the_code_that_runs_there_is_carried_or_there() -> None:
    pins, there = carried(), machine()
    providers = metadata.packages_distributions()
    found = gpu.needed_modules()
    # Imported only inside functions: a crawl of module-level imports alone misses them.
    assert {"tqdm", "skimage", "psutil", "torch", "webdataset", "aistore", "hypothesis"} <= set(found), sorted(found)
    problems = []
    for module, where in sorted(found.items()):
        if not provided(module, pins, there):
            names = ", ".join(sorted(canonicalize_name(n) for n in providers.get(module, [module])))
            problems.append(f"{where} imports {module} ({names}): neither carried nor there")
    assert not problems, "\n".join(problems)


def test_the_crawl_follows_imports_inside_functions_but_not_into_the_pods_side() -> None:
    module_level = third_party_imports(gpu.run_files(), follow_functions=False)
    assert "tqdm" not in module_level and "skimage" not in module_level  # imported inside functions only
    assert {"tqdm", "skimage"} <= set(gpu.needed_modules())
    everything = third_party_imports(gpu.run_files())
    # The command line reaches the pod's server from a function; the run never calls it.
    assert {"fastapi", "uvicorn"} <= set(everything) and not {"fastapi", "uvicorn"} & set(gpu.needed_modules())


def test_what_the_machine_lacks_on_purpose_is_skipped_there() -> None:
    everything = third_party_imports(gpu.run_files(), never_called=gpu.NEVER_CALLED)
    pins, there = carried(), machine()
    for module, skip in gpu.ABSENT.items():
        assert module in everything, f"nothing the run reaches imports {module}: drop it from bench.gpu.ABSENT"
        assert skip in gpu.EXPECTED_SKIPS and module not in gpu.needed_modules()
        assert not provided(module, pins, there), f"{module} is there after all: drop it from bench.gpu.ABSENT"


def test_the_wheels_are_the_pins_and_the_doc_states_their_count_and_size() -> None:
    """What travels to the machine: exactly the pinned wheels, of the count and size docs/benchmarks.md gives,
    and with the working tree within the device tool's limit."""
    wheels = gpu_wheels.fetched()
    assert gpu.wheels_problem(wheels) is None
    files = sorted(wheels.glob("*.whl"))
    section = BENCHMARKS.read_text().split("\n## GPU\n", 1)[1]
    stated = re.search(r"(\d+) wheels, ([\d.]+) MiB", section)
    assert stated, "docs/benchmarks.md, GPU: the carried wheels' count and size ('N wheels, X MiB')"
    assert int(stated.group(1)) == len(files) == len(carried())
    assert stated.group(2) == f"{sum(f.stat().st_size for f in files) / 2**20:.1f}", (
        "docs/benchmarks.md, GPU: the wheels' size is not what make gpu-wheels fetched")
    # What travels: tracked files and untracked ones git does not ignore, and the carried folder.
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum((REPO / name).stat().st_size for name in listed if name and (REPO / name).is_file())
    assert tree + sum(f.stat().st_size for f in files) <= TRAVELS


def test_a_missing_or_wrong_wheel_stops_the_run_at_once(tmp_path: Path) -> None:
    assert gpu.wheels_problem(tmp_path / "absent").startswith(f"no wheels in {tmp_path / 'absent'}: run `make gpu")
    wheels = tmp_path / "wheels"
    shutil.copytree(gpu_wheels.fetched(), wheels)
    assert gpu.wheels_problem(wheels) is None
    (next(wheels.glob("webdataset-*.whl"))).unlink()
    assert "missing webdataset==1.0.2; not pinned none" in gpu.wheels_problem(wheels)
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path / "out"), "--wheels", str(wheels)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bench.gpu: " in done.stderr and 'carry=[".gpu-wheels"]' in done.stderr
    assert not (tmp_path / "out").exists()  # stopped before anything else


def test_the_check_names_what_is_missing() -> None:
    pins, there = {"aistore": Version("2.0.0"), "urllib3": Version("2.8.0")}, machine()
    assert unmet(Requirement("msgspec>=0.18.5"), pins, there) == "neither carried nor on the machine"
    assert unmet(Requirement("typing-extensions>=4.16.0"), pins, there).startswith("the machine's typing-extensions")
    assert unmet(Requirement("urllib3>=2.9"), pins, there) == "carried urllib3==2.8.0 does not satisfy it"
    assert unmet(Requirement("torch>=2.4"), pins, there) is None  # 2.11 there
    assert unmet(Requirement("torch>=2.14"), pins, there) is not None
    assert unmet(Requirement("numpy"), pins, there) is None
    assert unmet(Requirement("tomli; python_version < '3.11'"), pins, there) is None
    assert unmet(Requirement("wrapt; extra == 'botocore'"), pins, there) is None
