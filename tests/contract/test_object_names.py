"""Object names with spaces, ``#``, ``?``, ``%``, non-ASCII and folders, end to end, for every comm type.

Each comm type gets the name in its own shape (hpush ``/<bucket>/<obj>``, hpull one escaped uname
segment, ws the JSON ``path``), and every path the pod sends on must decode to the same name: the
next stage's request path, the destination's escaped uname (used exactly as AIS wrote it), the
target's hpull fetch and size check, and the shard named in an error.
"""

from __future__ import annotations

import json
from urllib.parse import quote, unquote

import httpx
import pytest

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar, read_tar

from .harness import escaped_uname, fqn_query, uname
from .outputs import assert_transformed, image_shard
from .test_direct_put import destination
from .test_ws import REPLY_TIMEOUT, request, ws_session

NODE_URL = "Ais-Node-Url"
NAMES = ["dir/a b#c?d%e.tar", "données/échantillon 1.tar"]
ARGS = json.dumps({"dtype": "uint8"}, separators=(",", ":"))

pytestmark = pytest.mark.parametrize("name", NAMES, ids=["reserved", "non-ascii"])


def hpush_path(bucket: str, name: str) -> str:
    """``/<bucket>/<obj>`` as an HTTP client writes it for this name (every reserved byte escaped)."""
    return f"/{bucket}/{quote(name)}"


# ------------------------------------------------------------------------------------------ hpush


def test_hpush_next_stage_decodes_the_same_path(client: httpx.Client, stage: FakeStage, name: str) -> None:
    shard = image_shard(1)
    inline = client.put(hpush_path("src", name), content=shard)
    response = client.put(hpush_path("src", name), content=shard, headers={NODE_URL: stage.base_url})
    assert response.status_code == 200, response.text
    (put,) = stage.recorded("PUT")
    assert unquote(put.raw_path) == f"/src/{name}", put.raw_path
    assert response.content == b"stage:" + inline.content


def test_hpush_direct_put_keeps_the_destinations_escaping(client: httpx.Client, dest_target: FakeTarget,
                                                          name: str) -> None:
    response = client.put(hpush_path("src", name), content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, name)})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', name)}"


def test_hpush_two_stage_pipeline_delivers_to_the_right_object(client: httpx.Client, service: Service,
                                                               disk: AisDisk, target: FakeTarget,
                                                               dest_target: FakeTarget, name: str) -> None:
    # A >> B, both this service: B gets the object path from A, then direct-puts to the destination.
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", name, make_tar(inputs))
    inline = client.put(f"{hpush_path('src', name)}?{fqn_query(fqn, ARGS)}", content=b"")
    header = f"{service.url},{destination(dest_target, name, query='owt=3&uuid=tcb-names')}"
    response = client.put(f"{hpush_path('src', name)}?{fqn_query(fqn, ARGS)}", content=b"",
                          headers={NODE_URL: header})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', name)}"
    assert put.query_pairs == [("owt", "3"), ("uuid", "tcb-names"), ("etl_args", ARGS)]
    assert read_tar(put.body) == read_tar(inline.content)
    # The chunked-object size check asked the target about this very object (its escaped uname).
    heads = target.recorded("HEAD")
    assert heads and {h.raw_path for h in heads} == {f"{target.etl_path}/{escaped_uname('src', name)}"}


def test_hpush_error_names_the_object(client: httpx.Client, name: str) -> None:
    response = client.put(hpush_path("src", name), content=b"this is not a tar archive at all" * 40)
    assert response.status_code == 422
    assert f"src/{name}" in response.text


# ------------------------------------------------------------------------------------------ hpull


def test_hpull_fetch_and_next_stage_keep_the_uname(client: httpx.Client, target: FakeTarget, stage: FakeStage,
                                                   name: str) -> None:
    inputs = imagenet_like_members(1)
    target.objects[uname("src", name)] = make_tar(inputs)
    response = client.get(f"/{escaped_uname('src', name)}", headers={NODE_URL: stage.base_url})
    assert response.status_code == 200, response.text
    (fetch,) = target.recorded("GET")
    assert fetch.raw_path == f"{target.etl_path}/{escaped_uname('src', name)}"
    (put,) = stage.recorded("PUT")
    assert unquote(put.raw_path) == "/" + uname("src", name), put.raw_path
    assert response.content.startswith(b"stage:")
    assert_transformed(inputs, response.content[len(b"stage:"):])


def test_hpull_two_stage_pipeline_delivers_to_the_right_object(client: httpx.Client, service: Service,
                                                               disk: AisDisk, dest_target: FakeTarget,
                                                               name: str) -> None:
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", name, make_tar(inputs))
    header = f"{service.url},{destination(dest_target, name)}"
    response = client.get(f"/{escaped_uname('src', name)}?{fqn_query(fqn)}", headers={NODE_URL: header})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', name)}"
    assert_transformed(inputs, put.body)


def test_hpull_error_names_the_object(client: httpx.Client, name: str) -> None:
    response = client.get(f"/{escaped_uname('src', 'missing/' + name)}")
    assert response.status_code == 404
    assert escaped_uname("src", "missing/" + name) in response.text  # the exact object it asked the target for


# --------------------------------------------------------------------------------------------- ws


def test_ws_next_stage_decodes_the_same_path(service: Service, stage: FakeStage, name: str) -> None:
    inputs = imagenet_like_members(1)
    with ws_session(service) as ws:
        request(ws, name, make_tar(inputs), pipeline=stage.base_url)
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert isinstance(reply, bytes) and reply.startswith(b"stage:"), reply[:200]
    (put,) = stage.recorded("PUT")
    assert unquote(put.raw_path) == f"/{name}", put.raw_path
    assert_transformed(inputs, reply[len(b"stage:"):])


def test_ws_two_stage_pipeline_delivers_to_the_right_object(service: Service, disk: AisDisk,
                                                            dest_target: FakeTarget, name: str) -> None:
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", name, make_tar(inputs))
    with ws_session(service) as ws:
        request(ws, name, fqn=fqn, pipeline=f"{service.url},{destination(dest_target, name)}")
        reply = ws.recv(timeout=REPLY_TIMEOUT)
    assert isinstance(reply, str), reply[:200]  # Text: delivered by direct put
    (put,) = dest_target.recorded("PUT")
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', name)}"
    assert_transformed(inputs, put.body)
