"""What a training loop receives: samples/s out of a ``WebLoader``.

* client-side decoding, the pre-ETL way: webdataset ``WebLoader`` workers read the raw shards, decode
  with PIL and apply the torchvision v1 recipe (the AIS WebDataset blog's loader);
* ``transformer.client.make_loader`` reading the service's output: live over HTTP from the service on
  the same machine (so the service and the loader share the cores), and from the same output saved to
  disk (the loader's own cost: ``.npy`` decode, batching, worker IPC), float32 against uint8;
* the readers of ETL'd shards on disk, per core (``python -m bench.reader``): a minimal one-copy
  reader (the floor), ``make_loader`` with and without a shuffle buffer, ``web_loader`` (the
  webdataset way, shards read whole) and plain webdataset; and a loader's memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import webdataset as wds


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
    from .peers.recipes import PRESETS  # torchvision's: imported by the one reader that needs it

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

    from testbed.aisnames import go_path_escape

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


# ---- readers of ETL'd shards on disk, one core ------------------------------------------------------------


def etl_shards(folder: Path, sources: list[Path], preset: str, dtype: str) -> list[Path]:
    """The service's output for ``sources`` (``transform_shard``, as the pod writes it: ``.npy``, the
    pass-through members, the end marker), written once into ``folder``."""
    from transformer.config import Settings
    from transformer.engine import transform_shard
    from transformer.options import options_from_mapping
    from transformer.pool import TransformPool

    folder.mkdir(parents=True, exist_ok=True)
    targets = [folder / source.name for source in sources]
    if all(target.exists() for target in targets):
        return targets
    options = options_from_mapping({"preset": preset, "dtype": dtype}, Settings.from_env({}))
    pool = TransformPool(workers=2, max_inflight=8)
    try:
        for source, target in zip(sources, targets):
            partial = target.with_name(target.name + ".partial")
            with open(source, "rb") as stream, open(partial, "wb") as out:
                for piece in transform_shard(stream, options, pool, shard=source.name, object_name=source.name,
                                             window=16):
                    out.write(piece)
            partial.replace(target)
    finally:
        pool.shutdown()
    return targets


def one_copy_batches(paths: list[Path], batch_size: int) -> Iterator[tuple]:
    """The floor a loader of ETL'd shards is measured against: tar headers and ``.npy`` headers read here
    with no checks beyond what finding the bytes needs, each array read with ``readinto`` straight into
    its row of a batch tensor (one copy, from the page cache), labels from ``.cls``. No end marker, no
    grouping by key, no error handling. Batch arrays are allocated and reused as make_loader's are: by
    numpy (``torch.empty`` would fault 4 KB pages: a float32 batch would cost about 4x more to fill),
    and filled again once the consumer let go of them (the loader's ``Recycler``), a new one while it
    holds them."""
    import numpy as np
    import torch
    from numpy.lib import format as npy

    from transformer.client.batchmemory import Recycler

    recycler = Recycler(keep=4)
    headers: dict[bytes, tuple] = {}
    images = labels = None
    row = 0
    for path in paths:
        with open(path, "rb", buffering=0) as stream:
            key, label, placed = None, None, None  # the sample being read: its key, label, batch row
            while True:
                block = stream.read(512)
                if len(block) < 512 or not block[0]:
                    break
                name = block[:100].split(b"\0", 1)[0]
                size = int(block[124:136].strip(b"\0 ") or b"0", 8)
                padding = -size % 512
                if not name.startswith(key or b"\0"):  # the member of another sample (keys end at a dot)
                    key, label, placed = name.split(b".", 1)[0] + b".", None, None
                if name.endswith(b".npy"):
                    prefix = stream.read(10)
                    head = prefix + stream.read(int.from_bytes(prefix[8:10], "little"))
                    if head not in headers:
                        shape, _, dtype = npy.read_array_header_1_0(io.BytesIO(head[8:]))
                        headers[head] = (shape, dtype)
                    shape, dtype = headers[head]
                    if images is None or row == batch_size:
                        if images is not None:
                            yield images, labels
                        # numpy's allocation, as make_loader's: large arrays get huge pages (fewer faults)
                        images, batch, _ = recycler.array((batch_size, *shape), dtype)
                        rows = batch.reshape(batch_size, -1).view(np.uint8)
                        recycler.give(batch, -1)
                        labels, row = torch.empty(batch_size, dtype=torch.int64), 0
                    stream.readinto(rows[row])
                    placed, row = row, row + 1
                    if label is not None:
                        labels[placed] = label
                    stream.seek(padding, 1)
                elif name.endswith(b".cls"):
                    label = int(stream.read(size))
                    if placed is not None:
                        labels[placed] = label
                    stream.seek(padding, 1)
                else:
                    stream.seek(size + padding, 1)
    if images is not None and row:
        yield images[:row], labels[:row]


def reader_cases(batch_size: int) -> dict:
    """Reader name -> a function of the shard paths returning an iterable of (images, labels, ...)."""
    from transformer.client import web_loader

    def loader(buffer: int, workers: int = 0):
        return lambda paths: _disk_loader([str(p) for p in paths], batch_size, buffer, workers)

    return {
        "one-copy reader (floor)": lambda paths: one_copy_batches(paths, batch_size),
        "make_loader, shuffle_buffer=0": loader(0),
        "make_loader, shuffle_buffer=1000": loader(1000),
        # the reading in a DataLoader worker, its batches sent to this process through shared memory
        "make_loader, shuffle_buffer=1000, num_workers=1": loader(1000, 1),
        "web_loader (WebLoader, shards read whole)": lambda paths: web_loader(
            [str(p) for p in paths], batch_size, keys=("npy", "cls"), num_workers=0, shuffle_buffer=0,
            shardshuffle=False),
        "plain webdataset": lambda paths: wds.WebDataset([str(p) for p in paths], shardshuffle=False)
        .decode().to_tuple("npy", "cls").batched(batch_size),
    }


def read_all(case, paths: list[Path], expected: int) -> dict:
    """One pass of a reader over ``paths`` on this core: samples/s and CPU seconds over the whole epoch,
    and ``steady_samples_per_s`` over its middle (from a fifth of its batches to four fifths: after a
    shuffle's batches first filled, which touches their memory for the first time, and before they
    drain). Each batch is let go when the next one arrives, as a training loop does."""
    cpu = time.process_time()
    start = time.monotonic()
    marks = []  # (time, samples) after each batch
    for batch in case(paths):
        marks.append((time.monotonic(), len(batch[0])))
    seconds = time.monotonic() - start
    cpu = time.process_time() - cpu
    samples = sum(count for _, count in marks)
    if samples != expected:
        raise RuntimeError(f"read {samples} samples, not {expected}")
    low, high = len(marks) // 5, len(marks) * 4 // 5
    steady = (sum(count for _, count in marks[low + 1:high + 1]) / (marks[high][0] - marks[low][0])
              if high > low else samples / seconds)  # a smoke run's few batches: the whole epoch
    return {"samples": samples, "batches": len(marks), "seconds": seconds, "samples_per_s": samples / seconds,
            "steady_samples_per_s": steady, "first_batch_s": marks[0][0] - start, "cpu_s": cpu}


def read_in_process(reader: str, paths: list[Path], expected: int, batch_size: int) -> dict:
    """``read_all`` in a process of its own. Each reader starts from a fresh heap: which batch
    allocations page-fault (a float32 batch of 64 is 38.5 MB) depends on what the process freed before,
    so readers measured one after another in one process would inherit each other's heap."""
    return _in_child("read", {"reader": reader, "paths": [str(p) for p in paths], "expected": expected,
                              "batch_size": batch_size}, f"{reader}: ")


def loader_memory(paths: list[Path], batch_size: int, shuffle_buffer: int, workers: int) -> dict:
    """Peak memory of a ``make_loader`` over one epoch of ``paths``, in a process of its own: the sum
    of PSS (proportional set size: shared pages split between the processes sharing them) of the
    loader's process and its workers, before the epoch and at its peak (sampled every 50 ms)."""
    return _in_child("memory", {"paths": [str(p) for p in paths], "batch_size": batch_size,
                                "shuffle_buffer": shuffle_buffer, "workers": workers}, "memory run failed: ")


def _in_child(command: str, spec: dict, failure: str) -> dict:
    """``python -m bench.client_side <command> <spec>`` in a fresh process: the JSON it prints last."""
    done = subprocess.run([sys.executable, "-m", "bench.client_side", command, json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"{failure}{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _disk_loader(paths: list[str], batch_size: int, shuffle_buffer: int, workers: int = 0):
    """``make_loader`` over shards on disk, in their order, on this machine alone."""
    from transformer.client import make_loader

    return make_loader(paths, batch_size, keys=("npy", "cls"), num_workers=workers, shuffle_shards=False,
                       shuffle_buffer=shuffle_buffer, split_by_node=False, pin_memory=False)


def _memory_child(spec: dict) -> dict:
    import psutil


    me = psutil.Process()

    def pss() -> int:
        total = 0
        for process in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a worker that just ended
                total += process.memory_full_info().pss
        return total

    loader = _disk_loader(spec["paths"], spec["batch_size"], spec["shuffle_buffer"], spec["workers"])
    before = pss()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], pss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    samples = sum(len(batch[0]) for batch in loader)
    stop.set()
    sampler.join()
    return {"shuffle_buffer": spec["shuffle_buffer"], "workers": spec["workers"], "samples": samples,
            "pss_before": before, "pss_peak": max(peak[0], pss())}


def _read_child(spec: dict) -> dict:
    return read_all(reader_cases(spec["batch_size"])[spec["reader"]], [Path(p) for p in spec["paths"]],
                    spec["expected"])


if __name__ == "__main__" and len(sys.argv) == 3:
    print(json.dumps({"read": _read_child, "memory": _memory_child}[sys.argv[1]](json.loads(sys.argv[2]))))
