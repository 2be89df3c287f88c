"""One lock for the venv, the image and the carried wheels: uv.lock is pyproject.toml's, every file generated from
it is what it gives (requirements/lock.py), and the venv ``make install`` made is exactly the locked set."""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("requirements_lock", REPO / "requirements" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = lock  # dataclasses look their module up by name
_spec.loader.exec_module(lock)


def _requirements(texts: list[str], extra: str | None = None) -> set[str]:
    """Requirements in one spelling: canonical name, extras, specifier, and the extra they belong to."""
    found = set()
    for text in texts:
        requirement = Requirement(text)
        marker = f"extra == '{extra}'" if extra else None
        found.add((canonicalize_name(requirement.name), tuple(sorted(requirement.extras)),
                   str(SpecifierSet(str(requirement.specifier))), marker))
    return found


def test_the_lock_was_made_from_this_pyproject() -> None:
    """uv.lock records the requirements it was resolved from: a change to pyproject.toml without `make lock` shows."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = _requirements(project["project"]["dependencies"])
    for extra, texts in project["project"]["optional-dependencies"].items():
        wanted |= _requirements(texts, extra)
    locked_project = next(p for p in tomllib.loads(lock.LOCK.read_text())["package"] if p["name"] == lock.PROJECT)
    recorded = {(canonicalize_name(r["name"]), tuple(sorted(r.get("extras", []))),
                 str(SpecifierSet(r.get("specifier", ""))), r.get("marker"))
                for r in locked_project["metadata"]["requires-dist"]}
    assert recorded == wanted, "uv.lock is not pyproject.toml's: make lock"
    groups = {group: _requirements(texts) for group, texts in project["dependency-groups"].items()}
    recorded_groups = {group: {(canonicalize_name(r["name"]), tuple(sorted(r.get("extras", []))),
                                str(SpecifierSet(r.get("specifier", ""))), None) for r in rows}
                       for group, rows in locked_project["metadata"]["requires-dev"].items()}
    assert recorded_groups == groups, "uv.lock's dependency groups are not pyproject.toml's: make lock"
    assert set(lock.DEV_GROUPS) <= set(groups)
    assert set(lock.DEV_EXTRAS) < set(project["project"]["optional-dependencies"])


def test_every_file_generated_from_the_lock_is_what_it_gives() -> None:
    """dev.txt in every Python the project supports, the image's server.txt and torch.txt, the carried wheels' pins."""
    assert lock.stale() == []


def test_a_changed_pin_hash_or_line_of_dev_txt_is_caught() -> None:
    packages = lock.read_lock()
    env = lock.environment("3.11.7")
    text = lock.DEV.read_text()
    assert lock.dev_problems(text, packages, env) == []
    older = text.replace("\nhypothesis==6.170.17 ;", "\nhypothesis==6.170.16 ;")
    assert older != text
    assert lock.dev_problems(older, packages, env) == ["hypothesis: dev.txt says ==6.170.16, the lock ==6.170.17"]
    pin = text.index("\npsutil==")
    digest = text.index("--hash=sha256:", pin) + len("--hash=sha256:")
    forged = text[:digest] + ("0" if text[digest] != "0" else "1") + text[digest + 1:]
    psutil = lock.installed(packages, env, lock.DEV_EXTRAS, lock.DEV_GROUPS)["psutil"].version
    assert lock.dev_problems(forged, packages, env) == [f"psutil=={psutil}: dev.txt's hashes are not the lock's"]
    start = text.index("\nwsproto==")
    end = text.index("\n", text.index("# via", start))
    assert lock.dev_problems(text[:start] + text[end:], packages, env) == [
        "wsproto==1.3.2: installed by the lock here, missing from dev.txt"]


def test_a_carried_pin_that_is_not_the_lock_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    carried = tmp_path / "gpu-check.txt"
    carried.write_text(lock.CARRIED[0].read_text().replace("webdataset==1.0.2", "webdataset==1.0.1"))
    packages = lock.read_lock()
    assert "webdataset==1.0.2" in lock.carried_text(carried, packages)
    monkeypatch.setattr(lock, "CARRIED", (carried,))
    assert lock.stale(envs=()) == [f"{carried} is not what uv.lock gives: python requirements/lock.py"]
    carried.write_text(carried.read_text() + "not-in-the-lock==1.0\n")
    with pytest.raises(SystemExit, match="not-in-the-lock is carried to the device machine but uv.lock has no"):
        lock.carried_text(carried, packages)


def test_the_venv_is_the_locked_set() -> None:
    """What `make install` installed is the lock, version for version (tests that read a package's requirements from
    the venv rely on it). A venv changed by hand, or made before the lock changed, fails here: make install."""
    env = lock.environment(platform.python_version())
    wanted = lock.installed(lock.read_lock(), env, lock.DEV_EXTRAS, lock.DEV_GROUPS)
    differ = []
    for name, locked in sorted(wanted.items()):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        if version != locked.version:
            differ.append(f"{name}: {version or 'not installed'} here, {locked.version} locked")
    assert not differ, "this venv is not the lock (make install):\n" + "\n".join(differ)
