"""The conventional AIS ETL for WebDataset shards: what a user writes today from AIStore's examples.

A subclass of the aistore SDK's ``FastAPIServer`` whose ``transform()`` gets the whole shard (the SDK
reads the body, or the ``etl_fqn`` file, into memory), walks it with webdataset's own tar iterators,
decodes each image with PIL, applies torchvision v1 transforms (the ImageNet recipes of the AIS
WebDataset/ETL blog posts), and writes float32 CHW ``.npy`` members with ``wds.TarWriter`` into a
``BytesIO`` whose bytes are returned. Other members are passed through. It is the same
"JPEG -> 224x224 normalized float32 .npy" contract as this project's default, done the usual way.

Run as the ais-etl images run it (one worker per core, one torch thread per worker, else the workers
fight over the cores)::

    OMP_NUM_THREADS=1 AIS_TARGET_URL=http://... uvicorn bench.peers.conventional_etl:fastapi_app \\
        --workers <cores> --no-access-log
"""

from __future__ import annotations

import io
import json

import webdataset as wds
from aistore.sdk.etl.webserver.fastapi_server import FastAPIServer
from PIL import Image

from .recipes import PRESETS

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


class WebDatasetTorchvisionETL(FastAPIServer):
    """Shard in, shard out: every image becomes ``<key>.npy`` (float32 CHW), the rest passes through."""

    def transform(self, data: bytes, path: str, etl_args: str) -> bytes:
        preset = json.loads(etl_args).get("preset", "imagenet-train") if etl_args else "imagenet-train"
        pipeline = PRESETS[preset]
        samples = wds.tariterators.group_by_keys(
            wds.tariterators.tar_file_expander([{"stream": io.BytesIO(data), "url": path}])
        )
        output = io.BytesIO()
        with wds.TarWriter(output) as sink:
            for sample in samples:
                record = {"__key__": sample["__key__"]}
                for ext, value in sample.items():
                    if ext.startswith("__"):
                        continue
                    if ext.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
                        image = Image.open(io.BytesIO(value)).convert("RGB")
                        record[ext.rsplit(".", 1)[0] + ".npy" if "." in ext else "npy"] = pipeline(image).numpy()
                    else:
                        record[ext] = value
                sink.write(record)
        return output.getvalue()


fastapi_server = WebDatasetTorchvisionETL()
fastapi_app = fastapi_server.app
