"""The pod's and the client's error trees: each in its one module; no two error classes share a name."""

from __future__ import annotations

import ast
import builtins
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer"


def _error_classes() -> dict[str, list[str]]:
    """Class name -> the modules defining it, for every class deriving (by name) from an exception."""
    classes: list[tuple[str, list[str], str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                         for base in node.bases]
                classes.append((node.name, bases, module))
    errors = {name for name, value in vars(builtins).items()
              if isinstance(value, type) and issubclass(value, BaseException)}
    grew = True
    while grew:
        grew = False
        for name, bases, _ in classes:
            if name not in errors and errors.intersection(bases):
                errors.add(name)
                grew = True
    found: dict[str, list[str]] = defaultdict(list)
    for name, _, module in classes:
        if name in errors:
            found[name].append(module)
    return found


def test_the_error_classes_are_found() -> None:
    found = _error_classes()
    assert {"TransformerError", "SampleTransformError", "IncompleteShard"} <= found.keys()
    assert {"ClientError", "SampleError", "ResumeError", "OfflineOptionsMismatch"} <= found.keys()


def test_no_two_error_classes_share_a_name() -> None:
    shared = {name: modules for name, modules in _error_classes().items() if len(modules) > 1}
    assert not shared, f"error classes defined more than once: {shared}"


def test_the_client_defines_its_errors_in_one_module() -> None:
    """Private ones included: an error raised inside a module may still reach a user."""
    elsewhere = {name: modules for name, modules in _error_classes().items()
                 if any(module.startswith("transformer.client.") and module != "transformer.client.errors"
                        for module in modules)}
    assert not elsewhere, f"client errors outside transformer.client.errors: {elsewhere}"


def test_the_pod_side_defines_its_errors_in_one_module() -> None:
    """Every exception class outside ``transformer.client`` is in ``transformer.errors``, private ones included."""
    elsewhere = {name: modules for name, modules in _error_classes().items()
                 if any(not module.startswith("transformer.client.") and module != "transformer.errors"
                        for module in modules)}
    assert not elsewhere, f"pod errors outside transformer.errors: {elsewhere}"
    assert "StreamAborted" in _error_classes()
