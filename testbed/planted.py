"""Code planted in every Python process of a pod under test (the server, its fork server and the workers): faults
of the pod's own machinery, and a benchmark's or a test's A/B switch that is no setting of the pod.

A monkeypatch in the test process never reaches the pod's worker processes: they are forked from a fork
server that a fresh interpreter runs. Instead ``planted(folder, what, every)`` gives the environment that
puts a ``sitecustomize`` module on ``PYTHONPATH``: Python imports it at the start of every interpreter
the pod runs, it patches the one function ``what`` names, and the forked workers inherit the patch.
Each process counts its own calls, so "every 7th" holds in each process apart.

The faults are failures of the pod's own machinery on perfectly good samples (the sample's content is
never at fault), so a reply may be the reference bytes or a failed one, never a whole one that differs:

* ``npy-descr``: naming an output array's dtype in its ``.npy`` header raises ``RuntimeError`` (the pod's
  output path, in whichever process transforms the sample);
* ``arena-lease``: mapping a block of another worker's shared-memory arena raises ``OSError`` (the
  leader reading a result, a worker reading a sample it was sent).

And one switch: ``loop-send``, every chunk of the output sent by the event loop (uvicorn), never by the
shard's own thread; the design the direct send is measured and tested against.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "AIS_WDS_PLANTED"  # "<what>:<every>"; read by the sitecustomize below, by no product code
PLANTS = ("npy-descr", "arena-lease", "loop-send")

_SITECUSTOMIZE = '''
import os

_fault, _, _every = os.environ.get("AIS_WDS_PLANTED", "").partition(":")


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
elif _fault == "loop-send":
    import dataclasses

    import transformer.config

    _from_env = transformer.config.Settings.from_env.__func__

    def _loop_send(cls, environ=None):
        return dataclasses.replace(_from_env(cls, environ), direct_send=False)

    transformer.config.Settings.from_env = classmethod(_loop_send)
'''


def planted(folder: Path, fault: str, every: int = 1) -> dict[str, str]:
    """The variables that plant ``fault`` (on every ``every``-th call in each process) in a pod started with them."""
    if fault not in PLANTS:
        raise ValueError(f"unknown plant {fault!r}; choose one of {PLANTS}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, VARIABLE: f"{fault}:{every}"}
