"""Register the transformer as an AIS ETL through the aistore SDK, and AIS's refusals as ``EtlRequestError``.

``register`` sends an ``EtlSettings``'s init message (``transformer.client.etlspec``) and is
idempotent; ``unregister`` stops and deletes. ``ais_errors`` turns the SDK's ``AISError`` into
``EtlRequestError`` with the cluster's own message, for every call the client makes to AIS (offline
transforms, downloads and the incremental check use it too).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .errors import EtlNameError, EtlRequestError, EtlSpecMismatch
from .etlspec import EtlSettings, spec_differences, validate_name

if TYPE_CHECKING:
    from aistore.sdk import Client
    from aistore.sdk.etl import Etl

log = logging.getLogger("transformer.client")


@dataclass(frozen=True)
class Registration:
    """The outcome of ``register``: the SDK handle, and whether a new ETL was created."""

    name: str
    etl: Etl
    created: bool
    job_id: str = ""


def register(client: Client, name: str, settings: EtlSettings, *, replace: bool = False) -> Registration:
    """Register (or reuse) the ETL ``name`` with ``settings``.

    An ETL of that name with the same spec is reused (started again if it was stopped); one with a
    different spec raises ``EtlSpecMismatch`` unless ``replace=True``, which stops, deletes and
    re-creates it. Compared, field by field, with the init message AIS reports: communication type,
    obj_timeout, ``support_direct_put``, image, command, environment and ``resources`` (quantities
    by value: ``0.5`` and ``500m`` CPUs, ``1024Mi`` and ``1Gi`` are the same).

    AIS's refusals are raised as ``EtlRequestError`` with the cluster's own message, and what it means
    when it is a known one (a cluster outside Kubernetes cannot run ETLs at all).
    """
    message = settings.init_message(name)
    with ais_errors(name, "registration"):
        return _register(client, name, settings, message, replace)


def _register(client: Client, name: str, settings: EtlSettings, message: dict[str, Any],
              replace: bool) -> Registration:
    from aistore.sdk.errors import AISError

    etl = client.etl(name)
    running = registered_message(etl)
    started = False
    if running is None and _stage(client, name) == "Aborted":
        # AIS answers GET /v1/etl/<name> with 404 while the ETL is Aborted (stopped, or a pod died):
        # the proxy asks the targets for the details and they hold none. Start it to read its spec.
        log.info("ETL %s is stopped; starting it to compare its spec", name)
        try:
            etl.start()
            started = True
            running = registered_message(etl) or {}
        except AISError as exc:  # its pods cannot run (a bad setting): nothing to keep, register anew
            log.warning("ETL %s is stopped and does not start again (%s); deleting it and registering anew",
                        name, _ais_message(exc.message)[0])
            etl.delete()
    if running is not None:
        differences = spec_differences(running, message)
        if not differences:
            if not started and _stage(client, name) == "Aborted":
                log.info("ETL %s is registered with this spec but stopped; starting it", name)
                etl.start()
            return Registration(name=name, etl=etl, created=False)
        if not replace:
            if started:  # leave it as it was found
                etl.stop()
            raise EtlSpecMismatch(name, differences)
        log.info("replacing ETL %s (%s)", name, ", ".join(differences))
        try:
            etl.stop()
        except AISError as exc:  # already stopped: deleting is what matters
            log.debug("stop %s: %s", name, exc)
        etl.delete()
    job_id = _init(etl, settings, message)
    return Registration(name=name, etl=etl, created=True, job_id=job_id)


def unregister(client: Client, name: str, *, missing_ok: bool = True) -> bool:
    """Stop and delete the ETL; ``False`` if there was none (``missing_ok``), else raises."""
    from aistore.sdk.errors import AISError

    etl = client.etl(validate_name(name))
    with ais_errors(name, "unregistration"):
        # an Aborted ETL has no details (404) but is still registered: the stage list has it
        if registered_message(etl) is None and not _stage(client, name):
            if missing_ok:
                return False
            raise EtlNameError(name, "is not a registered ETL")
        try:
            etl.stop()
        except AISError as exc:  # AIS refuses to stop an ETL that is not running; delete anyway
            log.debug("stop %s: %s", name, exc)
        etl.delete()
    return True


@contextlib.contextmanager
def ais_errors(name: str, action: str) -> Iterator[None]:
    """Turn the SDK's ``AISError`` (status, raw JSON body, URL) into ``EtlRequestError``: AIS's message
    and the node that gave it, the cluster's address, and what the message means when it is known."""
    from aistore.sdk.errors import AISError

    try:
        yield
    except AISError as exc:
        message, node = _ais_message(exc.message)
        parts = urlsplit(exc.req_url or "")
        endpoint = f"{parts.scheme}://{parts.netloc}" if parts.netloc else "AIS"
        raise EtlRequestError(name, action, endpoint, exc.status_code, message, node) from exc


def _ais_message(body: object) -> tuple[str, str]:
    """AIS's error body is JSON (``{"message": ..., "node": ...}``); anything else is kept as it is."""
    text = str(body or "").strip()
    try:
        decoded = json.loads(text)
    except ValueError:
        return text or "no message", ""
    if isinstance(decoded, dict) and decoded.get("message"):
        return str(decoded["message"]), str(decoded.get("node") or "")
    return text, ""


# AIS answers an init once every target's pod is ready, or once it gave up after init_timeout: a bit
# later than init_timeout. SDK 2.0.0's Etl.init waits exactly init_timeout, so a slow start made the SDK
# give up first and send the init again, which AIS refused: "etl job ... already exists" (409).
INIT_REPLY_MARGIN_S = 60.0


def _init(etl: Etl, settings: EtlSettings, message: dict[str, Any]) -> str:
    """``PUT /v1/etl`` with ``message`` (what ``Etl.init`` sends, plus ``resources``, which SDK 2.0.0 has no
    argument for), through the SDK's own request client: authentication, retries and error mapping stay the
    SDK's; only the wait is longer (``INIT_REPLY_MARGIN_S`` past ``init_timeout``)."""
    from aistore.sdk.utils import convert_to_seconds

    timeout = convert_to_seconds(settings.init_timeout) + INIT_REPLY_MARGIN_S
    response = etl._client.request("PUT", path="etl", json=message, timeout=timeout)
    return response.text


def registered_message(etl: Etl) -> dict[str, Any] | None:
    """The init message AIS holds for this ETL, whole, or ``None`` when it does not exist.

    ``GET /v1/etl/<name>`` (what ``Etl.view`` asks) returns the whole init message, but SDK 2.0.0's
    ``ETLDetails`` model keeps only some of its fields and drops ``support_direct_put`` and
    ``resources``; so the JSON is read here, through the SDK's own request client (authentication,
    retries and error mapping stay the SDK's).
    """
    from aistore.sdk.const import HTTP_METHOD_GET, QPARAM_UUID, URL_PATH_ETL
    from aistore.sdk.errors import AISError, ErrETLNotFound

    try:
        response = etl._client.request(HTTP_METHOD_GET, path=f"{URL_PATH_ETL}/{etl.name}", params={QPARAM_UUID: ""})
    except ErrETLNotFound:
        return None
    except AISError as exc:
        if exc.status_code == 404:
            return None
        raise
    message = response.json().get("init_msg")
    return message if isinstance(message, dict) else {}


def _stage(client: Client, name: str) -> str:
    for info in client.cluster().list_etls(stages=["Initializing", "Running", "Aborted"]):
        if info.id == name:
            return info.stage
    return ""
