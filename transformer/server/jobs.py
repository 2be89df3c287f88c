"""One shard request in flight: a driver thread from its input source to its ``Output``.

The driver reads the input, runs ``engine.transform_shard`` (which fans samples out to the shared
``TransformPool``), or has a transform worker process run it (``processes.ShardProcesses``, with
``ETL_PROCESSES``), and sends the result to the caller (through ``Output``), to a direct-put
destination, or to the next ETL stage. The event loop never parses, decodes or waits on CPU work,
which keeps ``/health`` answering while every core is busy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from ..config import Settings
from ..engine import ShardReport, Write, transform_shard
from ..errors import Cancelled, InternalError, TransformerError, UpstreamError
from ..options import TransformOptions
from ..pool import TransformPool
from .body import BodySource
from .duplex import duplex_put
from .hops import (
    HEADER_DIRECT_PUT_LENGTH,
    HEADER_NODE_URL,
    HEADER_RETRY_REASON,
    RETRY_REASON_TRANSIENT,
    DirectPutTarget,
    EtlStage,
    NextHop,
    put_stream,
)
from .metrics import Metrics
from .output import Final, Output
from .processes import ShardProcesses
from .remote import Raw, RemoteShard
from .sources import Counting, FileSource, HttpSource, ObjectFileSource, Source

log = logging.getLogger("transformer.server")


@dataclass
class Runtime:
    """Process-wide state shared by all requests."""

    settings: Settings
    pool: TransformPool | None  # the transform threads, in this process (None: in worker processes)
    processes: ShardProcesses | None  # the transform worker processes (settings.processes > 0)
    client: httpx.Client  # to AIS targets (AIS TLS settings); thread-safe; used from driver threads only
    origin_client: httpx.Client  # to /download origins (Settings.origin_tls)
    metrics: Metrics


@dataclass
class ShardRequest:
    """What to transform and where the result goes (``hop`` None: back to the caller)."""

    shard: str
    object_name: str
    comm: str
    options: TransformOptions
    hop: NextHop | None = None


class ShardJob:
    """Transforms one shard in a driver thread; everything it produces goes to ``output``."""

    def __init__(self, runtime: Runtime, request: ShardRequest, source: Source, output: Output):
        self.runtime, self.request, self.source, self.output = runtime, request, source, output
        self.report = ShardReport(request.shard, request.object_name, request.options.on_error)
        self.bytes_in = 0

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"shard {self.request.shard}", daemon=True).start()

    def _run(self) -> None:
        metrics, hop, output = self.runtime.metrics, self.request.hop, self.output
        metrics.inflight.inc()
        outcome = "error"
        try:
            if hop is None:
                # Closed here, before ``fail`` or ``end`` closes the socket's sender: no transform
                # thread writes once the job is over.
                with contextlib.closing(self._transformed(relay=output.may_go_direct)) as chunks:
                    for chunk in chunks:
                        output.write(chunk)
                output.end()
                delivered = "caller"
            elif isinstance(hop, DirectPutTarget):
                output.answer(self._direct_put(hop))
                delivered = "target"
            else:
                self._to_stage(hop)
                delivered = "stage"
            outcome = "ok"
            metrics.delivered.labels(delivered).inc()
        except Cancelled as exc:
            outcome = "cancelled"
            log.info("shard %s: caller went away; work stopped", self.request.shard)
            output.fail(exc)  # ends the response coroutine too, whether or not the response had started
        except TransformerError as exc:
            log.warning("%s", exc.message)
            output.fail(exc)
        except Exception as exc:  # a bug: report it as a 500 with the reason, keep serving
            log.exception("shard %s: unexpected error", self.request.shard)
            output.fail(InternalError(f"shard '{self.request.shard}': internal error: {exc!r}"))
        finally:
            output.close()
            if self.report.first_byte is not None and not isinstance(hop, DirectPutTarget):
                metrics.send_path.labels(output.send_path).inc()
            metrics.record(self.report, self.request.comm, outcome, self.bytes_in)
            metrics.inflight.dec()  # last: no shard in flight means every finished one is counted

    def _transformed(self, relay: bool = False) -> Iterator[bytes | memoryview]:
        """The transformed shard, opening the source again on every call (a retried direct put).

        ``relay``: the output may go to the connection without this thread: the transform threads write
        what they can themselves (``_write_now``), or the worker process leading the shard is offered the
        connection after the first chunk (``Output.delegate``); the rest is yielded.
        """
        request, settings = self.request, self.runtime.settings
        self.report = ShardReport(request.shard, request.object_name, request.options.on_error)
        source = self.source
        piped = self.runtime.processes is not None and isinstance(source, BodySource)  # the body in its pipe
        fetched = self.runtime.processes is not None and type(source) is HttpSource  # the worker fetches it
        checked = self.runtime.processes is not None and isinstance(source, ObjectFileSource)  # the worker checks
        if piped or fetched:
            opened: contextlib.AbstractContextManager = contextlib.nullcontext(None)
        elif checked:
            opened = FileSource.open(source)  # the file as it is: its size check is the worker's
        else:
            opened = source.open()
        with opened as stream:
            counted: Counting | RemoteShard
            if self.runtime.processes is not None:
                counted = self.runtime.processes.transform(
                    stream, request.options, shard=request.shard, object_name=request.object_name,
                    window=settings.window, limit=settings.max_shard_bytes, report=self.report,
                    cancel=self.output.cancel, deadline=self.output.deadline, offer=relay,
                    body=isinstance(source, BodySource),
                    input_fd=source.take_read_end() if piped else None,  # type: ignore[union-attr]
                    input_error=(lambda: source.error) if piped else None,  # type: ignore[union-attr]
                    fetch=source.url if fetched else "",  # type: ignore[union-attr]
                    origin=fetched and source.client is self.runtime.origin_client,  # type: ignore[union-attr]
                    check=source.object_url if checked else "",  # type: ignore[union-attr]
                    path=source.path if checked else "")  # type: ignore[union-attr]
                if relay:
                    self.output.delegate = counted.offer
                chunks = self._frames(counted)
            else:
                counted = Counting(stream, request.shard, settings.max_shard_bytes)
                assert self.runtime.pool is not None
                chunks = transform_shard(
                    counted, request.options, self.runtime.pool, shard=request.shard,
                    object_name=request.object_name, window=settings.window, report=self.report,
                    cancel=self.output.cancel, deadline=self.output.deadline,
                    writer=self._write_now if relay else None,
                )
            try:
                with contextlib.closing(chunks):
                    for chunk in chunks:
                        if self.report.first_byte is None:
                            self.report.first_byte = time.monotonic()
                        self.report.bytes_out += len(chunk)
                        yield chunk
            finally:
                if isinstance(counted, RemoteShard):
                    self.bytes_in += counted.bytes_in
                    self.report.bytes_out += counted.direct_bytes
                    if counted.send_path != "loop":
                        self.output.send_path = counted.send_path
                else:
                    self.bytes_in += counted.count

    def _frames(self, remote: RemoteShard) -> Iterator[bytes]:
        """A worker-led shard's chunks; the rest of a frame it began is written to the connection as it is."""
        for frame in remote:
            if isinstance(frame, Raw):
                self.output.write_raw(frame.data)
            else:
                yield frame

    def _write_now(self, chunk: bytes | memoryview) -> Write:
        """A transform thread's chunk, written to the socket if it takes it without waiting."""
        done = self.output.try_write(chunk)
        if done is not Write.REFUSED:
            self.report.bytes_out += len(chunk)
        return done

    def _direct_put(self, hop: DirectPutTarget) -> Final:
        try:
            response = put_stream(self.runtime.client, hop.url, self._transformed, headers={},
                                  deadline=self.output.deadline, replayable=self.source.replayable)
        except UpstreamError as exc:
            if not self.source.replayable and exc.status >= 500 and exc.status != 504 and exc.transient:
                # The target re-sends a replayable body when asked this way (ext/etl/communicator.go).
                return Final(503, exc.message.encode(), {HEADER_RETRY_REASON: RETRY_REASON_TRANSIENT})
            raise
        with contextlib.closing(response):  # httpx.Response is no context manager
            response.read()
        if response.status_code == 200:
            return Final(204, b"", {HEADER_DIRECT_PUT_LENGTH: str(self.report.bytes_out)})
        # Propagate the destination's refusal (never a 204): AIS records it as the object's error.
        return Final(response.status_code, response.content or f"direct put failed: {response.status_code}".encode())

    def _to_stage(self, hop: EtlStage) -> None:
        headers = {HEADER_NODE_URL: hop.remaining} if hop.remaining else {}
        # Full duplex: a streaming stage answers while it still reads (see duplex.py); stage URLs carry no secret.
        response = duplex_put(hop.url, self._transformed(), headers, self.output.deadline,
                              shown_url=hop.url.split("?")[0])
        with contextlib.closing(response):
            if response.status_code == 200:
                for chunk in response.iter_bytes():
                    self.output.write(chunk)
                self.output.end()
            elif response.status_code == 204:
                length = response.headers.get(HEADER_DIRECT_PUT_LENGTH)
                self.output.answer(Final(204, b"", {HEADER_DIRECT_PUT_LENGTH: length} if length else None))
            else:
                self.output.answer(Final(response.status_code, response.read()))
