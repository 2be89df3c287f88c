"""A transform worker process that hangs in native code on a marked image, for the stuck-worker tests.

``hanging_worker`` is ``server.worker.worker_main`` with one change: an image member whose bytes end
with ``HANG_HOLDING_GIL`` makes the transform thread sleep in C holding the GIL (``ctypes.PyDLL``: every
thread of the process stops, its heartbeat too), and one ending with ``HANG_RELEASING_GIL`` sleeps in C
without it (``ctypes.CDLL``: only that thread stops; the sample runs past the stall bound). A JPEG
decodes the same with bytes after its end marker, so the rest of the shard is ordinary.
"""

from __future__ import annotations

import ctypes
import socket

from transformer.server.worker import WorkerConfig, worker_main

HANG_HOLDING_GIL = b"<hang holding the GIL>"
HANG_RELEASING_GIL = b"<hang releasing the GIL>"


def hanging_worker(control: socket.socket, config: WorkerConfig) -> None:
    from transformer import samples

    header = samples._jpeg_header

    def hanging_header(data):
        tail = bytes(data[-32:])
        if tail.endswith(HANG_HOLDING_GIL):
            ctypes.PyDLL(None).sleep(3600)
        elif tail.endswith(HANG_RELEASING_GIL):
            ctypes.CDLL(None).sleep(3600)
        return header(data)

    samples._jpeg_header = hanging_header
    worker_main(control, config)
