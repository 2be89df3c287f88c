"""The pod's exceptions, and the ones the client shares (TransformerError, ConfigError, ShardError, IncompleteShard).

The client's own derive from these and live in transformer/client/errors.py. Each error names what a
user needs to act on it: the shard, the sample key, the member and the reason. ``status`` is the
HTTP status the server answers with; AIS surfaces it to the caller as ``ETL error: <message>``
(docs/contract.md). ``StreamAborted``, last, is no error of the transformer's but the pod's way to
cut a response short.
"""

from __future__ import annotations


class TransformerError(Exception):
    """Base class; ``status`` is the HTTP status that best describes the failure."""

    status = 500

    def __init__(self, message: str, **context: object):
        """``context``: the named parts of the message (shard, key, member, reason, ...), kept as attributes."""
        super().__init__(message)
        self.message = message
        for name, value in context.items():
            setattr(self, name, value)


class ConfigError(TransformerError):
    """A service setting (environment variable) is invalid; raised at start-up."""

    variable: str
    reason: str

    def __init__(self, variable: str, reason: str):
        super().__init__(f"invalid setting {variable}: {reason}", variable=variable, reason=reason)


class OptionsError(TransformerError):
    """A per-request option (``etl_args`` or a transform spec) is invalid."""

    field: str
    reason: str
    status = 400

    def __init__(self, field: str, reason: str):
        super().__init__(f"invalid etl_args field '{field}': {reason}", field=field, reason=reason)


class SampleTransformError(TransformerError):
    """One sample's own content could not be transformed (not decodable, over a limit, refused by a transform
    step, a member name taken twice): the only failure the error policy decides on. Every other exception
    met while transforming a sample is the pod's own and fails the shard (``engine``)."""

    shard: str
    key: str
    member: str
    reason: str
    status = 422

    def __init__(self, shard: str, key: str, member: str, reason: str):
        super().__init__(f"shard '{shard}': sample '{key}' (member '{member}'): {reason}", shard=shard, key=key,
                         member=member, reason=reason)


class ShardError(TransformerError):
    """The shard itself is unreadable (not a tar, truncated, a member over the size limit)."""

    shard: str
    reason: str
    status = 422

    def __init__(self, shard: str, reason: str):
        super().__init__(f"shard '{shard}': {reason}", shard=shard, reason=reason)


class IncompleteShard(ShardError):
    """A shard that lacks a valid end marker: cut short, or not written by this ETL.

    ``samples`` is how many samples the reader had received from it; ``retryable`` is false where a
    new read cannot help (it differed from the first one).
    """

    def __init__(self, shard: str, detail: str, samples: int, retryable: bool = True):
        super().__init__(shard, f"incomplete, {samples} samples received: {detail}")
        self.detail, self.samples, self.retryable = detail, samples, retryable


class RequestError(TransformerError):
    """The request is malformed (bad header, missing input); ``status`` is set per case."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class UpstreamError(TransformerError):
    """An outbound call (hpull fetch, direct put, next pipeline stage) failed.

    ``transient``: another attempt might succeed (False for a refusal that would repeat, such as TLS
    refusing a certificate).
    """

    def __init__(self, message: str, status: int = 502, body: bytes = b"", transient: bool = True):
        super().__init__(message)
        self.status = status
        self.body = body
        self.transient = transient


class InternalError(TransformerError):
    """Something the transformer did not anticipate (a bug); its traceback is logged where it happened."""


class FrameCut(InternalError):
    """A ws reply's writer (a transform worker process) stopped in the middle of a frame that cannot be
    completed: the connection cannot carry another message and is closed."""


class Cancelled(TransformerError):
    """The caller went away; the work stops and nothing is reported to anyone."""

    status = 499


class StepRefused(Exception):
    """Control flow in the core: a transform step (torchvision's, with our canvas check) refused a sample's
    tensors. ``samples.transform_sample`` words it as a ``SampleTransformError``; ``cause`` is the step's own
    exception. Only what runs inside a step is the content's failure: an error in the code around the steps
    is the pod's."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class WorkerGone(Exception):
    """Control flow in the server: a worker process's end of a shard's stream closed before the shard's end
    (it died). Never reaches a caller: the server turns it into an ``InternalError`` naming the shard."""


class StreamAborted(Exception):
    """Raised out of the ASGI app so the server drops the connection mid-body (on purpose).

    Control flow inside the pod, no ``TransformerError``: the failure it carries was one already (or a
    bug), and it never reaches a caller as an answer, only as a connection cut (server/httpreply.py).

    ``foreseen``: the failure is one the service answers this way by design (a ``TransformerError``:
    a sample under ``on_error=fail``, the rest of the shard unreadable, the object timeout, the caller
    gone), which its job logged as one line; the server's record of the exception, a traceback under
    "Exception in ASGI application", is then left out (``server.logs.ForeseenAbortFilter``). A bug keeps it.
    """

    def __init__(self, message: str, foreseen: bool = False):
        super().__init__(message)
        self.foreseen = foreseen
