"""Which third-party modules a run imports, read from the sources (``ast``), not by running them.

A machine lent for a few minutes (a GPU machine, the 16-core device) has only its own packages and what travels
with the call; a module missing there fails the run half-way. ``third_party_imports`` follows every import of the
files a run starts from, into this repository's own modules, and names each top-level module from elsewhere with
the first place that imports it. The tests compare that with the packages the machine has and the wheels carried
to it (tests/test_gpu_requirements.py, tests/test_scaling_wheels.py), and ``python -m bench.gpu`` imports each of
them before it needs the GPU, so that a missing one fails the run in seconds.

Imports inside functions count: a function's import runs whenever the function does (``tqdm`` in
``transformer/client/convert.py`` on every call). An import inside a ``try`` that catches ``ImportError``, or
under ``if TYPE_CHECKING:``, may be absent and is left out.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL = ("transformer", "tests", "testbed", "bench", "examples")


def imports(path: Path, everywhere: bool = True) -> list[tuple[str, int]]:
    """(module, line) of each import of ``path``: at module level (inside ``if``/``try``/``with`` too), and with
    ``everywhere`` inside functions and classes as well. Relative imports are made absolute; ``from a import b``
    of this repository also yields ``a.b`` (it may be a module)."""
    return [(module, line) for module, line, _ in _imports(path, everywhere)]


def _imports(path: Path, everywhere: bool) -> list[tuple[str, int, bool]]:
    """(module, line, inside a function or class) of each import of ``path``."""
    found: list[tuple[str, int, bool]] = []

    def visit(nodes: list[ast.stmt], nested: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno, nested) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.module, node.lineno, nested))
                found.extend((f"{node.module}.{alias.name}", node.lineno, nested) for alias in node.names
                             if node.module.split(".")[0] in LOCAL)
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                base = ".".join(path.relative_to(REPO).with_suffix("").parts[:-node.level])
                found.append((f"{base}.{node.module}" if node.module else base, node.lineno, nested))
                found.extend((f"{base}.{node.module + '.' if node.module else ''}{a.name}", node.lineno, nested)
                             for a in node.names)
            elif optional(node):
                continue
            elif everywhere or isinstance(node, (ast.If, ast.Try, ast.With)):
                inside = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                children: list[ast.stmt] = []
                for name in ("body", "orelse", "finalbody"):
                    children += [c for c in getattr(node, name, None) or [] if isinstance(c, ast.stmt)]
                for handler in getattr(node, "handlers", None) or []:
                    children += handler.body
                for case in getattr(node, "cases", None) or []:  # match statements
                    children += case.body
                visit(children, inside)

    visit(ast.parse(path.read_text()).body, False)
    return found


def optional(node: ast.stmt) -> bool:
    """A ``try`` that catches ImportError, or ``if TYPE_CHECKING:``: its imports may be absent."""
    if isinstance(node, ast.Try):
        return any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                   for h in node.handlers)
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def local_file(module: str) -> Path | None:
    """The file of this repository's ``module`` (or of its nearest package), None when it has none."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _within(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def third_party_imports(files: Iterable[Path], follow_functions: bool = True,
                        never_called: Iterable[str] = ()) -> dict[str, str]:
    """Each top-level module from outside this repository that ``files`` import, directly or through this
    repository's modules (each package on the way runs its ``__init__``) -> where it is first imported
    (``file:line``). ``follow_functions`` False reads module level only.

    ``never_called``: this repository's modules (or packages) whose code the run never calls; an import of one
    inside a function is not followed (the function that would import it is not called), but one at module
    level is, since it runs on import."""
    never_called = tuple(never_called)
    seen: set[Path] = set()
    found: dict[str, str] = {}
    todo = list(files)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, line, nested in _imports(path, follow_functions):
            top = module.split(".")[0]
            if top in LOCAL:
                if nested and _within(module, never_called):
                    continue
                for end in range(1, module.count(".") + 2):
                    local = local_file(".".join(module.split(".")[:end]))
                    if local is not None:
                        todo.append(local)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, f"{path.relative_to(REPO)}:{line}")
    return found
