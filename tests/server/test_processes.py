"""Transform worker processes (server/processes.py, worker.py, spread.py): the same bytes as the threads with
one shard's samples spread over every worker, errors that cross the process boundary with their fields, a
worker that dies failing the shards it led by name (the samples it ran for others run again in their
leaders), a stopped or hung worker killed and replaced within its bound and given nothing meanwhile, and
workers the OOM killer takes before the server."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from testbed.shardgen import imagenet_like_members, make_tar
from testbed.stuck import HANG_HOLDING_GIL, HANG_RELEASING_GIL, hanging_worker
from transformer.config import Settings, processes_for
from transformer.engine import ShardReport, transform_shard
from transformer.errors import ConfigError, InternalError, SampleTransformError, ShardError, UpstreamError
from transformer.options import parse_etl_args
from transformer.pool import TransformPool
from transformer.server.board import SUSPECT_SECONDS
from transformer.server.processes import ShardProcesses, WorkerConfig
from transformer.server.remote import RemoteShard

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
            report: ShardReport | None = None, cancel: threading.Event | None = None, window: int = 6) -> RemoteShard:
    options = parse_etl_args(etl_args, _settings())
    return processes.transform(stream, options, shard=shard, object_name=shard, window=window, limit=1 << 34,
                               report=report or ShardReport(shard, shard, options.on_error),
                               cancel=cancel or threading.Event(), deadline=time.monotonic() + 120)


def _in_process(data: bytes, threads: int, etl_args: str = SEEDED) -> bytes:
    """The threads design's output, for shard and object 'b/shard.tar' (``_remote``'s default: seeds draw by name)."""
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


@pytest.mark.parametrize("policy", ["skip", "passthrough"])
def test_every_error_policy_gives_the_threads_bytes_with_bad_samples_in_both_workers(processes: ShardProcesses,
                                                                                    policy: str) -> None:
    members = imagenet_like_members(30, extra=False)
    for index in range(0, 30, 3):  # every third sample's image cannot be decoded, wherever it runs
        members[2 * index] = (members[2 * index][0], b"not a jpeg")
    data = make_tar(members)
    args = f'{{"preset": "imagenet-train", "seed": 5, "on_error": "{policy}"}}'
    report = ShardReport("b/shard.tar", "b/shard.tar", policy)
    assert b"".join(_remote(processes, io.BytesIO(data), args, report=report)) == _in_process(data, 2, args)
    assert [error["key"] for error in report.errors] == [f"sample-{i:06d}" for i in range(0, 30, 3)]


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


def test_one_shards_samples_run_in_every_worker_with_the_same_bytes(processes: ShardProcesses) -> None:
    data = make_tar(imagenet_like_members(40))
    expected = _in_process(data, threads=2)
    before = processes.spread()
    assert b"".join(_remote(processes, io.BytesIO(data))) == expected
    deadline = time.monotonic() + 10  # the workers report every 2 s
    while processes.spread() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes.spread() > before  # the worker that did not lead it transformed some of its samples


def test_a_shard_closed_midway_frees_its_worker(processes: ShardProcesses) -> None:
    data = make_tar(imagenet_like_members(20))
    remote = _remote(processes, io.BytesIO(data))
    chunks = iter(remote)
    next(chunks)
    chunks.close()  # the caller went away
    assert _leading(processes) == 0
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
    _wait_for_workers(processes, 2, gone=remote.pid)
    after = processes.pids()
    assert len(after) == 2 and remote.pid not in after and set(before) - {remote.pid} <= set(after)
    assert processes.restarts == restarts + 1
    output = b"".join(_remote(processes, io.BytesIO(make_tar(imagenet_like_members(2)))))
    assert output.endswith(b"\0" * 1024)


def test_the_samples_of_a_killed_helper_run_again_in_their_leader(processes: ShardProcesses) -> None:
    data = make_tar(imagenet_like_members(120))
    expected = _in_process(data, threads=2)
    restarts = processes.restarts
    remote = _remote(processes, io.BytesIO(data))
    chunks = iter(remote)
    output = bytearray(next(chunks))
    helper = next(pid for pid in processes.pids() if pid != remote.pid)
    os.kill(helper, signal.SIGKILL)  # it holds some of the shard's samples right now
    for chunk in chunks:
        output += chunk
    assert bytes(output) == expected  # whole, and the same bytes
    _wait_for_workers(processes, 2, gone=helper)
    assert processes.restarts == restarts + 1


def test_a_killed_fork_server_is_started_again_for_the_next_worker(processes: ShardProcesses) -> None:
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None
    os.kill(server, signal.SIGKILL)
    victim = processes.pids()[0]
    os.kill(victim, signal.SIGKILL)  # its replacement needs a fork server
    _wait_for_workers(processes, 2, gone=victim)
    assert multiprocessing.forkserver._forkserver._forkserver_pid not in (None, server)
    data = make_tar(imagenet_like_members(6))
    assert b"".join(_remote(processes, io.BytesIO(data))) == _in_process(data, threads=2)


def test_the_defaults_spread_threads_over_processes_from_5_workers() -> None:
    assert [processes_for(n) for n in (1, 2, 4, 5, 6, 7, 16, 64)] == [0, 0, 0, 2, 2, 3, 6, 22]
    two = _settings()
    assert (two.processes, two.window, two.max_inflight) == (0, 6, 48)
    sixteen = _settings(ETL_WORKERS="16")  # a shard's samples run on all 16 threads: its window is theirs
    assert (sixteen.processes, sixteen.window, sixteen.max_inflight) == (6, 34, 8 * 34 * 6)
    assert _settings(ETL_WORKERS="16", ETL_PROCESSES="0").window == 34
    with pytest.raises(ConfigError, match="ETL_PROCESSES"):
        _settings(ETL_PROCESSES="3")


def test_workers_are_the_oom_killers_first_choice(processes: ShardProcesses) -> None:
    server = _oom_score_adj(os.getpid())
    for pid in processes.pids():
        assert _oom_score_adj(pid) == min(1000, server + 500)


# --- a stuck worker: stopped, or hung in native code -------------------------------------------------------

STALL = 3.0  # ETL_WORKER_TIMEOUT of the processes below


@pytest.fixture(scope="module")
def hanging() -> Iterator[ShardProcesses]:
    """Two workers that hang on marked images (testbed.stuck), killed when silent for STALL seconds."""
    workers = ShardProcesses(2, WorkerConfig(threads=1, max_inflight=16, log_level="warning", ais_target_url="",
                                             stall=STALL), target=hanging_worker)
    workers.wait_ready(120)
    yield workers
    workers.shutdown()


def test_a_stopped_worker_gets_nothing_new_and_is_replaced_within_its_bound(hanging: ShardProcesses) -> None:
    restarts = hanging.restarts
    stopped = _remote(hanging, io.BytesIO(make_tar(imagenet_like_members(200))), shard="b/stopped.tar")
    chunks = iter(stopped)
    next(chunks)
    os.kill(stopped.pid, signal.SIGSTOP)
    started = time.monotonic()
    time.sleep(SUSPECT_SECONDS + 0.5)
    # Meanwhile every new shard goes to the other worker, and none of its samples to the stopped one.
    data = make_tar(imagenet_like_members(12))
    expected = _in_process(data, threads=2)
    for _ in range(3):
        remote = _remote(hanging, io.BytesIO(data))
        assert remote.pid != stopped.pid
        assert b"".join(remote) == expected
    with pytest.raises(InternalError) as caught:
        for _ in chunks:
            pass
    found = time.monotonic() - started
    assert "shard 'b/stopped.tar'" in caught.value.message and "stopped answering" in caught.value.message
    assert found < STALL + 3.0, found
    _wait_for_workers(hanging, 2, gone=stopped.pid)
    assert hanging.restarts == restarts + 1


@pytest.mark.parametrize("marker", [HANG_HOLDING_GIL, HANG_RELEASING_GIL], ids=["holding-the-gil", "releasing-it"])
def test_a_hang_in_native_code_fails_its_shard_by_name_and_the_worker_is_replaced(hanging: ShardProcesses,
                                                                                  marker: bytes) -> None:
    restarts = hanging.restarts
    members = imagenet_like_members(3, extra=False)
    members[0] = (members[0][0], members[0][1] + marker)  # the first sample: run by the shard's leader
    started = time.monotonic()
    with pytest.raises(InternalError) as caught:
        b"".join(_remote(hanging, io.BytesIO(make_tar(members)), shard="b/hangs.tar", window=1))
    assert "shard 'b/hangs.tar'" in caught.value.message and "stopped answering" in caught.value.message
    assert time.monotonic() - started < 2 * STALL + 3.0
    deadline = time.monotonic() + 60
    while hanging.restarts == restarts or len(hanging.pids()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    data = make_tar(imagenet_like_members(4))
    assert b"".join(_remote(hanging, io.BytesIO(data))) == _in_process(data, threads=2)


def _oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def _wait_for_workers(processes: ShardProcesses, count: int, gone: int | None = None) -> None:
    deadline = time.monotonic() + 60
    while len(processes.pids()) < count or gone in processes.pids():
        assert time.monotonic() < deadline, processes.pids()
        time.sleep(0.1)


def _leading(processes: ShardProcesses) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leading = sum(processes.leading().values())
        if leading == 0:
            return 0
        time.sleep(0.05)
    return leading
