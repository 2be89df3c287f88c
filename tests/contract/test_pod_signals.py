"""Signals to the pod's processes mid-shard, one reader per comm type in flight: every reply is the seeded reference
bytes or a failed one, never a whole shard that differs; and no process of the pod outlives its server.

* a worker SIGKILLed (as the OOM killer does) or SIGSTOPped (killed at ETL_WORKER_TIMEOUT): the shards it led fail
  by name, the samples it held for others run again in their leaders;
* the server SIGKILLed, in both designs: every shard in flight is cut (a worker that led one, holding the caller's
  connection, exits at once rather than finish it as an orphan), and within 15 s no process of the pod is left, a
  stopped worker included;
* SIGTERM (Kubernetes deleting the pod, ``ais etl stop``), in both designs: a drain, not a failure: the shards in
  flight complete whole and right.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from testbed.fake_ais import AisDisk, FakeTarget
from testbed.service import Service, start_transformer
from testbed.shardgen import imagenet_like_members, make_tar

from .conftest import transformer_env
from .replies import COMMS, FAILED, RIGHT, Shard, in_flight

SEEDED = '{"preset": "imagenet-train", "seed": 9, "epoch": 3, "on_error": "skip"}'
DESIGNS = {"threads": "0", "processes": "2"}
GONE_SECONDS = 15.0


@pytest.fixture(scope="module")
def shards(disk: AisDisk) -> dict[str, Shard]:
    """A shard per comm type, long enough to be mid-stream when the signal comes."""
    return {comm: Shard.put(disk, f"signal-{i}.tar", make_tar(imagenet_like_members(60 + 10 * i)), SEEDED)
            for i, comm in enumerate(COMMS)}


def _pod(service: Service) -> list[psutil.Process]:
    """The server and every process it started (the fork server and the workers it forked)."""
    server = psutil.Process(service.process.pid)
    return [server, *server.children(recursive=True)]


def _workers(service: Service) -> list[psutil.Process]:
    """The transform worker processes: the fork server's children."""
    return [worker for child in psutil.Process(service.process.pid).children()
            if "forkserver" in " ".join(child.cmdline()) for worker in child.children()]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _verdicts(threads, replies, shards: dict[str, Shard]) -> dict[str, str]:
    for thread in threads:
        thread.join(90)
        assert not thread.is_alive(), f"{thread.name} got no end within 90 s"
    return {comm: replies[comm].verdict(shards[comm].reference) for comm in shards}


def _start(name: str, target: FakeTarget, disk: AisDisk, logs: Path, design: str, **env: str) -> Service:
    return start_transformer(f"{name}-{design}", logs, transformer_env(target, disk, ETL_PROCESSES=DESIGNS[design],
                                                                       **env))


@pytest.mark.parametrize("design", list(DESIGNS))
def test_the_server_killed_mid_shard_cuts_every_reply_and_leaves_no_process(
        design: str, target: FakeTarget, disk: AisDisk, logs: Path, shards: dict[str, Shard]) -> None:
    service = _start("transformer-server-kill", target, disk, logs, design)
    try:
        pod = _pod(service)  # with worker processes: the fork server, the workers, multiprocessing's resource tracker
        assert (len(pod) > 3) == (design == "processes"), [p.cmdline()[:3] for p in pod]
        threads, replies = in_flight(service, shards)
        stopped = _workers(service)[:1]
        for worker in stopped:
            worker.suspend()  # a stopped worker reads nothing from its server: the kernel must end it
        os.kill(service.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        verdicts = _verdicts(threads, replies, shards)
        assert set(verdicts.values()) <= {RIGHT, FAILED}, verdicts
        assert verdicts == dict.fromkeys(shards, FAILED), verdicts  # a shard whose server is gone is never completed
        while _alive(pod) and time.monotonic() - killed < GONE_SECONDS:
            time.sleep(0.2)
        left = _alive(pod)
        assert not left, f"left {GONE_SECONDS:.0f} s after the server died: {[(p.pid, p.cmdline()[:4]) for p in left]}"
    finally:
        service.stop()


@pytest.mark.parametrize("design", list(DESIGNS))
def test_sigterm_drains_the_shards_in_flight_whole_and_right(design: str, target: FakeTarget, disk: AisDisk,
                                                             logs: Path, shards: dict[str, Shard]) -> None:
    service = _start("transformer-sigterm", target, disk, logs, design)
    try:
        pod = _pod(service)
        threads, replies = in_flight(service, shards)
        service.process.send_signal(signal.SIGTERM)
        verdicts = _verdicts(threads, replies, shards)
        assert verdicts == dict.fromkeys(shards, RIGHT), (verdicts, {c: r.error for c, r in replies.items()})
        # uvicorn, its drain done, ends by the signal it caught (so a supervisor sees why); never by a crash
        assert service.process.wait(30) in (0, -signal.SIGTERM), service.log_tail()
        deadline = time.monotonic() + GONE_SECONDS
        while _alive(pod) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pod)
    finally:
        service.stop()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_stopped_mid_shard_never_gives_a_whole_shard_that_differs(
        how: str, target: FakeTarget, disk: AisDisk, logs: Path, shards: dict[str, Shard]) -> None:
    service = _start(f"transformer-worker-{how.lower()}", target, disk, logs, "processes", ETL_WORKER_TIMEOUT="3s")
    try:
        threads, replies = in_flight(service, shards)
        victim = _workers(service)[0]
        victim.send_signal(getattr(signal, how))
        verdicts = _verdicts(threads, replies, shards)
        assert set(verdicts.values()) <= {RIGHT, FAILED}, verdicts
        for comm, verdict in verdicts.items():
            if verdict == FAILED and comm != "ws fqn":
                assert replies[comm].error, (comm, replies[comm].status)  # cut: the response had begun
        deadline = time.monotonic() + 15  # a stopped worker is killed 3 s after its last heartbeat
        while f"(pid {victim.pid})" not in (log := service.log_tail(100_000)) or "; starting a new one" not in log:
            assert time.monotonic() < deadline, log[-3000:]
            time.sleep(0.2)
        assert "sample skipped" not in log
    finally:
        service.stop()
