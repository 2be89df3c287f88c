"""What bench/device_scaling.sh runs on the 16-core device machine is there: every requirement of the carried
wheels (requirements/scaling-check.txt, with the extras named there, read from their METADATA) and every import of
the code that runs there (the pod, bench.scaling and its clients, the SDK peer, the script's own checks) is met by
a carried wheel or by the machine's packages (requirements/gpu-machine.txt and requirements/scaling-machine.txt),
for CPython 3.12 on x86-64 Linux; and the wheels `make scaling-wheels` fetched fit the 64 MiB that travels."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from tests.test_gpu_requirements import LOCAL, MARKERS, _imports, _local_file, lines
from tests.test_gpu_requirements import requires_dist as gpu_requires_dist
from tests.test_gpu_requirements import unmet_there as unmet

REPO = Path(__file__).resolve().parents[1]
CARRIED = REPO / "requirements" / "scaling-check.txt"
MACHINE = [REPO / "requirements" / "gpu-machine.txt", REPO / "requirements" / "scaling-machine.txt"]
WHEELS = REPO / ".scaling-wheels"
SCRIPT = REPO / "bench" / "device_scaling.sh"
TRAVELS = 64 * 2**20  # the working tree and the carried paths together, per call of the device tool
# What runs there, every import (also inside functions): the bench, its clients, the peer, and the pod's side
# (the server, its worker processes, the engine and the demo generator); local modules they import are followed
# at module level.
ENTRY = ["bench/scaling.py", "bench/services.py", "bench/data.py", "bench/peers/conventional_etl.py",
         "bench/peers/recipes.py", "transformer/__main__.py", "transformer/cli.py", "transformer/serve.py",
         "transformer/forkserver.py",
         "transformer/demo.py", "transformer/engine.py", "transformer/cropdecode.py", "transformer/spec.py",
         "transformer/samples.py", "transformer/shards.py", "transformer/config.py",
         *(str(p.relative_to(REPO)) for p in sorted((REPO / "transformer/server").glob("*.py")))]


def carried() -> dict[str, tuple[Version, frozenset[str]]]:
    """Each carried package -> (its pinned version, the extras its requirement names)."""
    pins = {}
    for requirement in lines(CARRIED):
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{CARRIED.name}: {requirement} is not pinned with =="
        pins[canonicalize_name(requirement.name)] = (Version(spec.version), frozenset(requirement.extras))
    return pins


def machine() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for path in MACHINE for r in lines(path)}


def requires_dist(name: str, version: Version) -> list[Requirement]:
    return gpu_requires_dist(name, version, WHEELS, "scaling-wheels")


def applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    """Whether ``requirement`` applies on the device machine to a package installed with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**MARKERS, "extra": extra}) for extra in ("", *sorted(extras)))


def test_every_requirement_of_the_carried_wheels_is_met_there() -> None:
    pins, there = carried(), machine()
    versions = {name: version for name, (version, _) in pins.items()}
    problems = []
    for name, (version, extras) in pins.items():
        for requirement in requires_dist(name, version):
            if not applies(requirement, extras):
                continue
            why = unmet(requirement, versions, there)
            if why:
                problems.append(f"{name}=={version} needs {requirement}: {why}")
    assert not problems, "\n".join(problems)


def script_python() -> list[str]:
    """The Python programs bench/device_scaling.sh runs from here-documents (``<<'EOF'`` ... ``EOF``)."""
    return re.findall(r"<<'EOF'[^\n]*\n(.*?)\nEOF\n", SCRIPT.read_text(), re.S)


def third_party_imports() -> dict[str, str]:
    """Each top-level third-party module imported by what runs there -> where (file:line)."""
    seen: set[Path] = set()
    found: dict[str, str] = {}
    todo = [(REPO / p, True) for p in ENTRY]
    for index, program in enumerate(script_python()):
        for node in ast.walk(ast.parse(program)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in names:
                top = module.split(".")[0]
                if top in LOCAL:
                    todo.append((_local_file(module), False))
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, f"{SCRIPT.relative_to(REPO)} (program {index + 1}):{node.lineno}")
    while todo:
        path, everywhere = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        for module, line in _imports(path, everywhere):
            top = module.split(".")[0]
            if top in LOCAL:
                for end in range(1, module.count(".") + 2):  # each package on the way runs its __init__
                    local = _local_file(".".join(module.split(".")[:end]))
                    if local is not None:
                        todo.append((local, False))
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, f"{path.relative_to(REPO)}:{line}")
    return found


def provided(module: str, pins: dict, there: dict) -> bool:
    names = {canonicalize_name(n) for n in metadata.packages_distributions().get(module, [module])}
    return bool(names & (set(pins) | set(there)))


def test_every_import_of_the_code_that_runs_there_is_carried_or_there() -> None:
    pins, there = carried(), machine()
    found = third_party_imports()
    assert {"fastapi", "uvicorn", "aistore", "psutil", "wsproto", "webdataset", "simplejpeg", "torch"} <= set(found), (
        "the crawl missed what the pod, the bench or the peer import: " + ", ".join(sorted(found)))
    problems = [f"{where} imports {module}: neither carried nor there"
                for module, where in sorted(found.items()) if not provided(module, pins, there)]
    assert not problems, "\n".join(problems)


def test_the_demo_photographs_packages_are_there() -> None:
    """transformer.demo reads its photographs from files inside installed packages (no import statement)."""
    from transformer.demo import PHOTOGRAPHS

    pins, there = carried(), machine()
    missing = sorted({p.package for p in PHOTOGRAPHS if not provided(p.package, pins, there)})
    assert not missing, f"the demo's photographs come from {missing}: neither carried nor on the machine"


def test_the_check_names_what_is_missing() -> None:
    pins, there = {"aistore": Version("2.0.0"), "urllib3": Version("2.8.0")}, machine()
    assert unmet(Requirement("fastapi>=0.109"), pins, there) == "neither carried nor on the machine"
    assert unmet(Requirement("urllib3>=2.9"), pins, there) == "carried urllib3==2.8.0 does not satisfy it"
    assert unmet(Requirement("matplotlib>=3.7"), pins, there).startswith("the machine's matplotlib")
    assert unmet(Requirement("torchvision>=0.20"), pins, there) is None  # 0.26 there
    assert unmet(Requirement("torchvision>=0.29"), pins, there) is not None
    etl = Requirement("aiofiles>=23.2.1; extra == 'etl'")
    assert applies(etl, frozenset({"etl"})) and not applies(etl, frozenset())
    assert not applies(Requirement("tomli; python_version < '3.11'"), frozenset())
    assert not applies(Requirement("pywin32; sys_platform == 'win32' and extra == 'etl'"), frozenset({"etl"}))
    scanned = third_party_imports()
    assert "packaging" in scanned and "skimage" in scanned  # the script's own checks are read too


def _compatible(wheel: str) -> bool:
    """Whether the wheel installs on CPython 3.12, x86-64 Linux with glibc 2.28 or newer."""
    _, _, _, tags = parse_wheel_filename(wheel)
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 29)] + ["manylinux2014_x86_64",
                                                                             "manylinux2010_x86_64",
                                                                             "manylinux1_x86_64", "any"]
    supported: set[Tag] = set(cpython_tags((3, 12), platforms=platforms))
    supported |= set(compatible_tags((3, 12), "cp312", platforms=platforms))
    return bool(set(tags) & supported)


def test_the_wheels_fetched_are_the_pins_and_fit_what_travels() -> None:
    if not WHEELS.is_dir():
        pytest.skip(f"{WHEELS.name}/ not fetched (make scaling-wheels)")
    pins = carried()
    wheels = sorted(WHEELS.glob("*.whl"))
    fetched = {parse_wheel_filename(w.name)[0]: parse_wheel_filename(w.name)[1] for w in wheels}
    assert len(fetched) == len(wheels), "two wheels of one package: the offline install would stop"
    assert fetched == {name: version for name, (version, _) in pins.items()}, (
        f"{WHEELS.name}/ is not {CARRIED.name}: run make scaling-wheels")
    assert all(_compatible(w.name) for w in wheels), [w.name for w in wheels if not _compatible(w.name)]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    repo_bytes = sum((REPO / name).stat().st_size for name in tracked.decode().split("\0")
                     if name and (REPO / name).is_file())
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    assert repo_bytes + wheel_bytes <= TRAVELS, (
        f"the repository ({repo_bytes / 2**20:.1f} MiB) and {WHEELS.name}/ ({wheel_bytes / 2**20:.1f} MiB) "
        f"exceed the {TRAVELS // 2**20} MiB that travels")


def test_the_compatibility_check_refuses_other_builds() -> None:
    assert _compatible("simplejpeg-1.9.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert _compatible("watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert _compatible("aistore-2.0.0-py3-none-any.whl")
    assert not _compatible("simplejpeg-1.9.0-cp311-cp311-manylinux2014_x86_64.whl")
    assert not _compatible("simplejpeg-1.9.0-cp312-cp312-macosx_11_0_arm64.whl")
    assert not _compatible("uvloop-0.23.0-cp312-cp312-manylinux_2_34_x86_64.whl")  # newer glibc than assumed
    assert not _compatible("msgspec-0.22.0-cp312-cp312-musllinux_1_2_x86_64.whl")
