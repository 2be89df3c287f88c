"""Differential tests: our service next to the aistore SDK reference ``FastAPIServer`` (aistore 2.0.0).

Both get the same requests against the same fake target. The reference runs a transform that re-tars
its input, and the shards here have no image members, so a correct pair of outputs carries the same
members and bytes (the tar framing may differ). Where the reference agrees with the contract the
tests assert equality; where it is known wrong (its pipeline and ws code) the test names the
weakness, pins the reference's behaviour (so a change of the pinned SDK is noticed) and asserts ours.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import unquote

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget, Fault, go_path_escape
from testbed.service import Service
from testbed.shardgen import make_tar, read_tar

from .harness import args_query, escaped_uname, fqn_query, uname
from .outputs import plain_members, plain_shard

NODE_URL = "Ais-Node-Url"
ARGS = json.dumps({"on_error": "skip"}, separators=(",", ":"))  # valid for us, opaque to the reference


def both(client: httpx.Client, ref_client: httpx.Client, method: str, url: str, **kwargs) -> tuple:
    return client.request(method, url, **kwargs), ref_client.request(method, url, **kwargs)


def test_diff_hpush_fqn_is_double_decoded_by_both(client: httpx.Client, ref_client: httpx.Client,
                                                  disk: AisDisk) -> None:
    inputs = plain_members(3, "fqn")
    fqn = disk.put("docs", "dir/100% sure.tar", make_tar(inputs))
    ours, ref = both(client, ref_client, "PUT", f"/docs/dir/100% sure.tar?{fqn_query(fqn)}", content=b"")
    assert ours.status_code == ref.status_code == 200
    assert read_tar(ours.content) == read_tar(ref.content) == inputs


def test_diff_hpush_body(client: httpx.Client, ref_client: httpx.Client) -> None:
    inputs = plain_members(2, "body")
    ours, ref = both(client, ref_client, "PUT", "/docs/body.tar", content=make_tar(inputs))
    assert ours.status_code == ref.status_code == 200
    assert read_tar(ours.content) == read_tar(ref.content) == inputs


def test_diff_hpull_fetches_the_same_target_path(client: httpx.Client, ref_client: httpx.Client,
                                                target: FakeTarget) -> None:
    inputs = plain_members(2, "pull")
    target.objects[uname("docs", "dir/obj x#1.tar")] = make_tar(inputs)
    escaped = escaped_uname("docs", "dir/obj x#1.tar")
    ours, ref = both(client, ref_client, "GET", f"/{escaped}")
    assert ours.status_code == ref.status_code == 200
    assert read_tar(ours.content) == read_tar(ref.content) == inputs
    fetches = target.recorded("GET")
    assert [f.raw_path for f in fetches] == [f"{target.etl_path}/{escaped}"] * 2


def test_diff_hpull_reserved_characters_reach_the_same_uname(client: httpx.Client, ref_client: httpx.Client,
                                                             target: FakeTarget) -> None:
    # Go's PathEscape keeps "+=:&$"; the reference's quote(safe="@") escapes them. Both are one segment
    # that the target decodes to the same uname, so this is a difference of spelling, not of meaning.
    name = "a+b=c:d&e.tar"
    target.objects[uname("docs", name)] = plain_shard(1, "reserved")
    ours, ref = both(client, ref_client, "GET", f"/{escaped_uname('docs', name)}")
    assert ours.status_code == ref.status_code == 200
    ours_fetch, ref_fetch = target.recorded("GET")  # the fake answers 400 unless the uname is one segment
    assert ours_fetch.raw_path == f"{target.etl_path}/{escaped_uname('docs', name)}"  # kept exactly as AIS sent it
    assert unquote(ref_fetch.raw_path.rsplit("/", 1)[-1]) == uname("docs", name)


def _destination(dest: FakeTarget, name: str) -> str:
    return f"{dest.base_url}/{escaped_uname('dst', name)}?owt=3&uuid=tcb-diff"


def test_diff_direct_put_url_query_and_204(client: httpx.Client, ref_client: httpx.Client,
                                           dest_target: FakeTarget) -> None:
    inputs = plain_members(2, "dp")
    ours, ref = both(client, ref_client, "PUT", f"/src/dp.tar?{args_query(ARGS)}", content=make_tar(inputs),
                     headers={NODE_URL: _destination(dest_target, "dir/dp.tar")})
    assert ours.status_code == ref.status_code == 204
    first, second = dest_target.recorded("PUT")
    assert first.raw_path == second.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', 'dir/dp.tar')}"
    assert first.query_pairs == second.query_pairs == [("owt", "3"), ("uuid", "tcb-diff"), ("etl_args", ARGS)]
    assert read_tar(first.body) == read_tar(second.body) == inputs


def test_diff_direct_put_refusal_is_propagated_by_both(client: httpx.Client, ref_client: httpx.Client,
                                                       dest_target: FakeTarget) -> None:
    dest_target.set_fault("*", Fault(status=507, body=b"above high watermark"))
    ours, ref = both(client, ref_client, "PUT", "/src/full.tar", content=plain_shard(1),
                     headers={NODE_URL: _destination(dest_target, "full.tar")})
    assert ours.status_code == ref.status_code == 507
    assert "above high watermark" in ours.text and "above high watermark" in ref.text


def test_diff_destination_200_with_body_is_delivered_by_kind(client: httpx.Client, ref_client: httpx.Client,
                                                             dest_target: FakeTarget) -> None:
    # Reference known wrong (its base_etl_server.py): it decides "delivered" by an empty body and
    # relays a destination's non-empty 200 as the object. We decide by the entry's kind: 204.
    dest_target.set_fault("*", Fault(status=200, body=b"some words"))
    ours, ref = both(client, ref_client, "PUT", "/src/words.tar", content=plain_shard(1),
                     headers={NODE_URL: _destination(dest_target, "words.tar")})
    assert (ref.status_code, ref.content) == (200, b"some words")
    assert (ours.status_code, ours.content) == (204, b"")


def test_diff_stage_forwarding_path_args_and_remaining_list(client: httpx.Client, ref_client: httpx.Client,
                                                            stage: FakeStage, dest_target: FakeTarget) -> None:
    stage.reply = "delivered"
    rest = _destination(dest_target, "staged.tar")
    inputs = plain_members(2, "stage")
    ours, ref = both(client, ref_client, "PUT", f"/src/dir/staged.tar?{args_query(ARGS)}",
                     content=make_tar(inputs), headers={NODE_URL: f"{stage.base_url},{rest}"})
    assert ours.status_code == ref.status_code == 204
    first, second = stage.recorded("PUT")
    assert first.raw_path == second.raw_path == "/src/dir/staged.tar"
    assert first.query_pairs == second.query_pairs == [("etl_args", ARGS)]
    assert first.headers["ais-node-url"] == second.headers["ais-node-url"] == rest
    assert read_tar(first.body) == read_tar(second.body) == inputs


def test_diff_stage_200_body_is_relayed_by_both(client: httpx.Client, ref_client: httpx.Client,
                                                stage: FakeStage) -> None:
    stage.reply, stage.payload = "bytes", b"result of stage two"
    ours, ref = both(client, ref_client, "PUT", "/src/relay.tar", content=plain_shard(1),
                     headers={NODE_URL: stage.base_url})
    assert ours.status_code == ref.status_code == 200
    assert ours.content == ref.content == b"result of stage two"
    assert all("ais-node-url" not in put.headers for put in stage.recorded("PUT"))


def test_diff_stage_empty_200_stays_an_empty_object(client: httpx.Client, ref_client: httpx.Client,
                                                    stage: FakeStage) -> None:
    # Reference known wrong (its base_etl_server.py): "200 with empty body from the next hop" becomes 204, so an
    # empty result of a middle stage is reported as delivered and lost. We relay the empty 200.
    stage.reply, stage.payload = "bytes", b""
    ours, ref = both(client, ref_client, "PUT", "/src/empty.tar", content=plain_shard(1),
                     headers={NODE_URL: stage.base_url})
    assert ref.status_code == 204
    assert (ours.status_code, ours.content) == (200, b"")


def test_diff_malformed_ais_node_url_is_400_for_both(client: httpx.Client, ref_client: httpx.Client) -> None:
    ours, ref = both(client, ref_client, "PUT", "/src/bad.tar", content=plain_shard(1),
                     headers={NODE_URL: "http://127.0.0.1:1,,http://127.0.0.1:2"})
    assert ours.status_code == ref.status_code == 400


def _ws_reply(service: Service, messages: list[bytes]) -> bytes | str | ConnectionClosed:
    with connect(f"ws://127.0.0.1:{service.port}/ws", max_size=None, open_timeout=10, close_timeout=5) as ws:
        for message in messages:
            ws.send(message)
        try:
            return ws.recv(timeout=60)
        except ConnectionClosed as closed:
            return closed


def test_diff_ws_fqn_reply(service: Service, reference: Service, disk: AisDisk) -> None:
    inputs = plain_members(2, "ws")
    fqn = disk.put("docs", "ws 100%.tar", make_tar(inputs))
    message = json.dumps({"path": "ws 100%.tar", "fqn": go_path_escape(fqn)}).encode()
    ours, ref = _ws_reply(service, [message]), _ws_reply(reference, [message])
    assert isinstance(ours, bytes) and isinstance(ref, bytes)
    assert read_tar(ours) == read_tar(ref) == inputs


def test_diff_ws_error_is_not_a_text_reply(service: Service, reference: Service) -> None:
    # Reference known wrong (its ws handler): a transform error is sent as Text, which AIS counts
    # as "delivered by direct put" (a silently missing object). Ours replies Binary with the error JSON.
    messages = [json.dumps({"path": "garbage.tar"}).encode(), b"not a tar at all" * 64]
    ours, ref = _ws_reply(service, messages), _ws_reply(reference, messages)
    assert isinstance(ref, str) and ref.startswith("Transform error")
    assert isinstance(ours, bytes) and json.loads(ours)["status"] == 422


def test_diff_download_is_implemented(client: httpx.Client, ref_client: httpx.Client, target: FakeTarget) -> None:
    # Reference known wrong (ext/etl/communicator.go calls it for downloads): no POST /download (405);
    # ETL download jobs fail.
    inputs = plain_members(1, "dl")
    target.origin["dl.tar"] = make_tar(inputs)
    url = f"/download?original_url={target.base_url}/origin/dl.tar&object_to=dl.tar"
    ours, ref = both(client, ref_client, "POST", url)
    assert ref.status_code == 405
    assert ours.status_code == 200
    assert read_tar(ours.content) == inputs


def _idle_connection_survives(port: int, idle: float, result: dict, key: str) -> None:
    """Whether the server keeps an idle keep-alive connection open for ``idle`` seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        assert response.status == 200 and not response.will_close
        time.sleep(idle)
        conn.sock.setblocking(False)
        try:
            closed = conn.sock.recv(1, socket.MSG_PEEK) == b""  # EOF waiting: the server hung up
        except BlockingIOError:
            closed = False
        conn.sock.setblocking(True)
        if not closed:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            closed = response.status != 200
        result[key] = not closed
    finally:
        conn.close()


def test_diff_keepalive_outlives_the_targets_idle_timeout(service: Service, reference: Service) -> None:
    # The target closes idle connections after 6 s and does not retry a PUT that failed with EOF
    # (cmn/config.go). Reference known wrong: uvicorn's default 5 s keep-alive closes first.
    result: dict[str, bool] = {}
    threads = [threading.Thread(target=_idle_connection_survives, args=(s.port, 6.5, result, name))
               for name, s in (("ours", service), ("reference", reference))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert result == {"ours": True, "reference": False}
