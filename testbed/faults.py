"""Faults planted in every Python process of a pod under test: the server, its fork server and the workers.

A monkeypatch in the test process never reaches the pod's worker processes: they are forked from a fork
server that a fresh interpreter runs. Instead ``planted(folder, fault, every)`` gives the environment that
puts a ``sitecustomize`` module on ``PYTHONPATH``: Python imports it at the start of every interpreter
the pod runs, it patches the one function the fault names, and the forked workers inherit the patch.
Each process counts its own calls, so "every 7th" holds in each process apart.

The faults are failures of the pod's own machinery on perfectly good samples (the sample's content is
never at fault), so a reply may be the reference bytes or a failed one, never a whole one that differs:

* ``npy-descr``: naming an output array's dtype in its ``.npy`` header raises ``RuntimeError`` (the pod's
  output path, in whichever process transforms the sample);
* ``arena-lease``: mapping a block of another worker's shared-memory arena raises ``OSError`` (the
  leader reading a result, a worker reading a sample it was sent).
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "AIS_WDS_PLANTED_FAULT"  # "<fault>:<every>"; read by the sitecustomize below, by no product code
FAULTS = ("npy-descr", "arena-lease")

_SITECUSTOMIZE = '''
import os

_fault, _, _every = os.environ.get("AIS_WDS_PLANTED_FAULT", "").partition(":")


def _every_nth(function, error):
    calls = [0]

    def planted(*args, **kwargs):
        calls[0] += 1
        if calls[0] % int(_every) == 0:
            raise error(f"planted fault {_fault!r}: call {calls[0]} in pid {os.getpid()}")
        return function(*args, **kwargs)

    return planted


if _fault == "npy-descr":
    import numpy.lib.format

    numpy.lib.format.dtype_to_descr = _every_nth(numpy.lib.format.dtype_to_descr, RuntimeError)
elif _fault == "arena-lease":
    import transformer.server.arena

    transformer.server.arena.lease = _every_nth(transformer.server.arena.lease, OSError)
'''


def planted(folder: Path, fault: str, every: int) -> dict[str, str]:
    """The variables that plant ``fault`` on every ``every``-th call in each process of a pod started with them."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {FAULTS}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, VARIABLE: f"{fault}:{every}"}
