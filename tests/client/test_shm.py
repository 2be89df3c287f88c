"""The loader's batches from workers in a small /dev/shm: what it needs there (docs/client.md), and the error
that names the cause and the fix when it is not there. Each case runs in a subprocess with a tmpfs of its own
size on /dev/shm, in a mount namespace of its own (unshare --mount): the host's /dev/shm is never touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from transformer.client.batchmemory import ShmBudget, shm_message

ROOT = Path(__file__).resolve().parents[2]
SIDE, BATCH, WORKERS, PREFETCH = 64, 16, 2, 2
BATCH_BYTES = BATCH * 3 * SIDE * SIDE * 4 + BATCH * 8  # a float32 image batch and its int64 labels
# flags, semaphores and tmpfs' page rounding: what /dev/shm holds besides the batches
OVERHEAD = 256 * 1024

LOAD = textwrap.dedent("""
    import io, json, sys, tarfile
    from pathlib import Path
    import numpy as np
    from testbed.shardgen import npy_bytes, sealed
    from transformer.client import SharedMemoryError, make_loader

    folder, side, batch, workers, prefetch, shuffle = sys.argv[1:]
    side, batch, workers, prefetch, shuffle = int(side), int(batch), int(workers), int(prefetch), int(shuffle)
    urls = []
    for s in range(workers * 2):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for i in range(s * 40, (s + 1) * 40):
                for name, data in ((f"k{i:05d}.npy", npy_bytes(np.full((3, side, side), i, np.float32))),
                                   (f"k{i:05d}.cls", b"%d" % i)):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
        path = Path(folder) / f"shard-{s}.tar"
        path.write_bytes(sealed(buffer.getvalue()))
        urls.append(str(path))
    loader = make_loader(urls, batch, keys=("npy", "cls", "__key__"), num_workers=workers,
                         prefetch_factor=prefetch, shuffle_buffer=shuffle)
    labels = []
    try:
        for images, batch_labels, _ in loader:
            assert (images[:, 0, 0, 0].long() == batch_labels).all()
            labels += batch_labels.tolist()
    except SharedMemoryError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    else:
        print(json.dumps({"labels": sorted(labels)}))
""")


def _load(tmp_path: Path, shm_bytes: int, shuffle: int) -> dict:
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    mount = f"mount -t tmpfs -o size={shm_bytes // 1024}k ais-wds-test-shm /dev/shm"
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    command = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c",
               f'{mount} && exec "$0" "$@"', sys.executable, str(script), str(tmp_path),
               str(SIDE), str(BATCH), str(WORKERS), str(PREFETCH), str(shuffle)]
    # A fresh interpreter (under unshare): it must import this checkout's testbed (never installed) and transformer.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_documented_amount_of_shm_is_enough(tmp_path: Path) -> None:
    # shuffle_buffer 32 of batches of 16: two open batches per worker, each in shared memory
    budget = ShmBudget(workers=WORKERS, prefetch_factor=PREFETCH, open_batches=2)
    result = _load(tmp_path, budget.batches * BATCH_BYTES + OVERHEAD, shuffle=32)
    assert result.get("labels") == list(range(WORKERS * 2 * 40)), result


def test_too_little_shm_ends_in_an_error_that_names_the_cause_and_the_fix(tmp_path: Path) -> None:
    result = _load(tmp_path, 2 * BATCH_BYTES, shuffle=0)  # room for two of the 8 batches it needs
    assert result.get("error") == "SharedMemoryError", result
    message = result["message"]
    assert "a DataLoader worker cannot allocate a 0.8 MB batch tensor in shared memory: /dev/shm has" in message
    assert "free of 1.5 MB" in message
    assert "No space left on device" in message  # torch's own reason, kept
    assert "2 x (1 + 2 + 2) = 10 such batches there" in message
    assert "about 7.5 MB" in message and "--shm-size=64m" in message
    assert "emptyDir with medium: Memory" in message and "num_workers" in message


def test_the_message_sizes_the_fix_from_the_batches_it_needs() -> None:
    budget = ShmBudget(workers=8, prefetch_factor=2, open_batches=4)  # docs/client.md's example
    assert budget.batches == 64
    message = shm_message(154 * 2**20, budget, "No space left on device (28)")
    assert "8 x (4 + 2 + 2) = 64 such batches there, about 9856.0 MB" in message
    assert "--shm-size=12320m" in message
    assert "--shm-size=8g" in shm_message(2**20, None, "No space left on device (28)")
