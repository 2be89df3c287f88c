"""``transformer.client``'s public face: a short, sorted ``__all__``, every name documented in docs/client.md."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import transformer.client as client

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def _code(text: str) -> str:
    """The doc's code: fenced blocks and inline spans, where a name is documented as a name."""
    fenced = re.findall(r"```.*?\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return "\n".join(fenced + inline)


def test_all_is_short_and_sorted() -> None:
    assert len(client.__all__) <= 30
    assert list(client.__all__) == sorted(client.__all__)
    assert len(set(client.__all__)) == len(client.__all__)


def test_every_public_name_exists() -> None:
    missing = [name for name in client.__all__ if not hasattr(client, name)]
    assert not missing


def test_every_public_name_is_documented() -> None:
    code = _code(DOC.read_text())
    undocumented = [name for name in client.__all__ if not re.search(rf"\b{re.escape(name)}\b", code)]
    assert not undocumented, f"in transformer.client.__all__ but not in docs/client.md: {undocumented}"


def test_the_package_exports_nothing_else_public() -> None:
    """Names imported into the package beyond ``__all__`` are its submodules, not a second public face."""
    extra = {name for name, value in vars(client).items()
             if not name.startswith("_") and name not in client.__all__ and not isinstance(value, type(client))}
    assert not extra, extra


def test_every_name_the_lower_level_section_lists_is_in_its_module() -> None:
    """docs/client.md's "Lower-level modules": each `module` named there, then the names it holds."""
    section = DOC.read_text().split("## Lower-level modules", 1)[1].split("\n## ", 1)[0]
    module, checked = None, 0
    for token in re.findall(r"`([^`]+)`", section):
        name = token.removeprefix("transformer.client.")
        if (Path(client.__file__).parent / f"{name}.py").exists():
            module = importlib.import_module(f"transformer.client.{name}")
        elif module is not None and name.isidentifier():
            assert hasattr(module, name), f"{module.__name__} has no {name}"
            checked += 1
    assert checked >= 20


def test_every_moved_name_resolves_from_its_module_with_a_warning() -> None:
    """The names the package exported before: the very object of their module now, with a DeprecationWarning."""
    assert len(client._MOVED) == 29
    assert not set(client._MOVED) & set(client.__all__)
    for name, module in client._MOVED.items():
        with pytest.warns(DeprecationWarning, match=rf"use 'from {re.escape(module)} import {name}'"):
            value = getattr(client, name)
        assert value is getattr(importlib.import_module(module), name)


def test_an_old_import_statement_still_works() -> None:
    with pytest.warns(DeprecationWarning, match="transformer.client.reading"):
        from transformer.client import open_shard
    from transformer.client.reading import open_shard as new
    assert open_shard is new


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        client.no_such_name  # noqa: B018
    assert not hasattr(client, "_MOVED_nothing")
