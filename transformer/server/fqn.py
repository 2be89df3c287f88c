"""``etl_fqn``: the local path of an object on the target's disk, decoded and confined.

AIS double-encodes the FQN in HTTP (contract doc section 2.1): after the framework's query decoding
exactly one more percent-decode is needed (every AIS FQN contains ``%ob``). The path must have the
AIS mountpath layout ``<mountpath>/@<provider>/[<ns>/]<bucket>/%ob/<object>`` and, when
``ETL_FQN_ROOTS`` is set, lie under one of those roots after resolving symlinks and ``..``: the pod's
port is reachable from the node network, so ``etl_fqn`` must not read arbitrary files.
"""

from __future__ import annotations

import os
from urllib.parse import unquote

from ..errors import RequestError


def resolve_fqn(raw: str, roots: tuple[str, ...]) -> str:
    path = unquote(raw)
    if not os.path.isabs(path):
        raise RequestError(f"etl_fqn {path!r} is not an absolute path", status=400)
    real = os.path.realpath(path)
    if roots and not any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots):
        raise RequestError(f"etl_fqn {path!r} is outside the allowed roots (ETL_FQN_ROOTS)", status=403)
    segments = real.split("/")
    if "%ob" not in segments or not any(s.startswith("@") and len(s) > 1 for s in segments[: segments.index("%ob")]):
        raise RequestError(
            f"etl_fqn {path!r} does not have the AIS layout <mountpath>/@<provider>/<bucket>/%ob/<object>", status=403
        )
    if not os.path.isfile(real):
        raise RequestError(f"etl_fqn {path!r}: no such object file on this node", status=404)
    return real
