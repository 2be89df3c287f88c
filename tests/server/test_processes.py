"""Transform worker processes (server/processes.py): the same bytes as the threads, errors that cross the
process boundary with their fields, and a worker that dies failing its shard by name, then replaced."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from testbed.shardgen import imagenet_like_members, make_tar
from transformer.config import Settings, processes_for
from transformer.engine import ShardReport, transform_shard
from transformer.errors import ConfigError, InternalError, SampleTransformError, ShardError, UpstreamError
from transformer.options import parse_etl_args
from transformer.pool import TransformPool
from transformer.server.processes import RemoteShard, ShardProcesses, WorkerConfig

SEEDED = '{"preset": "imagenet-train", "seed": 11, "epoch": 2}'


@pytest.fixture(scope="module")
def processes() -> Iterator[ShardProcesses]:
    workers = ShardProcesses(2, WorkerConfig(threads=1, max_inflight=16, log_level="warning", ais_target_url=""))
    workers.wait_ready(120)
    yield workers
    workers.shutdown()


def _settings(**env: str) -> Settings:
    return Settings.from_env({"ETL_WORKERS": "2", **env})


def _remote(processes: ShardProcesses, stream, etl_args: str = SEEDED, shard: str = "b/shard.tar",
            report: ShardReport | None = None, cancel: threading.Event | None = None) -> RemoteShard:
    options = parse_etl_args(etl_args, _settings())
    return processes.transform(stream, options, shard=shard, object_name=shard, window=4, limit=1 << 34,
                               report=report or ShardReport(shard, shard, options.on_error),
                               cancel=cancel or threading.Event(), deadline=time.monotonic() + 120)


def _in_process(data: bytes, threads: int, etl_args: str = SEEDED) -> bytes:
    pool = TransformPool(threads, 16)
    try:
        options = parse_etl_args(etl_args, _settings())
        return b"".join(transform_shard(io.BytesIO(data), options, pool, shard="b/shard.tar",
                                        object_name="b/shard.tar", window=2 * threads + 2))
    finally:
        pool.shutdown()


def test_seeded_output_is_the_threads_output_byte_for_byte(processes: ShardProcesses, tmp_path) -> None:
    data = make_tar(imagenet_like_members(12))
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    expected = _in_process(data, threads=1)
    assert _in_process(data, threads=3) == expected
    report = ShardReport("b/shard.tar", "b/shard.tar", "skip")
    with open(path, "rb") as file:  # handed over as the file itself
        remote = _remote(processes, file, report=report)
        assert b"".join(remote) == expected
    assert (report.samples_in, report.samples_out, report.images, remote.bytes_in) == (12, 12, 12, len(data))
    assert b"".join(_remote(processes, io.BytesIO(data))) == expected  # piped by a feeder thread


def test_a_sample_error_crosses_with_its_shard_key_and_member(processes: ShardProcesses) -> None:
    members = imagenet_like_members(3, extra=False)
    members[2] = ("sample-000001.jpg", b"not a jpeg")
    with pytest.raises(SampleTransformError) as caught:
        b"".join(_remote(processes, io.BytesIO(make_tar(members)), '{"on_error": "fail"}'))
    error = caught.value
    assert (error.shard, error.key, error.member, error.status) == ("b/shard.tar", "sample-000001",
                                                                    "sample-000001.jpg", 422)
    report = ShardReport("b/shard.tar", "b/shard.tar", "skip")
    output = b"".join(_remote(processes, io.BytesIO(make_tar(members)), '{"on_error": "skip"}', report=report))
    assert b"__etl__/errors.json" in output and report.errors[0]["key"] == "sample-000001"


def test_a_cut_tar_is_a_shard_error_and_a_failing_input_raises_its_own(processes: ShardProcesses) -> None:
    data = make_tar(imagenet_like_members(4))
    with pytest.raises(ShardError, match="b/shard.tar"):
        b"".join(_remote(processes, io.BytesIO(data[: len(data) // 2])))

    class Refused(io.RawIOBase):
        """The first half of the shard, then the upstream fails (an hpull fetch cut by the target)."""

        def __init__(self) -> None:
            self.sent = False

        def read(self, size: int = -1) -> bytes:
            if self.sent:
                raise UpstreamError("GET target/b/shard.tar: connection reset", 502)
            self.sent = True
            return data[: len(data) // 2]

    with pytest.raises(UpstreamError, match="connection reset"):
        b"".join(_remote(processes, Refused()))


def test_a_shard_closed_midway_frees_its_worker(processes: ShardProcesses) -> None:
    data = make_tar(imagenet_like_members(20))
    remote = _remote(processes, io.BytesIO(data))
    chunks = iter(remote)
    next(chunks)
    chunks.close()  # the caller went away
    assert _jobs(processes) == 0
    assert b"".join(_remote(processes, io.BytesIO(make_tar(imagenet_like_members(2))))).endswith(b"\0" * 1024)


def test_a_killed_worker_fails_its_shard_by_name_and_a_new_one_serves(processes: ShardProcesses) -> None:
    before = processes.pids()
    restarts = processes.restarts
    remote = _remote(processes, io.BytesIO(make_tar(imagenet_like_members(100))), shard="b/killed.tar")
    chunks = iter(remote)
    next(chunks)
    os.kill(remote.pid, signal.SIGKILL)
    with pytest.raises(InternalError) as caught:
        for _ in chunks:
            pass
    assert "shard 'b/killed.tar'" in caught.value.message and "SIGKILL" in caught.value.message
    deadline = time.monotonic() + 60
    while (len(processes.pids()) < 2 or remote.pid in processes.pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = processes.pids()
    assert len(after) == 2 and remote.pid not in after and set(before) - {remote.pid} <= set(after)
    assert processes.restarts == restarts + 1
    output = b"".join(_remote(processes, io.BytesIO(make_tar(imagenet_like_members(2)))))
    assert output.endswith(b"\0" * 1024)


def test_the_defaults_spread_threads_over_processes_from_5_workers() -> None:
    assert [processes_for(n) for n in (1, 2, 4, 5, 6, 7, 16, 64)] == [0, 0, 0, 2, 2, 3, 6, 22]
    two = _settings()
    assert (two.processes, two.window, two.max_inflight) == (0, 6, 48)
    sixteen = _settings(ETL_WORKERS="16")
    assert (sixteen.processes, sixteen.window, sixteen.max_inflight) == (6, 8, 8 * 8 * 6)
    assert _settings(ETL_WORKERS="16", ETL_PROCESSES="0").window == 34
    with pytest.raises(ConfigError, match="ETL_PROCESSES"):
        _settings(ETL_PROCESSES="3")


def _jobs(processes: ShardProcesses) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with processes._cond:
            jobs = sum(w.jobs for w in processes._workers if w is not None)
        if jobs == 0:
            return 0
        time.sleep(0.05)
    return jobs
