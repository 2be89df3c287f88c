"""The ETL's spec, apart from AIS: ``EtlSettings``, its init message and YAML, name and timeout rules.

Name checks, the object timeout rule, ``EtlSettings`` and its init message, its YAML for ``ais etl
init -f``, and what differs between two init messages.

``EtlSettings`` holds everything that defines the pod (image, communication type, timeouts, the
service's ``ETL_*`` environment). ``init_message`` is what ``transformer.client.registration``
sends through the aistore SDK; ``runtime_spec_yaml`` renders the very same message as YAML for CLI
users, so both get the same pod. Wire format: AIS's ``ETLSpecMsg`` (ext/etl/api.go); SDK: aistore
2.0.0's ``Etl``.

The object timeout rule (``obj_timeout_for``): AIS applies ``obj_timeout`` as the Go client timeout
of the whole exchange, including reading the response body (Go's http.Client.Timeout), so a whole
shard must be transformed *and* drained by the reader within it::

    per_image   = max(seconds_per_image * concurrent_shards / workers,   # pod CPU, shared by shards
                      1 / reader_images_per_second)                      # a slow training reader
    obj_timeout = ceil(max(minimum, safety * images_per_shard * per_image))
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import yaml

from ..config import DTYPES, ERROR_POLICIES, LAYOUTS, VARIABLES, parse_duration
from ..errors import ConfigError
from .errors import EtlNameError

COMM_TYPES = ("hpush", "hpull", "ws")
# What the classic PIL + torchvision v1 pipeline costs per image on one core (ImageNet-sized JPEG ->
# 224 float32 .npy); this service's path costs less, so a timeout derived from it errs long.
# docs/design.md gives the figures; measure yours with ``transformer.apply.measure_seconds_per_image``.
DEFAULT_SECONDS_PER_IMAGE = 0.004
DEFAULT_OBJ_TIMEOUT_FLOOR = 45.0  # the SDK's default obj_timeout: never go below it
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def validate_name(name: str) -> str:
    """Check an ETL name as AIS (``cmn/k8s/util.go``) and the SDK do: 6-32 chars of ``[a-z0-9-]``."""
    if not isinstance(name, str):
        raise EtlNameError(repr(name), "is not a string")
    if len(name) < 6:
        raise EtlNameError(name, f"is too short ({len(name)} characters, AIS needs 6 to 32)")
    if len(name) > 32:
        raise EtlNameError(name, f"is too long ({len(name)} characters, AIS needs 6 to 32)")
    if not _NAME.fullmatch(name):
        raise EtlNameError(name, "may only contain lowercase letters, digits and '-', "
                                 "and must start and end with a letter or digit")
    return name


def obj_timeout_for(
    images_per_shard: int,
    seconds_per_image: float = DEFAULT_SECONDS_PER_IMAGE,
    workers: int = 1,
    *,
    concurrent_shards: int = 1,
    reader_images_per_second: float | None = None,
    safety: float = 4.0,
    minimum: float = DEFAULT_OBJ_TIMEOUT_FLOOR,
) -> str:
    """The ETL ``obj_timeout`` (Go duration, whole seconds) for shards of ``images_per_shard``.

    ``workers`` is the pod's transform threads (``ETL_WORKERS``, its CPU limit), shared by the
    ``concurrent_shards`` a pod serves at once (about the number of loader workers reading through
    that target). ``reader_images_per_second`` is the slowest rate one loader worker drains a shard
    at; it matters for inline hpush/ws GETs, where the target streams the pod's body to the reader
    under the same timeout. ``safety`` covers large images and CPU contention.
    """
    if images_per_shard < 1 or seconds_per_image <= 0 or workers < 1 or concurrent_shards < 1 or safety < 1:
        raise ValueError("obj_timeout_for: images_per_shard, seconds_per_image, workers, concurrent_shards "
                         "must be positive and safety at least 1")
    per_image = seconds_per_image * concurrent_shards / workers
    if reader_images_per_second is not None:
        if reader_images_per_second <= 0:
            raise ValueError("obj_timeout_for: reader_images_per_second must be positive")
        per_image = max(per_image, 1.0 / reader_images_per_second)
    return f"{math.ceil(max(minimum, safety * images_per_shard * per_image))}s"


@dataclass(frozen=True)
class EtlSettings:
    """Everything that defines the transformer pod. ``obj_timeout=None`` derives it (``obj_timeout_for``)."""

    image: str
    comm_type: str = "hpush"
    preset: str = "imagenet-train"
    transforms: list[Any] | None = None
    dtype: str = "float32"
    layout: str = "CHW"
    on_error: str = "skip"
    seed: int | None = None
    workers: int | None = None  # None: the pod uses the CPUs of its cgroup limit
    images_per_shard: int = 1000
    seconds_per_image: float = DEFAULT_SECONDS_PER_IMAGE
    obj_timeout: str | None = None
    init_timeout: str = "5m"
    direct_put: bool = True  # the service honors Ais-Node-Url; ws:// requires it
    command: Sequence[str] | None = None  # None: the image's entrypoint (``wds-transform serve``)
    resources: Mapping[str, Any] | None = None  # K8s requests/limits; REST/CLI only in SDK 2.0.0
    env: Mapping[str, str] = field(default_factory=dict)  # more pod environment (e.g. ETL_WINDOW)

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("EtlSettings: image is required")
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"EtlSettings: comm_type {self.comm_type!r} is not one of {', '.join(COMM_TYPES)}")
        if self.comm_type == "ws" and not self.direct_put:
            raise ValueError("EtlSettings: ws:// requires direct_put=True (AIS refuses it otherwise)")
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("layout", self.layout, LAYOUTS),
                                     ("on_error", self.on_error, ERROR_POLICIES)):
            if value not in allowed:
                raise ValueError(f"EtlSettings: {name} {value!r} is not one of {', '.join(allowed)}")
        if self.workers is not None and self.workers < 1:
            raise ValueError("EtlSettings: workers must be at least 1")
        for name in ("obj_timeout", "init_timeout"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_duration(value, name)
                except ConfigError as exc:
                    raise ValueError(f"EtlSettings: {exc.message}") from None
        owned = {"ETL_PRESET", "ETL_TRANSFORMS", "ETL_DTYPE", "ETL_LAYOUT", "ETL_ON_ERROR", "ETL_SEED",
                 "ETL_WORKERS", "ETL_OBJ_TIMEOUT"}
        for name in self.env:
            if name in owned:
                raise ValueError(f"EtlSettings: set {name} through its own field, not env")
            if name.startswith("ETL_") and name not in VARIABLES:
                raise ValueError(f"EtlSettings: unknown service variable {name} (see transformer.config.VARIABLES)")

    @property
    def effective_obj_timeout(self) -> str:
        if self.obj_timeout is not None:
            return self.obj_timeout
        return obj_timeout_for(self.images_per_shard, self.seconds_per_image, self.workers or 1)

    def environment(self) -> dict[str, str]:
        """The pod's environment: the service's defaults for this ETL, then ``env``."""
        env = {"ETL_PRESET": self.preset}
        if self.transforms is not None:
            env["ETL_TRANSFORMS"] = json.dumps(self.transforms, separators=(",", ":"))
        env.update(ETL_DTYPE=self.dtype, ETL_LAYOUT=self.layout, ETL_ON_ERROR=self.on_error)
        if self.seed is not None:
            env["ETL_SEED"] = str(self.seed)
        if self.workers is not None:
            env["ETL_WORKERS"] = str(self.workers)
        # The service's own deadline per object equals AIS's, so it fails with a message first.
        env["ETL_OBJ_TIMEOUT"] = self.effective_obj_timeout
        env.update({name: str(value) for name, value in self.env.items()})
        return env

    def init_message(self, name: str) -> dict[str, Any]:
        """The ``PUT /v1/etl`` body (``ETLSpecMsg``), field for field what SDK 2.0.0 ``Etl.init`` sends."""
        runtime: dict[str, Any] = {"image": self.image}
        if self.command is not None:
            runtime["command"] = list(self.command)
        runtime["env"] = [{"name": k, "value": v} for k, v in self.environment().items()]
        message: dict[str, Any] = {
            "name": validate_name(name),
            "communication": f"{self.comm_type}://",
            "init_timeout": self.init_timeout,
            "obj_timeout": self.effective_obj_timeout,
            "support_direct_put": self.direct_put,
            "runtime": runtime,
        }
        if self.resources is not None:
            message["resources"] = _plain(self.resources)
        return message


def runtime_spec_yaml(name: str, settings: EtlSettings) -> str:
    """The runtime spec for ``ais etl init -f spec.yaml``: the same message ``register`` sends."""
    header = "# AIS ETL runtime spec, rendered by transformer.client.runtime_spec_yaml\n"
    return header + yaml.safe_dump(settings.init_message(name), sort_keys=False, default_flow_style=False)


def spec_differences(running: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[object, object]]:
    """What differs between the init message AIS holds (``running``) and ``wanted``: field -> (old, new)."""
    differences: dict[str, tuple[object, object]] = {}

    def compare(field_name: str, old: object, new: object) -> None:
        if old != new:
            differences[field_name] = (old, new)

    compare("communication", comm_url(running.get("communication")), comm_url(wanted["communication"]))
    compare("obj_timeout", _seconds(running.get("obj_timeout")), _seconds(wanted["obj_timeout"]))
    # AIS leaves support_direct_put out when false (Go omitempty).
    compare("support_direct_put", bool(running.get("support_direct_put")), bool(wanted.get("support_direct_put")))
    runtime = running.get("runtime")
    runtime = runtime if isinstance(runtime, dict) else {"image": runtime}
    wanted_runtime = wanted["runtime"]
    compare("image", runtime.get("image"), wanted_runtime["image"])
    compare("command", runtime.get("command") or None, wanted_runtime.get("command") or None)
    old_env = {e["name"]: e["value"] for e in runtime.get("env") or []}
    new_env = {e["name"]: e["value"] for e in wanted_runtime.get("env") or []}
    for key in sorted(set(old_env) | set(new_env)):
        compare(f"env {key}", old_env.get(key), new_env.get(key))
    # AIS always reports resources ({} when none were asked for) and writes quantities its own way.
    old_resources, new_resources = _resources(running.get("resources")), _resources(wanted.get("resources"))
    for section in sorted(set(old_resources) | set(new_resources)):
        old_section, new_section = old_resources.get(section, {}), new_resources.get(section, {})
        if not isinstance(old_section, dict) or not isinstance(new_section, dict):
            if old_section != new_section:
                differences[f"resources {section}"] = (old_section, new_section)
            continue
        for key in sorted(set(old_section) | set(new_section)):
            old, new = old_section.get(key), new_section.get(key)
            if old is None or new is None or _quantity(old) != _quantity(new):
                differences[f"resources {section}.{key}"] = (old, new)
    return differences


def _resources(value: object) -> dict[str, Any]:
    """K8s resource requirements as a plain dict, without empty sections (``{}`` = none asked for)."""
    plain = _plain(value) if isinstance(value, Mapping) else {}
    return {section: values for section, values in plain.items() if values not in (None, {}, [])}


_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))((?:[eE][+-]?\d+)|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)")
_SCALE = {"Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
          "Pi": Decimal(2**50), "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"),
          "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
          "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18")}


def _quantity(value: object) -> object:
    """A K8s quantity's value ('500m' and '0.5' are equal, so are '1Gi' and '1024Mi'); the text if unparsable."""
    text = str(value).strip()
    match = _QUANTITY.fullmatch(text)
    if not match:
        return text
    number, suffix = match.groups()
    scale = _SCALE[suffix] if suffix in _SCALE else Decimal(10) ** int(suffix[1:])
    return Decimal(number) * scale


def comm_url(value: object) -> str:
    """A communication type as AIS reads it: ``hpush://`` when empty, ``://`` appended when missing."""
    text = str(value or "hpush://")
    return text if "://" in text else text + "://"


def _seconds(value: object) -> float | None:
    # AIS reports durations as Go strings ("1m0s"); compare values, not spellings.
    return None if value in (None, "") else parse_duration(str(value), "obj_timeout")


def _plain(value: Any) -> Any:
    """Mappings and sequences as plain dicts and lists (for JSON and YAML)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
