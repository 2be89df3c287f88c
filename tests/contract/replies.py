"""One shard read by every comm type as a target reads it, and the one verdict that matters on the reply.

A reply is ``right`` (the seeded reference bytes), ``failed`` (an error status, a cut body, a ws error
reply or a message ending with its error: what AIS reports as a failed read, for the reader to retry the
shard whole) or ``WRONG``: a whole shard, its end marker valid, whose bytes differ from the reference.
The pod must never give the last one; the tests of the pod's own failures assert it.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field

import httpx

from testbed.fake_ais import AisDisk
from testbed.service import Service
from transformer.config import Settings
from transformer.engine import transform_shard
from transformer.errors import TransformerError
from transformer.integrity import ShardCheck
from transformer.options import parse_etl_args
from transformer.pool import TransformPool
from transformer.shards import read_samples

from .harness import escaped_uname, fqn_query
from .test_ws import REPLY_TIMEOUT, request, ws_session

COMMS = ("hpush body", "hpush fqn", "hpull fqn", "ws fqn")
RIGHT, FAILED, WRONG = "right", "failed", "WRONG"


@dataclass
class Shard:
    """A shard on the fake target's disk, with the bytes the pod must give for it under ``etl_args``."""

    name: str
    data: bytes
    fqn: str
    etl_args: str
    reference: bytes = field(repr=False)

    @classmethod
    def put(cls, disk: AisDisk, name: str, data: bytes, etl_args: str) -> Shard:
        pool = TransformPool(2, 16)
        try:
            reference = b"".join(transform_shard(io.BytesIO(data), parse_etl_args(etl_args, Settings.from_env({})),
                                                 pool, shard=f"train/{name}", object_name=name, window=8))
        finally:
            pool.shutdown()
        return cls(name, data, disk.put("train", name, data), etl_args, reference)


@dataclass
class Reply:
    comm: str
    status: int | None = None  # None: no answer (the connection failed)
    body: bytes = b""
    error: str = ""  # the transport's error, if any

    def verdict(self, reference: bytes) -> str:
        if self.status == 200 and not self.error and self.body == reference:
            return RIGHT
        return WRONG if self.body != reference and whole(self.body) else FAILED


def whole(body: bytes) -> bool:
    """Whether ``body`` is a whole shard as a reader checks it: a tar whose end marker matches what came before it."""
    check = ShardCheck("reply")
    try:
        for sample in read_samples(io.BytesIO(body), "reply", 1 << 30):
            check.sample(sample)
        check.finish()
    except TransformerError:
        return False
    return True


def read(service: Service, comm: str, shard: Shard, etl_args: str | None = None,
         started: threading.Event | None = None) -> Reply:
    """``shard`` read through ``service`` by ``comm``; ``started`` is set once its first bytes came (or it ended)."""
    started = started or threading.Event()
    reply, body = Reply(comm), bytearray()
    try:
        if comm == "ws fqn":
            _ws(service, shard, etl_args or shard.etl_args, reply, body, started)
        else:
            _http(service, comm, shard, etl_args or shard.etl_args, reply, body, started)
    except Exception as exc:  # the connection cut, refused or timed out: a failed read, with what came before
        reply.error = f"{type(exc).__name__}: {exc}"
    finally:
        reply.body = bytes(body)
        started.set()
    return reply


def _ws(service: Service, shard: Shard, etl_args: str, reply: Reply, body: bytearray,
        started: threading.Event) -> None:
    with ws_session(service) as ws:
        request(ws, shard.name, fqn=shard.fqn, etl_args=etl_args)
        started.set()  # a ws message arrives whole: its first bytes cannot be told apart
        body += ws.recv(timeout=REPLY_TIMEOUT)
        reply.status = 200


def _http(service: Service, comm: str, shard: Shard, etl_args: str, reply: Reply, body: bytearray,
          started: threading.Event) -> None:
    params: dict[str, str] | None = None
    if comm == "hpush body":
        method, url, content, params = "PUT", f"/train/{shard.name}", shard.data, {"etl_args": etl_args}
    elif comm == "hpush fqn":
        method, url, content = "PUT", f"/train/{shard.name}?{fqn_query(shard.fqn, etl_args)}", b""
    elif comm == "hpull fqn":
        method, url, content = "GET", f"/{escaped_uname('train', shard.name)}?{fqn_query(shard.fqn, etl_args)}", b""
    else:
        raise ValueError(f"unknown comm type {comm!r}")
    with httpx.stream(method, service.url + url, params=params, content=content, timeout=REPLY_TIMEOUT) as response:
        reply.status = response.status_code
        for chunk in response.iter_raw():
            body += chunk
            started.set()


def in_flight(service: Service, shards: dict[str, Shard]) -> tuple[list[threading.Thread], dict[str, Reply]]:
    """One reader per comm type (``shards`` by comm), each in a thread; returns once every one has started."""
    replies: dict[str, Reply] = {}
    threads, started = [], []
    for comm, shard in shards.items():
        event = threading.Event()

        def run(comm: str = comm, shard: Shard = shard, event: threading.Event = event) -> None:
            replies[comm] = read(service, comm, shard, started=event)

        thread = threading.Thread(target=run, name=f"read {comm}", daemon=True)
        thread.start()
        threads.append(thread)
        started.append(event)
    for event in started:
        assert event.wait(REPLY_TIMEOUT), "a reader got nothing in time"
    return threads, replies
