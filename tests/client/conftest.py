"""Fixtures of the client suite: a fake AIS proxy, an SDK client on it, the real service on loopback.

The service is ``python -m transformer serve`` in a subprocess on 127.0.0.1 (the contract suite's
harness), reading shards through ``etl_fqn`` from a temporary mountpath in the AIS layout; the fake
proxy stores its objects in that same mountpath and redirects ETL GETs to the service as an AIS
target does for ``hpull://``. Shards hold small real photographs (``testbed.shardgen``) so a run stays
quick on two cores.

The tests that need the pod's side (its engine, or the service: FastAPI, uvicorn, simplejpeg,
torchvision's transforms) are marked ``server``, so that ``-m "not server"`` runs the rest where only
the client's dependencies are installed (``python -m bench.gpu`` on a GPU machine); the server's
modules are imported by the fixtures that need them.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from testbed.fake_proxy import FakeProxy
from testbed.httpserve import QuietServer
from testbed.shardgen import jpeg_bytes, make_tar

if TYPE_CHECKING:
    from testbed.service import Service

HERE = Path(__file__).resolve().parent
# The fixtures that run the pod's side, and why a test using one is marked ``server``.
SERVER_FIXTURES = {
    "service": "runs the service (python -m transformer serve)",
    "served_proxy": "reads through the service (python -m transformer serve)",
    "val_pod": "runs the service (python -m transformer serve)",
    "pod_whole": "reads a shard the pod's engine writes (transform_shard)",
    "pool_module": "runs the pod's engine (TransformPool)",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE not in item.path.parents or item.get_closest_marker("server"):
            continue
        used = [name for name in SERVER_FIXTURES if name in getattr(item, "fixturenames", ())]
        if used:
            item.add_marker(pytest.mark.server(reason=SERVER_FIXTURES[used[0]]))

# Tiny, deterministic output: 32x32 uint8 (3 KB per sample instead of 602 KB).
SMALL = {"transforms": [{"Resize": {"size": [32, 32]}}], "dtype": "uint8"}


@pytest.fixture(scope="session")
def mountpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ais-mountpath")


@pytest.fixture(scope="session")
def service(mountpath: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from testbed.service import base_env, start_transformer

    env = base_env(ETL_FQN_ROOTS=str(mountpath), ETL_WORKERS="2", ETL_OBJ_TIMEOUT="60s", ETL_LOG_LEVEL="warning")
    server = start_transformer("client-suite-transformer", tmp_path_factory.mktemp("logs"), env)
    yield server
    server.stop()


def registered_pod(name: str, environment: dict[str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """The pod AIS would start for an ETL registered with ``environment``: that is all it knows. Yields it and the
    mountpath it reads ``etl_fqn`` under."""
    from testbed.service import base_env, start_transformer

    mountpath = tmp_path_factory.mktemp(f"{name}-mountpath")
    env = base_env(**environment, ETL_FQN_ROOTS=str(mountpath), ETL_WORKERS="2", ETL_LOG_LEVEL="warning")
    service = start_transformer(name, tmp_path_factory.mktemp(f"{name}-logs"), env)
    yield service, mountpath
    service.stop()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[FakeProxy]:
    with FakeProxy(tmp_path / "mountpath") as fake:
        yield fake
    assert fake.problems == [], fake.problems  # every request the client made followed the contract


@pytest.fixture
def served_proxy(mountpath: Path, service: Service, request: pytest.FixtureRequest) -> Iterator[FakeProxy]:
    """A fake proxy whose objects the service can read (shared mountpath, one bucket per test)."""
    with FakeProxy(mountpath, pod_url=service.url) as fake:
        yield fake
    assert fake.problems == [], fake.problems


@pytest.fixture
def ais(proxy: FakeProxy):
    from aistore.sdk import Client

    return Client(proxy.url, timeout=(2, 30))


def labelled_shard(first: int, count: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """``sample-<i>.jpg`` + ``.cls`` (label i) for i in [first, first + count); photo i % 4."""
    members = []
    for i in range(first, first + count):
        members.append((f"sample-{i:05d}.jpg", jpeg_bytes(i, size)))
        members.append((f"sample-{i:05d}.cls", str(i).encode()))
    return make_tar(members)


# A whole shard in the service's output format, and a server that answers with chosen bodies: the
# whole-shard and webdataset-way tests share them.
SAMPLES = 6


@pytest.fixture(scope="session")
def whole() -> bytes:
    """A shard in the service's output format, written here (``testbed.shardgen``): 6 samples of a uint8
    (3, 32, 32) ``.npy`` (filled with the sample's number) and its ``.cls``, then the end marker, which
    records what ``pod_whole`` was made from (its input's digest, its settings, the version).
    ``pod_whole`` is the service's own; a test checks that the two have the same members at the same offsets."""
    import numpy as np

    from testbed.shardgen import npy_bytes, sealed
    from transformer import __version__
    from transformer.config import Settings
    from transformer.integrity import InputDigest
    from transformer.options import options_from_mapping, settings_digest

    members = []
    for i in range(SAMPLES):
        members.append((f"sample-{i:05d}.npy", npy_bytes(np.full((3, 32, 32), i, np.uint8))))
        members.append((f"sample-{i:05d}.cls", str(i).encode()))
    source = InputDigest(io.BytesIO(labelled_shard(0, SAMPLES)))
    source.drain()
    settings = settings_digest(options_from_mapping(SMALL, Settings.from_env({})))
    return sealed(make_tar(members), source=source.identity(), settings=settings, version=__version__)


@pytest.fixture(scope="session")
def pod_whole(pool_module) -> bytes:
    """A shard as the service writes it: the engine's uint8 output (``SMALL``) of ``labelled_shard(0, 6)``."""
    from transformer.config import Settings
    from transformer.engine import transform_shard
    from transformer.options import options_from_mapping

    options = options_from_mapping(SMALL, Settings.from_env({}))
    data = b"".join(transform_shard(io.BytesIO(labelled_shard(0, SAMPLES)), options, pool_module, shard="s.tar",
                                    object_name="s.tar", window=4))
    return bytes(data)


@pytest.fixture(scope="session")
def pool_module():
    from transformer.engine import TransformPool

    pool = TransformPool(workers=2, max_inflight=8)
    yield pool
    pool.shutdown()


class Served:
    """A chunked HTTP/1.1 server on 127.0.0.1 answering each path with a list of bodies, one per GET
    (the last one repeats): a cut first read and a whole second one, for instance."""

    def __init__(self, bodies: dict[str, list[bytes]]):
        self.bodies = bodies
        self.hits: dict[str, int] = {}
        served = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hit = served.hits[self.path] = served.hits.get(self.path, 0) + 1
                answers = served.bodies[self.path]
                body = answers[min(hit, len(answers)) - 1]
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                # A reader that stops early (an error raised at once) ends this with a ConnectionError,
                # which QuietServer drops along with the connection.
                for start in range(0, len(body), 65536):
                    part = body[start:start + 65536]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")  # cleanly terminated, whatever the body holds

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served():
    servers = []

    def serve(bodies: dict[str, list[bytes]]) -> Served:
        servers.append(Served(bodies))
        return servers[-1]

    yield serve
    for server in servers:
        server.close()
