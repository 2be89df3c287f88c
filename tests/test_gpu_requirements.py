"""What python -m bench.gpu needs on the GPU machine is there: every requirement of the carried wheels
(requirements/gpu-check.txt, read from their METADATA) and every import of the code that runs there is met
by a carried wheel or by the machine's own packages (requirements/gpu-machine.txt), for Python 3.12 on Linux."""

from __future__ import annotations

import ast
import email.parser
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CARRIED = REPO / "requirements" / "gpu-check.txt"
MACHINE = REPO / "requirements" / "gpu-machine.txt"
WHEELS = REPO / ".gpu-wheels"
LOCAL = ("transformer", "tests", "testbed", "bench", "examples")
# The GPU machine's interpreter and platform, for environment markers.
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# What runs there: the script and the example it runs (every import, also inside functions), and the tests it
# collects (tests/client, their conftests); the local modules they import are followed at module level (a
# function's import in a library module runs only when called, as the pod's side never is there).
ENTRY = ["bench/gpu.py", "examples/prefetch_overlap.py"]
COLLECTED = ["tests/conftest.py", "tests/client/conftest.py",
             *(str(p.relative_to(REPO)) for p in sorted((REPO / "tests/client").glob("*.py")))]


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
    version installed here."""
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
                    f"{'not installed' if installed is None else f'{installed.version} installed'} here; "
                    f"run make {target}")
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


def _imports(path: Path, everywhere: bool) -> list[tuple[str, int]]:
    """(module, line) of the imports of ``path``: module level (inside if/try too), or ``everywhere``; an
    import inside a ``try`` that catches ImportError is optional and left out."""
    found = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.module, node.lineno))
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                base = ".".join(path.relative_to(REPO).with_suffix("").parts[:-node.level])
                found.append((f"{base}.{node.module}" if node.module else base, node.lineno))
                found.extend((f"{base}.{node.module + '.' if node.module else ''}{a.name}", node.lineno)
                             for a in node.names)
            elif _optional(node):
                continue
            elif everywhere or isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None) or []
                    visit([c for c in children if isinstance(c, ast.stmt)] +
                          [s for h in children if isinstance(h, ast.ExceptHandler) for s in h.body])
    visit(ast.parse(path.read_text()).body)
    return found


def _optional(node: ast.stmt) -> bool:
    """A ``try`` that catches ImportError, or ``if TYPE_CHECKING:``: its imports may be absent."""
    if isinstance(node, ast.Try):
        return any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                   for h in node.handlers)
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _local_file(module: str) -> Path | None:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def third_party_imports() -> dict[str, str]:
    """Each top-level third-party module imported by what runs there -> where (file:line)."""
    seen: set[Path] = set()
    found: dict[str, str] = {}
    todo = [(REPO / p, True) for p in ENTRY] + [(REPO / p, False) for p in COLLECTED]
    while todo:
        path, everywhere = todo.pop()
        if path in seen:
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


def test_every_import_of_the_code_that_runs_there_is_carried_or_there() -> None:
    pins, there = carried(), machine()
    providers = metadata.packages_distributions()
    problems = []
    for module, where in sorted(third_party_imports().items()):
        names = {canonicalize_name(n) for n in providers.get(module, [module])}
        if not names & (set(pins) | set(there)):
            problems.append(f"{where} imports {module} ({', '.join(sorted(names))}): neither carried nor there")
    assert not problems, "\n".join(problems)


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
