"""Chunked AIS objects: the FQN holds only chunk #1 (AIS 5.0's core/ufest.go); never transform it as the object.

With ``AIS_TARGET_URL`` set, the service asks the target for the object's size (``HEAD
<AIS_TARGET_URL>/<PathEscape(uname)>``) before reading an ``etl_fqn``; when the file is shorter it
fetches the object over HTTP instead. When the target cannot tell, it reads the file, and the
strict tar reader refuses a shard cut short (422) rather than returning a shorter one.
"""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from testbed import inputs
from testbed.fake_ais import AisDisk, Fault
from testbed.service import Service
from testbed.shardgen import make_tar, read_tar
from tests.contract.harness import escaped_uname, fqn_query
from transformer.errors import RequestError
from transformer.server.fqn import object_uname
from transformer.wire import path_escape

from .conftest import HeadAwareTarget

FULL = make_tar(inputs.good_members(4))
FIRST_CHUNK = FULL[: len(FULL) // 3]  # what lom.FQN holds for a chunked object


@pytest.fixture(scope="module")
def expected(client: httpx.Client) -> bytes:
    response = client.put("/train/chunked.tar", content=FULL)
    assert response.status_code == 200
    return response.content


def test_hpush_fqn_of_a_chunked_object_is_fetched_whole(client: httpx.Client, disk: AisDisk, target: HeadAwareTarget,
                                                        expected: bytes, still_serving: Service) -> None:
    fqn = disk.put("train", "chunked.tar", FIRST_CHUNK)
    target.objects["ais/@#/train/chunked.tar"] = FULL
    response = client.put(f"/train/chunked.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 200, response.text
    assert response.content == expected
    assert [r.method for r in target.recorded()] == ["HEAD", "GET"]
    assert target.recorded()[0].raw_path == f"{target.etl_path}/{escaped_uname('train', 'chunked.tar')}"


def test_hpush_fqn_of_a_whole_object_is_read_locally(client: httpx.Client, disk: AisDisk, target: HeadAwareTarget,
                                                     expected: bytes, still_serving: Service) -> None:
    fqn = disk.put("train", "dir/whole obj.tar", FULL)
    target.objects["ais/@#/train/dir/whole obj.tar"] = FULL
    response = client.put(f"/train/dir/whole obj.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 200
    assert response.content == expected
    assert [r.method for r in target.recorded()] == ["HEAD"]  # one metadata request, the data stays local


def test_hpull_fqn_of_a_chunked_object_uses_the_request_uname(client: httpx.Client, disk: AisDisk,
                                                              target: HeadAwareTarget, expected: bytes,
                                                              still_serving: Service) -> None:
    fqn = disk.put("train", "pulled.tar", FIRST_CHUNK)
    target.objects["ais/@#/train/pulled.tar"] = FULL
    response = client.get(f"/{escaped_uname('train', 'pulled.tar')}?{fqn_query(fqn)}")
    assert response.status_code == 200, response.text
    assert read_tar(response.content) == read_tar(expected)
    assert [r.method for r in target.recorded()] == ["HEAD", "GET"]


def test_ws_fqn_of_a_chunked_object_is_fetched_whole(disk: AisDisk, target: HeadAwareTarget, expected: bytes,
                                                     still_serving: Service) -> None:
    fqn = disk.put("train", "ws-chunked.tar", FIRST_CHUNK)
    target.objects["ais/@#/train/ws-chunked.tar"] = FULL
    with connect(f"ws://127.0.0.1:{still_serving.port}/ws", max_size=None, open_timeout=10) as ws:
        ws.send(json.dumps({"path": "ws-chunked.tar", "fqn": path_escape(fqn)}).encode())
        reply = ws.recv(timeout=30)
    assert isinstance(reply, bytes)
    assert read_tar(reply) == read_tar(expected)


@pytest.mark.parametrize("head_status", [405, 500])
def test_without_a_size_from_the_target_a_cut_file_is_a_422_not_a_shorter_shard(
    head_status: int, client: httpx.Client, disk: AisDisk, target: HeadAwareTarget, still_serving: Service
) -> None:
    fqn = disk.put("train", "unknown.tar", FIRST_CHUNK)
    target.objects["ais/@#/train/unknown.tar"] = FULL
    target.head_status["ais/@#/train/unknown.tar"] = head_status
    response = client.put(f"/train/unknown.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 422
    assert "shard 'train/unknown.tar'" in response.text and "truncated" in response.text


def test_chunked_object_whose_fetch_fails_is_a_clear_upstream_error(client: httpx.Client, disk: AisDisk,
                                                                    target: HeadAwareTarget,
                                                                    still_serving: Service) -> None:
    fqn = disk.put("train", "vanished.tar", FIRST_CHUNK)
    target.objects["ais/@#/train/vanished.tar"] = FULL
    target.set_fault("ais/@#/train/vanished.tar", Fault(status=500, body=b"disk error"))
    response = client.put(f"/train/vanished.tar?{fqn_query(fqn)}", content=b"")
    assert response.status_code == 502
    assert "500 disk error" in response.text and target.secret not in response.text


@pytest.mark.parametrize(
    ("fqn", "name", "uname"),
    [
        ("/mp/@ais/bck/%ob/dir/o.tar", "dir/o.tar", "ais/@#/bck/dir/o.tar"),
        ("/mp/@aws/bck/%ob/o.tar", "o.tar", "aws/@#/bck/o.tar"),
        ("/mp/@ais/#team/bck/%ob/o.tar", "o.tar", "ais/@#team/bck/o.tar"),
        ("/mp/@ais/@Uuid1#team/bck/%ob/o.tar", "o.tar", "ais/@Uuid1#team/bck/o.tar"),
        ("/data/@weird/mp/@gcp/bck/%ob/x", "name from the request", "gcp/@#/bck/name from the request"),
    ],
)
def test_object_uname_from_the_fqn_layout(fqn: str, name: str, uname: str) -> None:
    assert object_uname(fqn, name) == uname


def test_object_uname_refuses_a_layout_without_provider() -> None:
    with pytest.raises(RequestError) as info:
        object_uname("/mp/bck/%ob/o", "o")
    assert info.value.status == 403


def test_path_escape_matches_go() -> None:
    # Go url.PathEscape("ais/@#/b k/o,1;2?.tar") == "ais%2F@%23%2Fb%20k%2Fo%2C1%3B2%3F.tar"
    assert path_escape("ais/@#/b k/o,1;2?.tar") == "ais%2F@%23%2Fb%20k%2Fo%2C1%3B2%3F.tar"
