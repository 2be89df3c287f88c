"""The aistore SDK's reference ETL server (``FastAPIServer``, aistore 2.0.0) with a trivial shard transform.

Run as ``uvicorn tests.contract.reference_server:app`` with ``AIS_TARGET_URL`` set, next to ours, so
the differential tests can send both the same requests. The transform re-tars its input member by
member: on a shard without image members our service emits the same members and bytes, so outputs
compare equal while everything around them (FQN decoding, hpull fetch path, direct put, pipeline
forwarding) is the reference's own code.
"""

from __future__ import annotations

import io
import tarfile

from aistore.sdk.etl.webserver.fastapi_server import FastAPIServer


class RetarServer(FastAPIServer):
    """Reads the input tar and writes every file member into a new tar, in order."""

    def transform(self, data: bytes | str, path: str, etl_args: str) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as source, tarfile.open(
            fileobj=out, mode="w", format=tarfile.PAX_FORMAT
        ) as target:
            for info in source.getmembers():
                target.addfile(info, source.extractfile(info) if info.isfile() else None)
        return out.getvalue()


app = RetarServer(host="127.0.0.1").app
