"""What a training loop receives: samples/s out of a ``WebLoader``.

* client-side decoding, the pre-ETL way: webdataset ``WebLoader`` workers read the raw shards, decode
  with PIL and apply the torchvision v1 recipe (the AIS WebDataset blog's loader);
* ``transformer.client.make_loader`` reading the service's output: live over HTTP from the service on
  the same machine (so the service and the loader share the cores), and from the same output saved to
  disk (the loader's own cost: ``.npy`` decode, batching, worker IPC), float32 against uint8.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import webdataset as wds

from .peers.recipes import PRESETS


def _drain(loader, limit_s: float) -> dict:
    """Iterate ``loader`` to its end (or ``limit_s``), counting samples; the clock includes worker start-up."""
    start = time.monotonic()
    samples = batches = 0
    first = None
    complete = True
    for batch in loader:
        if first is None:
            first = time.monotonic() - start
        samples += len(batch[0])
        batches += 1
        if time.monotonic() - start > limit_s:
            complete = False
            break
    seconds = time.monotonic() - start
    return {"samples": samples, "batches": batches, "seconds": seconds, "samples_per_s": samples / seconds,
            "first_batch_s": first, "complete": complete}


def client_side_decoding(paths: list[Path], preset: str, workers: int, batch_size: int, limit_s: float) -> dict:
    transform = PRESETS[preset]
    dataset = (
        wds.WebDataset([str(p) for p in paths], shardshuffle=False)
        .decode("pil")
        .to_tuple("jpg;png;jpeg", "cls")
        .map_tuple(transform, lambda label: label)
        .batched(batch_size)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=min(workers, len(paths)))
    return {"workers": min(workers, len(paths)), **_drain(loader, limit_s)}


def save_outputs(url: str, bucket: str, paths: list[Path], etl_args: str, folder: Path, timeout: float) -> list[Path]:
    """The service's output for ``paths`` written to ``folder`` (hpush with etl_fqn, as a target would store it)."""
    from urllib.parse import urlencode

    from .services import go_path_escape

    folder.mkdir(parents=True, exist_ok=True)
    saved = []
    for path in paths:
        target = folder / path.name
        query = urlencode({"etl_fqn": go_path_escape(str(path)), "etl_args": etl_args})
        subprocess.run(["curl", "-sSf", "-X", "PUT", "--max-time", f"{timeout:.0f}", "-o", str(target),
                        f"{url}/{bucket}/{path.name}?{query}"], check=True, timeout=timeout + 10)
        saved.append(target)
    return saved


def read_with_client(urls: list[str], workers: int, batch_size: int, limit_s: float) -> dict:
    from transformer.client import make_loader

    loader = make_loader(urls, batch_size, num_workers=workers, shuffle_shards=False, shuffle_buffer=0,
                         split_by_node=False, pin_memory=False)
    return {"workers": min(workers, len(urls)), **_drain(loader, limit_s)}
