"""A protobuf reader for the Pod and Service fields AIS writes to the fake Kubernetes API (``fake_kube.py``).

client-go's typed clients send protobuf request bodies (``k8s\\0`` + ``runtime.Unknown``); these schemas
name the fields AIS sets, with their numbers from ``k8s.io/api/core/v1/generated.proto``.
"""

from __future__ import annotations

import json


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def wire_fields(data: bytes) -> dict[int, list]:
    """Protobuf wire format: field number -> values (ints for varints, bytes for length-delimited)."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _varint(data, pos)
        elif kind == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif kind == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif kind == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"protobuf wire type {kind} is not supported")
        fields.setdefault(number, []).append(value)
    return fields


# Schemas: field number -> (json name, kind); kind is "str", "int", "bool", "map" (string -> string),
# "qmap" (string -> Quantity), "intstr", or a nested schema; a list around it means repeated.
_QUANTITY = {1: ("string", "str")}
_META = {1: ("name", "str"), 3: ("namespace", "str"), 11: ("labels", "map"), 12: ("annotations", "map")}
_ENV = {1: ("name", "str"), 2: ("value", "str")}
_PORT = {1: ("name", "str"), 3: ("containerPort", "int"), 4: ("protocol", "str")}
_HTTP_GET = {1: ("path", "str"), 2: ("port", "intstr"), 4: ("scheme", "str")}
_PROBE = {1: ("handler", {2: ("httpGet", _HTTP_GET)}), 3: ("timeoutSeconds", "int"), 4: ("periodSeconds", "int")}
_MOUNT = {1: ("name", "str"), 2: ("readOnly", "bool"), 3: ("mountPath", "str")}
_RESOURCES = {1: ("limits", "qmap"), 2: ("requests", "qmap")}
_CONTAINER = {
    1: ("name", "str"), 2: ("image", "str"), 3: ("command", ["str"]), 4: ("args", ["str"]),
    6: ("ports", [_PORT]), 7: ("env", [_ENV]), 8: ("resources", _RESOURCES), 9: ("volumeMounts", [_MOUNT]),
    11: ("readinessProbe", _PROBE), 13: ("terminationMessagePath", "str"),
    20: ("terminationMessagePolicy", "str"), 14: ("imagePullPolicy", "str"),
}
_REQUIREMENT = {1: ("key", "str"), 2: ("operator", "str"), 3: ("values", ["str"])}
_AFFINITY = {1: ("nodeAffinity", {1: ("requiredDuringSchedulingIgnoredDuringExecution", {
    1: ("nodeSelectorTerms", [{1: ("matchExpressions", [_REQUIREMENT])}])})})}
_VOLUME = {1: ("name", "str"), 2: ("source", {1: ("hostPath", {1: ("path", "str"), 2: ("type", "str")})})}
_POD_SPEC = {1: ("volumes", [_VOLUME]), 2: ("containers", [_CONTAINER]),
             20: ("initContainers", [_CONTAINER]), 3: ("restartPolicy", "str"), 18: ("affinity", _AFFINITY)}
POD = {1: ("metadata", _META), 2: ("spec", _POD_SPEC)}
_SERVICE_PORT = {1: ("name", "str"), 2: ("protocol", "str"), 3: ("port", "int"), 4: ("targetPort", "intstr"),
                 5: ("nodePort", "int")}
SERVICE = {1: ("metadata", _META), 2: ("spec", {1: ("ports", [_SERVICE_PORT]), 2: ("selector", "map"),
                                                4: ("type", "str")})}


def _convert(value, kind):
    if kind == "str":
        return value.decode()
    if kind == "int":
        return value - (1 << 64) if value >= 1 << 63 else value
    if kind == "bool":
        return bool(value)
    if kind == "intstr":
        parts = wire_fields(value)
        return parts[3][0].decode() if parts.get(1, [0])[0] == 1 else parts.get(2, [0])[0]
    if kind in ("map", "qmap"):
        entry = wire_fields(value)
        key = entry.get(1, [b""])[0].decode()
        raw = entry.get(2, [b""])[0]
        return key, (decode_message(raw, _QUANTITY).get("string", "") if kind == "qmap" else raw.decode())
    return decode_message(value, kind)


def decode_message(data: bytes, schema: dict) -> dict:
    """A protobuf message as the JSON object Kubernetes would show, for the fields in ``schema``."""
    out: dict = {}
    for number, values in wire_fields(data).items():
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, list):
            out[name] = [_convert(v, kind[0]) for v in values]
        elif kind in ("map", "qmap"):
            out[name] = dict(_convert(v, kind) for v in values)
        else:
            out[name] = _convert(values[-1], kind)
    for inline in ("handler", "source"):  # Probe embeds ProbeHandler, Volume its VolumeSource, inline in JSON
        if inline in out:
            out.update(out.pop(inline))
    return out


def decode_body(body: bytes, content_type: str, schema: dict) -> dict:
    """A request body: JSON, or protobuf (``k8s\\0`` + ``runtime.Unknown`` whose ``raw`` is the object)."""
    if "protobuf" not in content_type:
        return json.loads(body)
    if not body.startswith(b"k8s\x00"):
        raise ValueError("a protobuf body without the k8s magic")
    unknown = wire_fields(body[4:])
    return decode_message(unknown.get(2, [b""])[0], schema)
