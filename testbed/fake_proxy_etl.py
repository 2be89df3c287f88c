"""The fake AIS proxy's ETL routes (``testbed/fake_proxy.py``): init, list, view, stop, start, delete as AIS 5.0
answers them (ais/prxetl.go), and the init message as ``GET /v1/etl/<name>`` reports it back."""

from __future__ import annotations

import base64
import re
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DURATION = re.compile(r"^(\d+(\.\d+)?(ms|s|m|h))+$")
INIT_FIELDS = {"name", "communication", "init_timeout", "obj_timeout", "support_direct_put", "env", "runtime",
               "resources"}


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    headers: dict[str, str]


class ContractViolation(Exception):
    pass


@dataclass
class FakeEtl:
    message: dict[str, Any]
    stage: str = "Running"
    xaction: str = field(default_factory=lambda: "etl-" + uuid.uuid4().hex[:8])
    job_errors: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # offline job id -> obj_errors


def go_duration(text: str) -> str:
    """A duration as AIS echoes it back (Go ``time.Duration.String``): '60s' -> '1m0s'."""
    seconds = 0.0
    for number, _, unit in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h)", text):
        seconds += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def k8s_quantity(value: object) -> str:
    """A K8s resource quantity as the API writes it back (``resource.Quantity``'s canonical form).

    Enough of it for the tests: '0.5' -> '500m', '1000m' -> '1', '1024Mi' -> '1Gi', '1.5Gi' -> '1536Mi'.
    """
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)", str(value).strip())
    if not match:
        raise ContractViolation(f"resource quantity {value!r} is not a K8s quantity")
    number, suffix = Decimal(match.group(1)), match.group(2)
    if number == 0:
        return "0"
    binary = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
    decimal = ["n", "u", "m", "", "k", "M", "G", "T", "P", "E"]
    if suffix in binary[1:]:
        amount = number * 1024 ** binary.index(suffix)
        if amount == amount.to_integral_value():
            power = max(p for p in range(len(binary)) if (amount / 1024**p) == (amount / 1024**p).to_integral_value())
            return f"{int(amount / 1024**power)}{binary[power]}"
        suffix = ""
    amount = number * Decimal(10) ** (3 * (decimal.index(suffix) - 3))
    for index in range(len(decimal) - 1, -1, -1):
        scaled = amount / Decimal(10) ** (3 * (index - 3))
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{decimal[index]}"
    raise ContractViolation(f"resource quantity {value!r} is finer than a nano unit")


def as_reported(message: dict[str, Any]) -> dict[str, Any]:
    """The init message as ``GET /v1/etl/<name>`` returns it (AIS 5.0 ``ETLSpecMsg`` marshalled by Go).

    Durations as Go writes them ('60s' -> '1m0s', defaults 45s/10s filled in); ``support_direct_put``
    left out when false (``omitempty``); ``resources`` always there (``omitempty`` never drops a Go
    struct), ``{}`` when none were asked for, with quantities in K8s's canonical form.
    """
    shown = {key: value for key, value in message.items() if key not in ("support_direct_put", "resources")}
    shown["init_timeout"] = go_duration(message.get("init_timeout", "45s"))
    shown["obj_timeout"] = go_duration(message.get("obj_timeout", "10s"))
    if message.get("support_direct_put"):
        shown["support_direct_put"] = True
    shown["resources"] = {section: {name: k8s_quantity(quantity) for name, quantity in values.items()}
                          for section, values in (message.get("resources") or {}).items() if values}
    return shown




class EtlRoutes:
    # ---- ETL (ais/prxetl.go) --------------------------------------------------------------------

    def _etl(self, h: Any, r: Recorded, parts: list[str]) -> None:
        if not parts:
            if r.method == "PUT":
                return self._etl_init(h, r)
            if r.method == "GET":
                return h.json(200, [{"id": name, "stage": etl.stage, "xaction_id": etl.xaction, "obj_count": 0,
                                     "in_bytes": 0, "out_bytes": 0} for name, etl in self.etls.items()])
            raise ContractViolation(f"{r.method} /v1/etl is not an ETL operation")
        name, action = parts[0], parts[1] if len(parts) > 1 else ""
        etl = self.etls.get(name)
        if etl is None:
            return h.error(404, f"p[fake]: etl job {name} does not exist")
        if r.method == "GET" and action in ("", "logs") and etl.stage == "Aborted":
            # AIS asks the targets, which hold nothing for a stopped ETL (ais/prxetl.go infoETL, logsETL)
            return h.error(404, f"t[fake]: {name} does not exist")
        if r.method == "GET" and action == "":
            extra = set(r.query) - {"uuid"}
            if extra:
                raise ContractViolation(f"unexpected query {sorted(extra)} on ETL details")
            job = r.query.get("uuid", [""])[-1]
            return h.json(200, {"init_msg": as_reported(etl.message),
                                "obj_errors": etl.job_errors.get(job, []) if job else []})
        if r.method == "GET" and action == "logs":
            # AIS: one entry per target, the pod's log base64-encoded (ais/prxetl.go logsETL).
            logs = base64.b64encode(self.pod_logs.encode()).decode()
            return h.json(200, [{"target_id": "t1", "logs": logs}])
        if r.method == "POST" and action == "stop":
            etl.stage = "Aborted"
            return h.reply(200)
        if r.method == "POST" and action == "start":
            if etl.stage != "Aborted":
                return h.error(400, f"etl job {name} is {etl.stage}; only an aborted ETL can be started")
            etl.stage = "Running"
            return h.reply(200)
        if r.method == "DELETE" and action == "":  # a running ETL is stopped and deleted (ais/prxetl.go)
            del self.etls[name]
            return h.reply(200)
        raise ContractViolation(f"{r.method} /v1/etl/{'/'.join(parts)} is not an ETL operation")

    def _etl_init(self, h: Any, r: Recorded) -> None:
        msg = r.body
        if not isinstance(msg, dict):
            raise ContractViolation("init body must be a JSON object (ETLSpecMsg)")
        unknown = set(msg) - INIT_FIELDS
        if unknown:
            raise ContractViolation(f"unknown init fields {sorted(unknown)} (AIS would silently ignore them)")
        name = msg.get("name", "")
        if not (6 <= len(name) <= 32 and NAME.fullmatch(name)):
            raise ContractViolation(f"invalid ETL name {name!r}")
        comm = msg.get("communication", "")
        if comm not in ("hpush://", "hpull://", "ws://"):
            raise ContractViolation(f"communication {comm!r} is not hpush://, hpull:// or ws://")
        if comm == "ws://" and msg.get("support_direct_put") is not True:
            raise ContractViolation("ws:// requires support_direct_put: true")
        for key in ("init_timeout", "obj_timeout"):
            if key in msg and not DURATION.match(str(msg[key])):
                raise ContractViolation(f"{key} {msg[key]!r} is not a Go duration")
        if "support_direct_put" in msg and not isinstance(msg["support_direct_put"], bool):
            raise ContractViolation("support_direct_put must be a boolean")
        runtime = msg.get("runtime")
        if not isinstance(runtime, dict) or not runtime.get("image"):
            raise ContractViolation("runtime.image is required")
        if set(runtime) - {"image", "command", "env"}:
            raise ContractViolation(f"unknown runtime fields {sorted(set(runtime) - {'image', 'command', 'env'})}")
        if "command" in runtime and not (isinstance(runtime["command"], list)
                                         and all(isinstance(c, str) for c in runtime["command"])):
            raise ContractViolation("runtime.command must be a list of strings")
        for env in runtime.get("env", []) + msg.get("env", []):
            if set(env) != {"name", "value"} or not all(isinstance(v, str) for v in env.values()):
                raise ContractViolation(f"env entry {env!r} is not {{name: str, value: str}}")
        if "resources" in msg and not set(msg["resources"]) <= {"requests", "limits"}:
            raise ContractViolation("resources holds only requests and limits")
        for values in (msg.get("resources") or {}).values():
            for quantity in values.values():
                k8s_quantity(quantity)  # AIS (K8s's JSON decoding) refuses what is not a quantity
        if name in self.etls:
            return h.error(409, f"etl job {name} already exists")
        self.etls[name] = etl = FakeEtl(msg)
        time.sleep(self.init_seconds)  # AIS answers once every target's pod is ready
        h.reply(200, etl.xaction.encode())

