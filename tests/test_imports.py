"""Importing the package has no side effects: no settings read from the environment, no logging set up,
no app built. Each module is imported in a fresh interpreter whose environment holds settings that
would be refused if anything read them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

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
