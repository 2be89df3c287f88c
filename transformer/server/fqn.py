"""``etl_fqn``: the local path of an object on the target's disk, decoded and confined.

AIS double-encodes the FQN in HTTP (ext/etl/communicator.go): after the framework's query decoding
exactly one more percent-decode is needed (every AIS FQN contains ``%ob``). The path must have the
AIS mountpath layout ``<mountpath>/@<provider>/[<ns>/]<bucket>/%ob/<object>`` and, when
``ETL_FQN_ROOTS`` is set, lie under one of those roots after resolving symlinks and ``..``: the pod's
port is reachable from the node network, so ``etl_fqn`` must not read arbitrary files.
"""

from __future__ import annotations

import os
from urllib.parse import unquote

from ..errors import RequestError
from ..wire import GLOBAL_NAMESPACE, OBJECT_FOLDER


def resolve_fqn(raw: str, roots: tuple[str, ...]) -> str:
    path = unquote(raw)
    if not os.path.isabs(path):
        raise RequestError(f"etl_fqn {path!r} is not an absolute path", status=400)
    real = os.path.realpath(path)
    if roots and not any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots):
        raise RequestError(f"etl_fqn {path!r} is outside the allowed roots (ETL_FQN_ROOTS)", status=403)
    segments = real.split("/")
    if OBJECT_FOLDER not in segments or not any(s.startswith("@") and len(s) > 1
                                                for s in segments[: segments.index(OBJECT_FOLDER)]):
        raise RequestError(
            f"etl_fqn {path!r} does not have the AIS layout <mountpath>/@<provider>/<bucket>/%ob/<object>", status=403
        )
    if not os.path.isfile(real):
        raise RequestError(f"etl_fqn {path!r}: no such object file on this node", status=404)
    return real


def object_uname(real: str, object_name: str) -> str:
    """The uname ``<provider>/<ns>/<bucket>/<object>`` of the object stored at FQN ``real``.

    Provider, namespace and bucket come from the FQN's layout (``@<provider>/[<ns>/]<bucket>/%ob/``,
    ns written ``#<name>`` or ``@<uuid>#<name>``); the object name from the request, because AIS
    shortens very long names on disk.
    """
    segments = real.split("/")
    ob = segments.index(OBJECT_FOLDER)
    if ob < 2:
        raise RequestError(f"etl_fqn {real!r} has no bucket before %ob", status=403)
    bucket, provider_at, ns = segments[ob - 1], ob - 2, GLOBAL_NAMESPACE
    candidate = segments[ob - 2]
    if candidate.startswith("#") or (candidate.startswith("@") and "#" in candidate):
        ns = candidate if candidate.startswith("@") else "@" + candidate
        provider_at = ob - 3
    provider = segments[provider_at] if provider_at >= 0 else ""
    if not provider.startswith("@") or len(provider) < 2:
        raise RequestError(f"etl_fqn {real!r} has no @<provider> segment before its bucket", status=403)
    return f"{provider[1:]}/{ns}/{bucket}/{object_name}"
