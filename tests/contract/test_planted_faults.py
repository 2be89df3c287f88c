"""A fault of the pod's own code on good samples fails the shard by name under every ``on_error``: never a skipped
or passed-through sample in a whole-looking reply. In both designs (the threads of one process; worker processes),
on every comm type; the fault is planted in every process of the pod (``testbed/faults.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.fake_ais import AisDisk, FakeTarget
from testbed.faults import planted
from testbed.service import Service, start_transformer
from testbed.shardgen import imagenet_like_members, make_tar

from .conftest import transformer_env
from .replies import COMMS, FAILED, RIGHT, Shard, read

SEEDED = '{"preset": "imagenet-train", "seed": 5, "epoch": 2}'
POLICIES = ("skip", "passthrough", "fail")
DESIGNS = {"threads": "0", "processes": "2"}


@pytest.fixture(scope="module")
def shard(disk: AisDisk) -> Shard:
    # 16 images: read one after another, each process meets its every-7th array within any shard it works on.
    return Shard.put(disk, "planted.tar", make_tar(imagenet_like_members(16)), SEEDED)


def _policy(on_error: str) -> str:
    return SEEDED[:-1] + f', "on_error": "{on_error}"}}'


@pytest.fixture(scope="module", params=list(DESIGNS))
def descr_fault(request: pytest.FixtureRequest, target: FakeTarget, disk: AisDisk, logs: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = transformer_env(target, disk, ETL_PROCESSES=DESIGNS[request.param],
                          **planted(tmp_path_factory.mktemp("fault"), "npy-descr", 7))
    server = start_transformer(f"transformer-npy-fault-{request.param}", logs, env)
    yield server
    server.stop()


def test_a_fault_on_our_output_path_fails_every_shard_under_every_policy(descr_fault: Service, shard: Shard) -> None:
    verdicts = {(policy, comm): read(descr_fault, comm, shard, _policy(policy))
                for policy in POLICIES for comm in COMMS}
    assert {key: reply.verdict(shard.reference) for key, reply in verdicts.items()} == dict.fromkeys(verdicts, FAILED)
    log = descr_fault.log_tail(200_000)
    assert "planted fault 'npy-descr'" in log and "was not transformed" in log and "the shard was not completed" in log
    assert "sample skipped" not in log and "sample passed-through" not in log, log[-3000:]
    # Each reply is cut (the response had begun) or is the error, naming the shard and the sample.
    for (_, comm), reply in verdicts.items():
        tail = reply.body[-1000:]
        named = b"planted.tar'" in tail and b"was not transformed" in tail and b"the shard was not completed" in tail
        assert (reply.error and comm != "ws fqn") or (reply.status in (200, 500) and named), (comm, reply.status,
                                                                                               reply.error, tail)


@pytest.fixture(scope="module")
def lease_fault(target: FakeTarget, disk: AisDisk, logs: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = transformer_env(target, disk, **planted(tmp_path_factory.mktemp("fault"), "arena-lease", 5))
    server = start_transformer("transformer-lease-fault", logs, env)
    yield server
    server.stop()


def test_a_shared_memory_fault_between_workers_is_never_a_whole_shard_that_differs(lease_fault: Service,
                                                                                    shard: Shard) -> None:
    """The leader unable to map a result fails the shard; a worker unable to map a sample it was sent drops the
    link, and the leader runs the sample itself: either way the reply is the reference or failed."""
    replies = [read(lease_fault, comm, shard, _policy(policy)) for policy in POLICIES for comm in COMMS]
    verdicts = [reply.verdict(shard.reference) for reply in replies]
    assert set(verdicts) <= {RIGHT, FAILED}, verdicts
    assert FAILED in verdicts, "the planted fault never failed a shard: nothing was checked"
    assert "planted fault 'arena-lease'" in lease_fault.log_tail(200_000)
