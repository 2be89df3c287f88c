"""The client's exceptions, in one place. Each names what a user needs to act on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


class SampleError(ClientError, ValueError):
    """A sample the loader skips: it lacks a key asked for, or a value of it cannot be decoded."""

    def __init__(self, url: str | None, key: str | None, reason: str):
        super().__init__(f"shard {url}: sample '{key}': {reason}")
        self.url = url
        self.key = key
        self.reason = reason


class DuplicateMember(ClientError, ValueError):
    """A sample of a shard holds two members with one extension: the shard's own content, not a cut."""

    def __init__(self, url: str, key: str, extension: str):
        super().__init__(f"{url}: sample '{key}' has two '{extension}' members")
        self.url = url
        self.key = key
        self.extension = extension


class ConvertError(ClientError):
    """A dataset folder cannot be converted (layout not recognized, nothing to write)."""


class ShuffleError(ClientError):
    """A dSort shuffle job failed, was aborted or timed out."""


class OfflineOptionsMismatch(ClientError):
    """The registered ETL would make the offline copy with other options than the ones asked for."""

    def __init__(self, name: str, differences: dict[str, tuple[object, object]]):
        details = "; ".join(f"{key}: the ETL uses {got!r}, wanted {want!r}" for key, (got, want) in differences.items())
        super().__init__(
            f"ETL '{name}' cannot make this offline copy ({details}). AIS passes no etl_args to offline "
            f"transforms: the pod uses the settings the ETL was registered with. Register an ETL for this copy "
            f"with these options as its settings, e.g. register(client, '{name[:24]}-val', EtlSettings(image=..., "
            f"preset=..., dtype=...)), and transform with that one")
        self.name = name
        self.differences = differences


class IncompleteCopy(ClientError):
    """An offline job (a transform or a download) left objects it was asked for missing from its destination,
    or stored them cut, and recorded no error for them; raised whatever AIS says of the job.

    ``missing`` and ``cut`` (object -> why) name them by their destination names, each followed in the
    message by what it was made from where that differs (``sources``); ``job`` is the finished job as
    the helper would have returned it (AIS's status, its recorded errors).
    """

    def __init__(self, job_id: str, origin: str, bucket: str, missing: Sequence[str], cut: Mapping[str, str], *,
                 expected: int, ais_status: str, sources: Mapping[str, str] | None = None, job: object = None):
        sources = sources or {}

        def named(name: str) -> str:
            source = sources.get(name, name)
            return name if source == name else f"{name} (from {source})"

        parts = []
        if missing:
            parts.append(f"missing: {_some([named(n) for n in missing])}")
        if cut:
            parts.append("stored cut (no valid end marker): "
                         + _some([f"{named(n)}: {why}" for n, why in cut.items()]))
        lost = len(missing) + len(cut)
        super().__init__(
            f"job {job_id} ({origin} -> ais://{bucket}): {lost} of {expected} objects asked for are not whole in "
            f"the destination and AIS recorded no error for them ({ais_status}); {'; '.join(parts)}. "
            f"Transform or download these objects again")
        self.job_id = job_id
        self.bucket = bucket
        self.missing = list(missing)
        self.cut = dict(cut)
        self.job = job


class OrphanDeleteRefused(ClientError):
    """``delete_orphans`` deleted nothing: the destination's listing cannot prove what is an orphan.

    A listing taken during a rebalance (or after an interrupted one) leaves out objects that exist, so
    a copy of an existing source could look like an orphan; the transform itself is done and proven:
    ``job`` is the finished job, its ``changes`` included.
    """

    job: object = None

    def __init__(self, bucket: str, reason: str, orphans: Sequence[str]):
        super().__init__(f"ais://{bucket}: {len(orphans)} orphan(s) not deleted: {reason}. Nothing was deleted; "
                         "run the sync again with delete_orphans once the rebalance has ended (`ais show rebalance`)")
        self.bucket = bucket
        self.reason = reason
        self.orphans = list(orphans)


def _some(items: Sequence[str], shown: int = 10) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


class EtlRequestError(ClientError):
    """AIS refused an ETL request; carries the cluster's own message, and what it means when it is known.

    A cluster that cannot run ETLs at all says so on the first ETL request: outside Kubernetes ("the
    operation requires Kubernetes", or "k8s client is not initialized" from a target), or from an
    ``aisnode`` built without ETL support.
    """

    def __init__(self, name: str, action: str, endpoint: str, status: int | None, ais_message: str,
                 node: str = ""):
        where = f"HTTP {status}" if status is not None else "no HTTP status"
        if node:
            where += f" from {node}"
        hint = etl_hint(ais_message)
        super().__init__(f"ETL '{name}': {action} at {endpoint} failed ({where}): {ais_message}"
                         + (f". {hint}" if hint else ""))
        self.name = name
        self.action = action
        self.status = status
        self.ais_message = ais_message
        self.node = node
        self.cannot_run_etl = bool(hint)


_NO_KUBERNETES = ("requires kubernetes", "k8s client is not initialized", "non-kubernetes deployment")
_NOT_BUILT = ("build without etl support",)


def etl_hint(ais_message: str) -> str:
    """What an AIS error about ETL means for the user, or '' when it is not one of the known refusals."""
    text = ais_message.lower()
    if any(phrase in text for phrase in _NO_KUBERNETES):
        return ("This AIS cluster cannot run ETLs: AIS starts each ETL pod through the Kubernetes API, next to "
                "every target, and these nodes do not run in Kubernetes. Register it on an AIS cluster deployed "
                "in Kubernetes (aisnode images with ETL support: aistorage/aisnode:<version>-etl); here, read "
                "the shards without ETL: shard_urls(client, bucket, None, ...) and make_loader(..., "
                "require_marker=False)")
    if any(phrase in text for phrase in _NOT_BUILT):
        return ("This aisnode was built without ETL support (Go build tag 'etl'; AIS images with it: "
                "aistorage/aisnode:<version>-etl), and ETL also needs AIS deployed in Kubernetes")
    return ""


class SharedMemoryError(ClientError, OSError):
    """A DataLoader worker's batch does not fit in ``/dev/shm``, where batches from workers live: the
    message says how much there is, about how much this loader needs, and how to give it more."""


class LoaderStateError(ClientError, ValueError):
    """A saved loader state this loader cannot resume from: another configuration, or another format."""


class ResumeError(ClientError):
    """A shard read again on resume does not hold what the saved state says it held."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"shard {url}: cannot resume exactly: {reason}")
        self.url = url
        self.reason = reason
