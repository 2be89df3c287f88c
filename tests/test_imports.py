"""Importing the package has no side effects: no settings read from the environment, no logging set up,
no app built. Each module is imported in a fresh interpreter whose environment holds settings that
would be refused if anything read them."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import transformer

# (``transformer.__main__`` is the command line itself: running it is its purpose.)
MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(transformer.__path__, "transformer.")
                 if not name.endswith("__main__"))

_CHECK = """
import logging, sys, importlib
before = list(logging.getLogger().handlers), logging.getLogger().level
for name in sys.argv[1:]:
    importlib.import_module(name)
    after = list(logging.getLogger().handlers), logging.getLogger().level
    assert after == before, f"importing {name} configured logging: {after} != {before}"
    server = sys.modules.get("transformer.server")
    assert server is None or "app" not in vars(server), f"importing {name} built the app"
"""


def test_every_module_is_listed() -> None:
    assert {"transformer.server", "transformer.server.service", "transformer.server.output",
            "transformer.engine", "transformer.client"} <= set(MODULES)


def test_importing_reads_no_settings_and_configures_no_logging() -> None:
    # One interpreter, every module in turn: each is checked right after its own import.
    env = {"ETL_WORKERS": "not-a-number", "ETL_LOG_LEVEL": "nonsense", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _CHECK, *MODULES], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_app_is_built_on_first_access_for_uvicorn_module_app(monkeypatch: pytest.MonkeyPatch) -> None:
    # `uvicorn transformer.server:app` still works: the attribute builds the app when asked for.
    done = subprocess.run([sys.executable, "-c", "import transformer.server as s; print(type(s.app).__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "FastAPI", done.stderr[-2000:]


def module_imports(inside_functions: bool = False) -> dict[str, set[str]]:
    """Each module's imports of other package modules at module level (``if TYPE_CHECKING:`` included), and with
    ``inside_functions`` those made inside its functions too."""
    files = {name: Path(spec.origin) for name in [*MODULES, "transformer.__main__"]
             if (spec := importlib.util.find_spec(name)) and spec.origin}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for statement in ast.parse(path.read_text()).body:
            nested = inside_functions or isinstance(statement, ast.If)
            for node in ast.walk(statement) if nested else [statement]:
                if isinstance(node, ast.ImportFrom):
                    base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                    target = ".".join(part for part in (base, node.module) if part)
                    found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
        graph[name] = {module for module in found if module in files and module != name}
    return graph


@pytest.mark.parametrize("inside_functions", [False, True], ids=["module level", "functions too"])
def test_no_module_imports_one_that_imports_it_back(inside_functions: bool) -> None:
    """No import circle, also none dodged by importing inside a function."""
    graph = module_imports(inside_functions)
    assert "transformer.server.jobs" in graph["transformer.server.service"]  # the graph is read at all
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == [], " ; ".join(" -> ".join(cycle) for cycle in cycles)
