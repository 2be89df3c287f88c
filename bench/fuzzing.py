"""The shared entry point of the atheris fuzz scripts (``bench/fuzz_*.py``)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import atheris


def run(test_one_input: Callable[[bytes], None], seeds: Iterable[bytes], name: str) -> None:
    """Run atheris with the command line's options; seed a fresh corpus folder unless one is given."""
    argv = list(sys.argv)
    if not any(Path(a).is_dir() for a in argv[1:] if not a.startswith("-")):
        corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
        for i, seed in enumerate(seeds):
            (corpus / f"seed-{i}").write_bytes(seed)
        argv.append(str(corpus))
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
