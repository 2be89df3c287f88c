"""The fake AIS proxy's dSort routes (``testbed/fake_proxy.py``): ``POST /v1/sort`` checked against ``ais start
dsort``'s spec fields and the SDK's ``DsortFramework``, ``GET /v1/sort?uuid=``; input names and missing inputs as
aisnode v1.5.0 handles them."""

from __future__ import annotations

import io
import random
import re
import tarfile
import time
import uuid
from typing import Any

from braceexpand import braceexpand

from .fake_proxy_etl import ContractViolation, Recorded

DSORT_FIELDS = {"input_bck", "input_format", "input_extension", "output_bck", "output_format", "output_extension",
                "algorithm", "description", "output_shard_size", "ekm_file", "ekm_file_sep", "dsorter_type"}




class DsortRoutes:
    # ---- dSort ---------------------------------------------------------------------------------------

    def _dsort(self, h: Any, r: Recorded) -> None:
        if r.method == "POST":
            return self._dsort_start(h, r)
        if r.method == "GET":
            ids = r.query.get("uuid", [])
            if len(ids) != 1 or ids[0] not in self.dsort_jobs:
                return h.error(404, f"dsort job {ids} does not exist")
            return h.json(200, {"t1": self.dsort_jobs[ids[0]]})
        raise ContractViolation(f"{r.method} /v1/sort is not used by the client")

    def _dsort_start(self, h: Any, r: Recorded) -> None:
        spec = r.body
        if not isinstance(spec, dict):
            raise ContractViolation("dsort spec must be a JSON object")
        if set(spec) - DSORT_FIELDS:
            raise ContractViolation(f"unknown dsort fields {sorted(set(spec) - DSORT_FIELDS)}")
        for key in ("input_bck", "input_format", "input_extension", "output_format", "output_extension", "algorithm"):
            if key not in spec:
                raise ContractViolation(f"dsort spec lacks {key}")
        algorithm = spec["algorithm"]
        if algorithm.get("kind") not in ("alphanumeric", "shuffle", "content"):
            raise ContractViolation(f"algorithm kind {algorithm.get('kind')!r}")
        if not isinstance(algorithm.get("seed", ""), str):
            raise ContractViolation("algorithm.seed must be a string")
        if spec.get("dsorter_type", "") not in ("", "dsort_general", "dsort_mem"):  # ext/dsort GeneralType, MemType
            raise ContractViolation(f"dsorter_type {spec['dsorter_type']!r}")
        if not isinstance(spec["output_format"], str) or "{" not in spec["output_format"]:
            raise ContractViolation("output_format must be a template string")
        source = spec["input_format"]
        if "template" in source:
            inputs = list(braceexpand(no_step(source["template"])))
        elif "objnames" in source:
            inputs = list(source["objnames"])
        else:
            raise ContractViolation("input_format needs template or objnames")
        ext = spec["input_extension"]
        bucket = spec["input_bck"]["name"]
        out_bucket = spec.get("output_bck", spec["input_bck"])["name"]
        records: list[list[tuple[str, bytes]]] = []
        extracted = 0
        for name in inputs:
            # AIS 5.0 (ext/dsort extractShard): the extension is appended to template names only; objnames
            # are whole names. A missing input is skipped (missing_shards "ignore") and not counted.
            path = self.fqn(bucket, name + ext if "template" in source else name)
            if path.is_file():
                records.extend(_records(path.read_bytes()))
                extracted += 1
        random.Random(algorithm.get("seed") or "0").shuffle(records)
        limit = _size(spec.get("output_shard_size") or "1GiB")
        names = iter(braceexpand(no_step(spec["output_format"])))
        shard: list[tuple[str, bytes]] = []
        size = 0
        for record in records:
            shard.extend(record)
            size += sum(len(data) for _, data in record)
            if size >= limit:
                self.put_object(out_bucket, next(names) + spec["output_extension"], _tar(shard))
                shard, size = [], 0
        if shard:
            self.put_object(out_bucket, next(names) + spec["output_extension"], _tar(shard))
        job = "srt-" + uuid.uuid4().hex[:8]
        aborted, errors = self.dsort_error is not None, [self.dsort_error] if self.dsort_error else []
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        phase = {"started_time": now, "end_time": now, "elapsed": 1, "running": False, "finished": True}
        self.dsort_jobs[job] = {
            "id": job, "src-bck": spec["input_bck"], "dst-bck": spec.get("output_bck", spec["input_bck"]),
            "started_time": now, "finish_time": now, "loc-objs": str(len(records)), "loc-bytes": "0",
            "aborted": aborted, "archived": True,
            "Metrics": {
                "local_extraction": {**phase, "total_count": str(len(inputs)), "extracted_count": str(extracted),
                                     "extracted_size": "0",
                                     "extracted_record_count": str(sum(len(r) for r in records)),  # files
                                     "extracted_to_disk_count": "0", "extracted_to_disk_size": "0"},
                "meta_sorting": phase,
                "shard_creation": {**phase, "to_create": "0", "created_count": "0", "moved_shard_count": "0"},
                "aborted": aborted, "errors": errors,
            },
        }
        h.reply(200, job.encode())




def _records(data: bytes) -> list[list[tuple[str, bytes]]]:
    from webdataset.tariterators import base_plus_ext

    records: list[list[tuple[str, bytes]]] = []
    last = None
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive.getmembers():
            key = base_plus_ext(member.name)[0]
            if key != last:
                records.append([])
                last = key
            records[-1].append((member.name, archive.extractfile(member).read()))
    return records


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def no_step(template: str) -> str:
    return re.sub(r"\{(\d+)\.\.(\d+)\.\.1\}", r"{\1..\2}", template)


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?", text.strip())
    if not match:
        raise ContractViolation(f"output_shard_size {text!r} is not a size like 100MB")
    scale = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    return int(match.group(1)) * scale[match.group(2)]


