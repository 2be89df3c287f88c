"""``Ais-Node-Url``: direct put to a destination target and ETL pipeline stages (sections 4.1-4.3, 11)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from testbed.fake_ais import AisDisk, FakeStage, FakeTarget, Fault
from testbed.ports import free_port
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar, read_tar

from .harness import args_query, escaped_uname, fqn_query, uname
from .outputs import assert_transformed, image_shard
from .test_ops import _settled, _value

NODE_URL = "Ais-Node-Url"
ARGS = json.dumps({"dtype": "uint8"}, separators=(",", ":"))


def destination(dest: FakeTarget, name: str, query: str = "owt=3&uuid=tcb-xyz") -> str:
    """A destination-target entry as AIS writes it: ``<dest intra-data URL>/<PathEscape(uname)>[?query]``."""
    return f"{dest.base_url}/{escaped_uname('dst', name)}" + (f"?{query}" if query else "")


def test_direct_put_goes_to_the_entry_host_under_the_etl_path_and_answers_204(
    client: httpx.Client, target: FakeTarget, dest_target: FakeTarget
) -> None:
    shard = image_shard(3)
    before = _settled(client)
    inline = client.put(f"/src/shard.tar?{args_query(ARGS)}", content=shard)
    response = client.put(f"/src/shard.tar?{args_query(ARGS)}", content=shard,
                          headers={NODE_URL: destination(dest_target, "dir/shard.tar")})
    assert response.status_code == 204, response.text
    assert response.content == b""
    (put,) = dest_target.recorded("PUT")
    # <scheme of AIS_TARGET_URL>://<entry host><AIS_TARGET_URL path><entry path>?<entry query>&etl_args=..
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', 'dir/shard.tar')}"
    assert put.query_pairs == [("owt", "3"), ("uuid", "tcb-xyz"), ("etl_args", ARGS)]
    assert "ais-node-url" not in put.headers  # nothing left after the destination
    assert put.body == inline.content
    assert target.recorded() == []  # the entry's host, not AIS_TARGET_URL's host
    after = _settled(client)
    for to, count in (("target", 1), ("caller", 1), ("stage", 0)):  # the direct put, the inline reply above
        assert _value(after, "etl_delivered_total", to=to) - _value(before, "etl_delivered_total", to=to) == count


def test_direct_put_with_fqn_input(client: httpx.Client, disk: AisDisk, dest_target: FakeTarget) -> None:
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", "fqn-dp.tar", make_tar(inputs))
    response = client.put(f"/src/fqn-dp.tar?{fqn_query(fqn)}", content=b"",
                          headers={NODE_URL: destination(dest_target, "fqn-dp.tar")})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert_transformed(inputs, put.body)


def test_hpull_with_a_destination_entry_direct_puts_too(client: httpx.Client, disk: AisDisk,
                                                       dest_target: FakeTarget) -> None:
    # Offline hpull: GET /<PathEscape(uname)>?etl_fqn=.. with Ais-Node-Url (ext/etl/communicator.go).
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", "pulled-dp.tar", make_tar(inputs))
    response = client.get(f"/{escaped_uname('src', 'pulled-dp.tar')}?{fqn_query(fqn, ARGS)}",
                          headers={NODE_URL: destination(dest_target, "pulled-dp.tar")})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.raw_path == f"{dest_target.etl_path}/{escaped_uname('dst', 'pulled-dp.tar')}"
    assert put.query_pairs == [("owt", "3"), ("uuid", "tcb-xyz"), ("etl_args", ARGS)]
    assert_transformed(inputs, put.body, dtype="uint8")


def test_direct_put_without_entry_query_sends_only_etl_args(client: httpx.Client, dest_target: FakeTarget) -> None:
    # Single-object copy: no job xaction, so the entry has no query (section 4.1).
    response = client.put(f"/src/copy.tar?{args_query(ARGS)}", content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, "copy.tar", query="")})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.query_pairs == [("etl_args", ARGS)]


def test_direct_put_answers_204_only_after_the_destinations_200(client: httpx.Client,
                                                                 dest_target: FakeTarget) -> None:
    dest_target.set_fault("*", Fault(stall=1.0))
    started = time.monotonic()
    response = client.put("/src/slow-dest.tar", content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, "slow-dest.tar")})
    answered = time.monotonic()
    assert response.status_code == 204
    (put,) = dest_target.recorded("PUT")
    assert put.answered_at and put.answered_at <= answered
    assert answered - started >= 0.95  # the destination stalled 1 s before its 200


def test_direct_put_destination_200_with_a_body_is_still_delivered(client: httpx.Client,
                                                                   dest_target: FakeTarget) -> None:
    # Decided by the entry's kind (it has a path), not by the length of what the destination said.
    dest_target.set_fault("*", Fault(status=200, body=b"unexpected words"))
    response = client.put("/src/chatty.tar", content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, "chatty.tar")})
    assert response.status_code == 204
    assert response.content == b""


@pytest.mark.parametrize(("status", "reason"), [(507, b"above high watermark"), (404, b"bucket dst does not exist")])
def test_direct_put_destination_error_is_propagated_never_204(client: httpx.Client, dest_target: FakeTarget,
                                                              status: int, reason: bytes) -> None:
    dest_target.set_fault("*", Fault(status=status, body=reason))
    response = client.put("/src/refused.tar", content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, "refused.tar")})
    assert response.status_code == status
    assert reason.decode() in response.text


def test_direct_put_destination_unreachable_fails_within_obj_timeout(impatient: Service) -> None:
    entry = f"http://127.0.0.1:{free_port()}/{escaped_uname('dst', 'nowhere.tar')}?owt=3"
    started = time.monotonic()
    response = httpx.put(f"{impatient.url}/src/nowhere.tar", content=image_shard(1), headers={NODE_URL: entry},
                         timeout=20)
    assert response.status_code in (502, 503, 504)  # never 204: nothing was delivered
    assert time.monotonic() - started < 6.0  # obj_timeout 2 s plus slack


def test_direct_put_reset_is_retried_from_a_replayable_source(client: httpx.Client, disk: AisDisk,
                                                              dest_target: FakeTarget) -> None:
    # An FQN can be read again: a connection dropped by the destination is the pod's to retry.
    inputs = imagenet_like_members(2)
    fqn = disk.put("src", "retry.tar", make_tar(inputs))
    dest_target.set_fault("*", Fault(reset=True, times=1))
    response = client.put(f"/src/retry.tar?{fqn_query(fqn)}", content=b"",
                          headers={NODE_URL: destination(dest_target, "retry.tar")})
    assert response.status_code == 204, response.text
    first, second = dest_target.recorded("PUT")
    assert second.raw_path == first.raw_path
    assert_transformed(inputs, second.body)


def test_direct_put_reset_with_a_one_shot_body_asks_ais_to_retry(client: httpx.Client,
                                                                 dest_target: FakeTarget) -> None:
    # The request body is gone once sent: 503 + Ais-Etl-Retry-Reason makes the target re-send the
    # whole PUT (ext/etl/communicator.go; AIS 4.6+), instead of failing the object.
    dest_target.set_fault("*", Fault(reset=True))
    response = client.put("/src/one-shot.tar", content=image_shard(1),
                          headers={NODE_URL: destination(dest_target, "one-shot.tar")})
    assert response.status_code == 503
    assert response.headers.get("Ais-Etl-Retry-Reason") == "direct-put-transient"


def test_direct_put_destination_stalled_past_obj_timeout_is_504(impatient: Service, dest_target: FakeTarget) -> None:
    dest_target.set_fault("*", Fault(stall=6.0))
    started = time.monotonic()
    response = httpx.put(f"{impatient.url}/src/stalled.tar", content=image_shard(1), timeout=20,
                         headers={NODE_URL: destination(dest_target, "stalled.tar")})
    assert response.status_code == 504
    assert time.monotonic() - started < 5.0


def test_stage_entry_gets_the_output_at_the_same_object_path_with_etl_args(client: httpx.Client,
                                                                            stage: FakeStage) -> None:
    shard = image_shard(2)
    inline = client.put(f"/src/dir/staged.tar?{args_query(ARGS)}", content=shard)
    response = client.put(f"/src/dir/staged.tar?{args_query(ARGS)}", content=shard,
                          headers={NODE_URL: stage.base_url})
    assert response.status_code == 200, response.text
    (put,) = stage.recorded("PUT")
    assert put.raw_path == "/src/dir/staged.tar"
    assert put.query_pairs == [("etl_args", ARGS)]
    assert "ais-node-url" not in put.headers  # header omitted when the rest of the list is empty
    assert put.body == inline.content
    assert response.content == b"stage:" + inline.content  # the stage's 200 body is relayed


def test_stage_entry_gets_the_remaining_list_and_its_204_is_relayed(client: httpx.Client, stage: FakeStage,
                                                                     dest_target: FakeTarget) -> None:
    stage.reply = "delivered"
    rest = destination(dest_target, "via-stage.tar", query="owt=3&uuid=tcb-9")
    response = client.put("/src/via-stage.tar", content=image_shard(1), headers={NODE_URL: f"{stage.base_url},{rest}"})
    assert response.status_code == 204
    (put,) = stage.recorded("PUT")
    assert put.headers["ais-node-url"] == rest
    assert dest_target.recorded() == []  # the stage delivers, not us


def test_stage_empty_200_is_relayed_as_empty_200_not_204(client: httpx.Client, stage: FakeStage) -> None:
    # An empty result of the next stage is still a result (section 4.3, the SDK's known wrinkle).
    stage.reply, stage.payload = "bytes", b""
    response = client.put("/src/empty-stage.tar", content=image_shard(1), headers={NODE_URL: stage.base_url})
    assert response.status_code == 200
    assert response.content == b""


def test_stage_error_is_propagated(client: httpx.Client, stage: FakeStage) -> None:
    stage.set_fault("/src/stage-err.tar", Fault(status=422, body=b"stage two: sample k failed"))
    response = client.put("/src/stage-err.tar", content=image_shard(1), headers={NODE_URL: stage.base_url})
    assert response.status_code == 422
    assert "stage two: sample k failed" in response.text


def test_two_stage_pipeline_delivers_to_the_destination(client: httpx.Client, service: Service, disk: AisDisk,
                                                        dest_target: FakeTarget) -> None:
    # A >> B with both stages being this service: A transforms, B gets .npy members (passed through)
    # with the rest of the list, direct-puts to D and answers 204; A answers 204.
    inputs = imagenet_like_members(3)
    fqn = disk.put("src", "pipe.tar", make_tar(inputs))
    inline = client.put(f"/src/pipe.tar?{fqn_query(fqn, ARGS)}", content=b"")
    header = f"{service.url},{destination(dest_target, 'pipe.tar', query='owt=3&uuid=tcb-pipe')}"
    response = client.put(f"/src/pipe.tar?{fqn_query(fqn, ARGS)}", content=b"", headers={NODE_URL: header})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.query_pairs == [("owt", "3"), ("uuid", "tcb-pipe"), ("etl_args", ARGS)]
    assert read_tar(put.body) == read_tar(inline.content)


def test_two_stage_pipeline_relays_the_last_stages_bytes(client: httpx.Client, service: Service) -> None:
    # Inline A >> B (no destination): B's 200 body travels back through A.
    inputs = imagenet_like_members(2)
    response = client.put("/src/pipe-inline.tar", content=make_tar(inputs), headers={NODE_URL: service.url})
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)


def test_two_stage_pipeline_streams_a_shard_larger_than_both_socket_buffers(client: httpx.Client,
                                                                          service: Service) -> None:
    # B answers while it still reads A's output. A hop that sent its whole body before reading B's answer
    # would fill the buffers both ways and hang until the object timeout (transformer/server/duplex.py).
    inputs = imagenet_like_members(48)  # 48 float32 arrays, 29 MB each way
    response = client.put("/src/pipe-large.tar", content=make_tar(inputs), headers={NODE_URL: service.url},
                          timeout=120)
    assert response.status_code == 200, response.text[:300]
    assert len(response.content) > 48 * 3 * 224 * 224 * 4
    assert_transformed(inputs, response.content)


@pytest.mark.parametrize("value", [",http://127.0.0.1:1", "http://127.0.0.1:1,,http://127.0.0.1:2",
                                   "http://127.0.0.1:1, ,http://127.0.0.1:2"])
def test_malformed_ais_node_url_is_400(client: httpx.Client, value: str) -> None:
    response = client.put("/src/bad-header.tar", content=image_shard(1), headers={NODE_URL: value})
    assert response.status_code == 400
    assert NODE_URL.lower() in response.text.lower()


def test_empty_ais_node_url_means_no_pipeline(client: httpx.Client) -> None:
    response = client.put("/src/no-hop.tar", content=image_shard(1), headers={NODE_URL: ""})
    assert response.status_code == 200
    assert read_tar(response.content)


def test_errors_never_reveal_the_etl_secret(client: httpx.Client, impatient: Service, target: FakeTarget,
                                            dest_target: FakeTarget) -> None:
    # The secret in AIS_TARGET_URL guards pod->target object I/O (ais/tgtetl.go); error bodies end up in
    # `ais etl show errors` for any user to read, so URLs in them must not carry it.
    unreachable = f"http://127.0.0.1:{free_port()}/{escaped_uname('dst', 'leak.tar')}?owt=3"
    target.set_fault(uname("src", "leak-503.tar"), Fault(status=503, body=b"busy"))
    target.objects[uname("src", "leak-503.tar")] = image_shard(1)
    dest_target.set_fault("*", Fault(stall=6.0))
    answers = [
        client.get(f"/{escaped_uname('src', 'leak-missing.tar')}"),
        client.get(f"/{escaped_uname('src', 'leak-503.tar')}"),
        httpx.put(f"{impatient.url}/src/leak.tar", content=image_shard(1), headers={NODE_URL: unreachable},
                  timeout=20),
        httpx.put(f"{impatient.url}/src/leak-stall.tar", content=image_shard(1), timeout=20,
                  headers={NODE_URL: destination(dest_target, "leak-stall.tar")}),
    ]
    for response in answers:
        assert response.status_code >= 400
        assert target.secret not in response.text, response.text


def test_skip_applies_to_the_first_stage_only(client: httpx.Client, service: Service, disk: AisDisk,
                                              dest_target: FakeTarget) -> None:
    # A skips the shard's first sample; B gets A's output and etl_args without skip, so it skips nothing more.
    inputs = imagenet_like_members(3)
    fqn = disk.put("src", "pipe-skip.tar", make_tar(inputs))
    skipping = json.dumps({"dtype": "uint8", "skip": 1}, separators=(",", ":"))
    inline = client.put(f"/src/pipe-skip.tar?{fqn_query(fqn, skipping)}", content=b"")
    assert inline.status_code == 200, inline.text
    header = f"{service.url},{destination(dest_target, 'pipe-skip.tar', query='owt=3')}"
    response = client.put(f"/src/pipe-skip.tar?{fqn_query(fqn, skipping)}", content=b"", headers={NODE_URL: header})
    assert response.status_code == 204, response.text
    (put,) = dest_target.recorded("PUT")
    assert put.query_pairs == [("owt", "3"), ("etl_args", ARGS)]
    assert read_tar(put.body) == read_tar(inline.content)
    samples = {name.split(".")[0] for name, _ in read_tar(put.body) if not name.startswith("__etl__")}
    assert samples == {"sample-000001", "sample-000002"}
