"""What an offline copy is made with: the options a registered ETL transforms with when a request carries no
``etl_args`` (its environment, else the defaults), checked against the options a copy asks for.

AIS passes no ``etl_args`` to an offline job, so the pod uses the settings the ETL was registered with;
a copy whose options differ must not start (``OfflineOptionsMismatch``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..config import VARIABLES
from ..wire import ETL_ARG_FIELDS
from .errors import ClientError, OfflineOptionsMismatch
from .etlspec import validate_name
from .registration import ais_errors, registered_message
from .urls import etl_args

if TYPE_CHECKING:
    from aistore.sdk import Client

log = logging.getLogger("transformer.client")

_DETERMINISTIC_PRESETS = ("imagenet-val",)


def effective_options(environment: Mapping[str, str]) -> dict[str, Any]:
    """What the pod transforms with when a request carries no ``etl_args``: its environment, else the defaults."""

    def get(name: str) -> str:
        value = environment.get(name)
        return value if value not in (None, "") else VARIABLES[name][0]

    options: dict[str, Any] = {}
    transforms = get("ETL_TRANSFORMS")
    if transforms:  # ETL_TRANSFORMS overrides ETL_PRESET
        try:
            options["transforms"] = json.loads(transforms)
        except ValueError:
            options["transforms"] = transforms  # YAML: compared as text
    else:
        options["preset"] = get("ETL_PRESET")
    options["dtype"], options["layout"], options["on_error"] = get("ETL_DTYPE"), get("ETL_LAYOUT"), get("ETL_ON_ERROR")
    seed = get("ETL_SEED")
    options["seed"] = int(seed) if seed.lstrip("-").isdigit() else (seed or None)
    return options


def check_offline_options(client: Client, etl_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Raise unless the registered ETL ``etl_name`` transforms, without ``etl_args``, with ``options``.

    ``options`` are ``etl_args`` fields; ``preset`` or ``transforms`` is required (the copy's pipeline must be
    stated, not inherited by accident) and ``epoch`` is refused (offline jobs have none). Returns the options
    the ETL uses.
    """
    return checked_options(client, etl_name, options)[0]


def checked_options(client: Client, etl_name: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
    """``check_offline_options``'s work: the options the ETL uses, and its init message as AIS holds it."""
    unknown = sorted(set(options) - set(ETL_ARG_FIELDS))
    if unknown:
        raise ValueError(f"offline options: unknown field {unknown[0]!r}; known fields are {', '.join(ETL_ARG_FIELDS)}")
    if "epoch" in options:
        raise ValueError("offline options: an offline copy has no epoch (AIS passes no etl_args to offline jobs); "
                         "give a seed for a reproducible copy")
    if "preset" not in options and "transforms" not in options:
        raise ValueError("offline options: say which pipeline the copy is made with (preset or transforms)")
    etl_args(**dict(options))  # the same value checks as for etl_args
    used, message = _registered(client, etl_name, "; register it with the copy's options as its settings")
    differences: dict[str, tuple[object, object]] = {}
    wanted_pipeline = (("transforms", _spec(options["transforms"])) if "transforms" in options
                       else ("preset", options["preset"]))
    used_pipeline = ("transforms", used["transforms"]) if "transforms" in used else ("preset", used["preset"])
    if wanted_pipeline != used_pipeline:
        differences["pipeline"] = (" ".join(map(repr, used_pipeline)), " ".join(map(repr, wanted_pipeline)))
    for key in ("dtype", "layout", "on_error", "seed"):
        if key in options and options[key] != used[key]:
            differences[key] = (used[key], options[key])
    if differences:
        raise OfflineOptionsMismatch(etl_name, differences)
    random = ("Random" in json.dumps(used["transforms"]) if "transforms" in used
              else used["preset"] not in _DETERMINISTIC_PRESETS)
    if random and used.get("seed") is None:
        log.warning("ETL %s transforms with random augmentations and no seed: the offline copy is one random draw, "
                    "and cannot be made again identically", etl_name)
    return used, message


def registered_options(client: Client, etl_name: str) -> dict[str, Any]:
    """The ETL's settings as ``transform_bucket``'s ``options``: what it transforms offline jobs with."""
    used, _ = _registered(client, etl_name)
    return {key: value for key, value in used.items() if value is not None}


def _registered(client: Client, etl_name: str, hint: str = "") -> tuple[dict[str, Any], dict]:
    """The ETL's settings as its pod reads them (the runtime's environment, then the message's), and its
    registered message; ``ClientError`` (with ``hint``) when it is not registered."""
    with ais_errors(etl_name, "offline transform"):
        message = registered_message(client.etl(validate_name(etl_name)))
    if message is None:
        raise ClientError(f"ETL '{etl_name}' is not registered{hint}")
    runtime = message.get("runtime")
    runtime = runtime if isinstance(runtime, dict) else {}
    environment = {e["name"]: e["value"] for e in (runtime.get("env") or []) + (message.get("env") or [])}
    return effective_options(environment), message


def writes_end_marker(client: Client, first: dict, stage: str) -> bool:
    """Whether the pipeline's last ``stage`` is this transformer, which ends each shard with its end marker:
    registered with the service's settings (``register`` writes ``ETL_PRESET``) or the first stage's image."""
    with ais_errors(stage, "offline transform"):
        message = registered_message(client.etl(stage))
    if not message:
        return False

    def runtime(spec: dict) -> dict:
        value = spec.get("runtime")
        return value if isinstance(value, dict) else {}

    env = {e.get("name") for e in (runtime(message).get("env") or []) + (message.get("env") or [])}
    image = runtime(message).get("image")
    if {"ETL_PRESET", "ETL_TRANSFORMS"} & env or (image and image == runtime(first).get("image")):
        return True
    log.info("offline transform: the pipeline's last stage, ETL %s, is not this transformer; the copy is checked "
             "for the presence of each object, not for its end marker", stage)
    return False


def _spec(value: Any) -> Any:
    """A transforms spec as the pod's environment holds it (compact JSON), read back; YAML text stays text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return json.loads(json.dumps(value))
