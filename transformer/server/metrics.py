"""Prometheus metrics of the pod (AIS exports only target-side ETL counters)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from ..engine import ShardReport
from ..samples import decode_paths

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """One registry per app, so several apps (tests) never clash in the global registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.shards = Counter("etl_shards", "Shard requests finished", ["comm", "outcome"], registry=r)
        self.samples = Counter("etl_samples", "Samples by outcome", ["outcome"], registry=r)
        self.bytes_in = Counter("etl_bytes_in", "Shard bytes read", registry=r)
        self.bytes_out = Counter("etl_bytes_out", "Transformed bytes produced", registry=r)
        self.shard_seconds = Histogram("etl_shard_seconds", "Time per shard request", buckets=_SECONDS, registry=r)
        self.first_byte = Histogram("etl_first_byte_seconds", "Time to the first output byte", buckets=_SECONDS,
                                    registry=r)
        self.send_path = Counter("etl_send_path", "Streamed responses by who wrote the body: 'direct' (the "
                                 "shard's thread), 'loop' (the event loop), 'direct_then_loop' "
                                 "(a caller that read only after sending)", ["path"], registry=r)
        self.delivered = Counter("etl_delivered", "Shards transformed whole, by where the output went: 'caller' "
                                 "(the reply), 'target' (a direct put to the destination target), 'stage' (the next "
                                 "ETL of a pipeline)", ["to"], registry=r)
        self.inflight = Gauge("etl_inflight_shards", "Shard requests being transformed", registry=r)
        self.worker_restarts = Counter("etl_worker_restarts", "Transform worker processes that died and were "
                                       "replaced (each failed the shards it held)", registry=r)
        self._decode_paths = _DecodePaths()
        r.register(self._decode_paths)

    def add_spread(self, count: Callable[[], int]) -> None:
        """``etl_spread_samples_total``: samples a worker process transformed for a shard another one leads."""
        self.registry.register(_Spread(count))

    def add_decode_paths(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        """Count the images decoded elsewhere (the transform worker processes) in ``etl_decode_path`` too."""
        self._decode_paths.sources.append(counts)

    def record(self, report: ShardReport, comm: str, outcome: str, bytes_in: int) -> None:
        self.shards.labels(comm, outcome).inc()
        failed = len(report.errors)
        skipped = sum(1 for e in report.errors if e["action"] == "skipped")
        self.samples.labels("ok").inc(max(0, report.samples_out - (failed - skipped)))
        self.samples.labels("skipped").inc(skipped)
        self.samples.labels("passed_through").inc(failed - skipped)
        if outcome == "error":
            self.samples.labels("failed").inc(max(0, report.samples_in - report.samples_out))
        self.bytes_in.inc(bytes_in)
        self.bytes_out.inc(report.bytes_out)
        import time

        now = time.monotonic()
        self.shard_seconds.observe(now - report.started)
        if report.first_byte is not None:
            self.first_byte.observe(report.first_byte - report.started)


class _Spread:
    """The worker processes' samples transformed for a shard another worker leads (read at scrape)."""

    def __init__(self, count: Callable[[], int]):
        self.count = count

    def collect(self):
        family = CounterMetricFamily("etl_spread_samples", "Samples a transform worker process ran for a shard "
                                     "another worker process leads (ETL_PROCESSES: one shard on every core)")
        family.add_metric([], self.count())
        yield family


class _DecodePaths:
    """``etl_decode_path_total{path,reason}``: images by how they were decoded (read from ``samples`` at scrape).

    ``window`` (only the crop's region, full scale), ``scaled`` (DCT-scaled whole image, only with
    ``dct_scaling``), ``full`` (the whole image, as without ETL_CROP_DECODE) with why: ``disabled``,
    ``transforms`` (no leading crop or resize), ``several_images``, ``not_jpeg``, ``colorspace``,
    ``mask_size``, ``pads``, ``no_gain``, ``progressive``, ``no_region_decoder``, ``decoder`` (the partial
    decoder refused the file). Counted per process, summed over the worker processes.
    """

    def __init__(self) -> None:
        self.sources: list[Callable[[], dict[tuple[str, str], int]]] = [decode_paths]

    def collect(self):
        family = CounterMetricFamily("etl_decode_path", "Images decoded, by path (window, scaled, full) and why "
                                     "full", labels=["path", "reason"])
        totals: dict[tuple[str, str], int] = {}
        for source in self.sources:
            for key, count in source().items():
                totals[key] = totals.get(key, 0) + count
        for (path, reason), count in sorted(totals.items()):
            family.add_metric([path, reason], count)
        yield family
