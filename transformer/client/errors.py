"""The client's exceptions, in one place. Each names what a user needs to act on it."""

from __future__ import annotations

from ..errors import TransformerError


class ClientError(TransformerError):
    """Base class of everything the training-side client raises on purpose."""


class EtlNameError(ClientError, ValueError):
    """An ETL name AIS would refuse (6-32 characters of ``[a-z0-9-]``, alphanumeric at both ends)."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"ETL name {name!r} {reason}")
        self.name = name
        self.reason = reason


class EtlSpecMismatch(ClientError):
    """An ETL of that name runs with a different spec; pass ``replace=True`` to re-create it."""

    def __init__(self, name: str, differences: dict[str, tuple[object, object]]):
        details = "; ".join(f"{field}: running {old!r}, wanted {new!r}" for field, (old, new) in differences.items())
        super().__init__(f"ETL '{name}' is already registered with a different spec ({details}); "
                         "pass replace=True to stop, delete and re-create it")
        self.name = name
        self.differences = differences


class ShardFetchError(ClientError, OSError):
    """A shard URL could not be read; carries the HTTP status and the service's short error body."""

    def __init__(self, url: str, reason: str, status: int | None = None):
        where = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"shard {url}: {where}{reason}")
        self.url = url
        self.reason = reason
        self.status = status


class ConvertError(ClientError):
    """A dataset folder cannot be converted (layout not recognized, nothing to write)."""


class ShuffleError(ClientError):
    """A dSort shuffle job failed, was aborted or timed out."""


class LoaderStateError(ClientError, ValueError):
    """A saved loader state this loader cannot resume from: another configuration, or another format."""
