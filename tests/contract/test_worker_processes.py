"""The pod with transform worker processes (ETL_PROCESSES, the contract suite's setting): the same seeded
bytes as the threads, by every comm type; a worker killed mid-shard (SIGKILL, as the OOM killer does) cuts
that shard's reply with an error naming it, never a shorter whole-looking shard; the shard beside it, led
by the other worker, completes; a new worker serves on; a ws connection stays usable."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from testbed.fake_ais import AisDisk, FakeTarget
from testbed.service import Service, start_transformer
from testbed.shardgen import imagenet_like_members, make_tar
from transformer.config import Settings
from transformer.engine import transform_shard
from transformer.errors import ShardError
from transformer.integrity import ShardCheck
from transformer.options import parse_etl_args
from transformer.pool import TransformPool
from transformer.server.board import SUSPECT_SECONDS
from transformer.shards import read_samples

from .conftest import transformer_env
from .harness import escaped_uname, fqn_query
from .test_ws import REPLY_TIMEOUT, control, request, ws_session

SEEDED = '{"preset": "imagenet-train", "seed": 21, "epoch": 1}'


def test_every_comm_type_gives_the_threads_bytes(service: Service, client: httpx.Client, disk: AisDisk) -> None:
    shard = make_tar(imagenet_like_members(6))
    fqn = disk.put("train", "same-bytes.tar", shard)
    pool = TransformPool(3, 16)  # in this process, on threads: the design the pod uses up to 4 workers
    try:
        expected = b"".join(transform_shard(io.BytesIO(shard), parse_etl_args(SEEDED, Settings.from_env({})), pool,
                                            shard="train/same-bytes.tar", object_name="same-bytes.tar", window=8))
    finally:
        pool.shutdown()
    args = {"etl_args": SEEDED}
    replies = {
        "hpush body": client.put("/train/same-bytes.tar", params=args, content=shard),
        "hpush fqn": client.put(f"/train/same-bytes.tar?{fqn_query(fqn, SEEDED)}", content=b""),
        "hpull fqn": client.get(f"/{escaped_uname('train', 'same-bytes.tar')}?{fqn_query(fqn, SEEDED)}"),
    }
    outputs = {name: reply.content for name, reply in replies.items() if reply.status_code == 200}
    assert set(outputs) == set(replies), {name: reply.text[:300] for name, reply in replies.items()}
    with ws_session(service) as ws:
        request(ws, "same-bytes.tar", fqn=fqn, etl_args=SEEDED)
        outputs["ws fqn"] = ws.recv(timeout=REPLY_TIMEOUT)
    assert {name: output == expected for name, output in outputs.items()} == dict.fromkeys(outputs, True)


def _workers(service: Service) -> list[psutil.Process]:
    """The worker processes: the children of the fork server, itself a child of the service."""
    children = psutil.Process(service.process.pid).children()
    return [worker for child in children if "forkserver" in " ".join(child.cmdline()) for worker in child.children()]


def test_a_killed_worker_cuts_its_shard_by_name_and_the_other_completes(service: Service, client: httpx.Client,
                                                                         disk: AisDisk) -> None:
    shards = {name: disk.put("train", name, make_tar(imagenet_like_members(150, extra=False)))
              for name in ("kill-a.tar", "kill-b.tar")}
    workers = _workers(service)
    assert len(workers) == 2
    outcomes: dict[str, bytes | Exception] = {}
    started = {name: threading.Event() for name in shards}

    def read(name: str) -> None:
        body = bytearray()
        try:
            with client.stream("PUT", f"/train/{name}?{fqn_query(shards[name])}", content=b"") as response:
                assert response.status_code == 200
                for chunk in response.iter_raw():
                    body += chunk
                    started[name].set()
            outcomes[name] = bytes(body)
        except (httpx.HTTPError, AssertionError) as exc:
            outcomes[name] = exc
        finally:
            started[name].set()

    readers = [threading.Thread(target=read, args=(name,)) for name in shards]
    for reader in readers:
        reader.start()
    for event in started.values():
        assert event.wait(60)
    victim = workers[0]
    victim.kill()
    for reader in readers:
        reader.join(120)
    cut = [name for name, outcome in outcomes.items() if isinstance(outcome, Exception)]
    whole = [name for name, outcome in outcomes.items() if isinstance(outcome, bytes)]
    assert len(cut) == 1 and len(whole) == 1, outcomes
    assert isinstance(outcomes[cut[0]], httpx.RemoteProtocolError)  # the chunked body ends without its last chunk
    assert _marker(whole[0], outcomes[whole[0]])["samples_out"] == 150
    log = _wait_for(service, f"shard 'train/{cut[0]}': the transform worker process (pid {victim.pid}) was "
                             "killed by SIGKILL")
    assert "starting a new one" in log

    deadline = time.monotonic() + 60
    while (len(_workers(service)) < 2 or victim.pid in [w.pid for w in _workers(service)]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    again = client.put(f"/train/kill-a.tar?{fqn_query(shards['kill-a.tar'])}", content=b"")
    assert again.status_code == 200
    assert _marker("kill-a.tar", again.content)["samples_out"] == 150
    metrics = client.get("/metrics").text
    assert "etl_worker_restarts_total 1.0" in metrics


def _marker(name: str, data: bytes) -> dict:
    check = ShardCheck(name)
    for sample in read_samples(io.BytesIO(data), name, 1 << 30):
        check.sample(sample)
    return check.finish()


def _wait_for(service: Service, text: str) -> str:
    deadline = time.monotonic() + 10
    while True:
        log = service.log_tail(20000)
        if text in log or time.monotonic() > deadline:
            assert text in log, log[-3000:]
            return log
        time.sleep(0.1)


def test_a_worker_killed_in_the_middle_of_a_ws_frame_leaves_the_connection_usable(service: Service,
                                                                                  disk: AisDisk) -> None:
    """The worker leading a ws reply writes the connection itself; killed in the middle of a frame, it leaves the
    frame cut. The server completes it (the rest of its header, then filler), ends the message with the error,
    and the next request on the same connection gets its whole reply: AIS never dials a ws connection again."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, Request

    killed = disk.put("train", "ws-killed.tar", make_tar(imagenet_like_members(150, extra=False)))
    after = disk.put("train", "ws-after.tar", make_tar(imagenet_like_members(3)))
    ws = WSConnection(ConnectionType.CLIENT)
    with socket.create_connection(("127.0.0.1", service.port), timeout=REPLY_TIMEOUT) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.sendall(ws.send(Request(host=f"127.0.0.1:{service.port}", target="/ws")))
        events = _ws_events(sock, ws)
        assert isinstance(next(events), AcceptConnection)
        sock.sendall(ws.send(BytesMessage(data=control("ws-killed.tar", fqn=killed, etl_args=SEEDED))))
        # Nothing read: the buffers fill within a 602 KB frame, and the worker waits in the middle of it.
        time.sleep(4)
        for worker in _workers(service):
            worker.kill()
        first = _ws_message(events)
        assert first.endswith(b'"object": "ws-killed.tar"}'), first[-300:]
        error = json.loads(first[first.rindex(b'{"message"'):])
        assert error["status"] == 500 and "shard 'ws-killed.tar'" in error["message"]
        assert "killed by SIGKILL" in error["message"]
        with pytest.raises(ShardError):  # a cut tar, never a shorter whole-looking one
            for _ in read_samples(io.BytesIO(first), "ws-killed.tar", 1 << 30):
                pass
        _wait_for(service, "shard ws-killed.tar: its worker died in the middle of a ws frame")
        sock.sendall(ws.send(BytesMessage(data=control("ws-after.tar", fqn=after, etl_args=SEEDED))))
        second = _ws_message(events)
    assert _marker("ws-after.tar", second)["samples_out"] == 3


def _ws_events(sock: socket.socket, ws):
    while True:
        data = sock.recv(1 << 20)
        ws.receive_data(data or None)
        yield from ws.events()
        if not data:
            return


def _ws_message(events) -> bytes:
    from wsproto.events import BytesMessage

    message = bytearray()
    for event in events:
        assert isinstance(event, BytesMessage), event
        message += event.data
        if event.message_finished:
            return bytes(message)
    raise AssertionError("the connection ended before the message")


def test_a_stopped_worker_is_replaced_within_etl_worker_timeout_and_shards_keep_coming_back_whole(
        target: FakeTarget, disk: AisDisk, logs: Path) -> None:
    """ETL_WORKER_TIMEOUT as the pod reads it: a worker stopped (SIGSTOP) is, once silent for 2 s, given nothing new,
    then killed and replaced within the bound; shards sent meanwhile and afterwards come back whole."""
    service = start_transformer("transformer-stall-3s", logs, transformer_env(target, disk, ETL_WORKER_TIMEOUT="3s"))
    try:
        client = httpx.Client(base_url=service.url, timeout=REPLY_TIMEOUT)
        fqn = disk.put("train", "after-stop.tar", make_tar(imagenet_like_members(12)))
        victim = _workers(service)[0]
        victim.suspend()
        stopped = time.monotonic()
        time.sleep(SUSPECT_SECONDS + 0.5)
        while victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE:
            response = client.put(f"/train/after-stop.tar?{fqn_query(fqn)}", content=b"")
            assert response.status_code == 200, response.text
            assert _marker("after-stop.tar", response.content)["samples_out"] == 12
            assert time.monotonic() - stopped < 3 + 5, "the stopped worker was not killed within its bound"
        log = _wait_for(service, "; starting a new one")
        assert f"(pid {victim.pid}) stopped answering for" in log
        deadline = time.monotonic() + 30
        while len(_workers(service)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        response = client.put(f"/train/after-stop.tar?{fqn_query(fqn)}", content=b"")
        assert _marker("after-stop.tar", response.content)["samples_out"] == 12
        assert "etl_worker_restarts_total 1.0" in client.get("/metrics").text
        client.close()
    finally:
        service.stop()
