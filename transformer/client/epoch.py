"""What every reader of an epoch agrees on: its shard URLs and their order, and the count of errors.

``make_loader`` and the DALI source (``dali.EtlBatchSource``) shuffle an epoch's shard list
*before* splitting it by rank and worker, with a seed every rank and worker shares
(``shard_order``), so each shard is read exactly once per epoch across the whole job;
``urls_digest`` is the list's fingerprint in a saved state. Errors go to ``ErrorCounter``, which
counts (across worker processes), logs the first few and skips: webdataset's ``warn_and_continue``
sleeps 0.5 s per error.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import random
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from .errors import ClientError, SharedMemoryError

log = logging.getLogger("transformer.client")


class ErrorCounter:
    """A webdataset handler that counts errors across worker processes, logs a few, and skips.

    ``max_errors`` turns a flood of errors (a dead endpoint, a wrong ETL name) into one exception
    instead of an empty epoch. Shared memory, so it must be created before the workers start.
    """

    def __init__(self, log_first: int = 10, max_errors: int | None = None):
        self._count = multiprocessing.get_context().Value("q", 0)
        self.log_first = log_first
        self.max_errors = max_errors

    @property
    def count(self) -> int:
        return self._count.value

    def reset(self) -> None:
        with self._count.get_lock():
            self._count.value = 0

    def __call__(self, exc: BaseException) -> bool:
        if isinstance(exc, SharedMemoryError):  # the machine's, not a shard's: every later batch would fail too
            raise exc
        with self._count.get_lock():
            self._count.value += 1
            seen = self._count.value
        if seen <= self.log_first:
            log.warning("skipped after error %d: %s", seen, _describe(exc))
        if self.max_errors is not None and seen > self.max_errors:
            raise ClientError(f"more than {self.max_errors} loader errors; the last: {_describe(exc)}") from exc
        return True


def _describe(exc: BaseException) -> str:
    parts = [str(a) for a in exc.args if isinstance(a, (str, int)) and str(a)]
    text = "; ".join(parts) if parts else exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"[:500]


def _mix(*values: int) -> str:
    """A seed for ``random.Random`` from several integers; str seeds are hashed with SHA-512, so every
    process derives the same generator (unlike ``hash``, which is salted per process for str)."""
    return ":".join(str(v) for v in values)


def epoch_urls(urls: Sequence[str] | Callable[[int], Sequence[str]], epoch: int) -> tuple[str, ...]:
    found = tuple(urls(epoch) if callable(urls) else urls)
    if not found:
        raise ClientError("no shard URLs for this epoch")
    return found


def shard_order(count: int, *, shuffle: bool, seed: int, epoch: int, part: int = 0, parts: int = 1) -> tuple[int, ...]:
    """URL indices in reading order: shuffled the same way in every process (seed, epoch), then part
    ``part`` of ``parts`` (a rank's, a worker's)."""
    order = list(range(count))
    if shuffle:
        random.Random(_mix(seed, epoch)).shuffle(order)
    return tuple(order[part::parts])


def urls_digest(urls: Sequence[str]) -> str:
    """A fingerprint of a URL list, without the endpoints (scheme, host, port): the same bucket,
    objects and etl_args read through another proxy, or a restarted local service, are the same shards."""
    digest = hashlib.sha256()
    for url in urls:
        parts = urlsplit(url)
        digest.update((url if not parts.netloc else parts._replace(scheme="", netloc="").geturl()).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]
