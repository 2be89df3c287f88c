"""hpull: ``GET /<PathEscape(uname)>``, input from ``etl_fqn`` or fetched from the target (sections 2.1, 2.3)."""

from __future__ import annotations

import json
import time

import httpx

from testbed.fake_ais import AisDisk, FakeTarget, Fault
from testbed.service import Service
from testbed.shardgen import imagenet_like_members, make_tar, read_tar

from .harness import args_query, escaped_uname, fqn_query, uname
from .outputs import assert_transformed, image_shard, plain_members


def test_hpull_fqn_reads_the_local_object_not_the_target(client: httpx.Client, disk: AisDisk,
                                                         target: FakeTarget) -> None:
    inputs = imagenet_like_members(3)
    fqn = disk.put("train", "dir/pull fqn.tar", make_tar(inputs))
    response = client.get(f"/{escaped_uname('train', 'dir/pull fqn.tar')}?{fqn_query(fqn)}")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)
    assert target.recorded("GET") == []


def test_hpull_without_fqn_fetches_the_escaped_uname_from_the_target(client: httpx.Client,
                                                                      target: FakeTarget) -> None:
    inputs = imagenet_like_members(2)
    target.objects[uname("src", "dir/obj x#1.tar")] = make_tar(inputs)
    escaped = escaped_uname("src", "dir/obj x#1.tar")
    assert escaped == "ais%2F@%23%2Fsrc%2Fdir%2Fobj%20x%231.tar"
    response = client.get(f"/{escaped}")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content)
    (fetch,) = target.recorded("GET")
    # One path segment under AIS_TARGET_URL, escaping kept (the Go target calls meta.ParseUname on it).
    assert fetch.raw_path == f"{target.etl_path}/{escaped}"


def test_hpull_fetch_keeps_reserved_characters_in_one_segment(client: httpx.Client, target: FakeTarget) -> None:
    name = "a+b=c&d:e,f;g@h/i j.tar"
    inputs = plain_members(2, "reserved")
    target.objects[uname("src", name)] = make_tar(inputs)
    response = client.get(f"/{escaped_uname('src', name)}")
    assert response.status_code == 200, response.text
    assert read_tar(response.content) == inputs
    (fetch,) = target.recorded("GET")  # the fake answers 400 when the uname is not one segment
    assert fetch.raw_path.startswith(target.etl_path + "/")
    assert "/" not in fetch.raw_path[len(target.etl_path) + 1 :]


def test_hpull_etl_args_are_passed_through(client: httpx.Client, target: FakeTarget) -> None:
    inputs = imagenet_like_members(2)
    target.objects[uname("src", "args.tar")] = make_tar(inputs)
    response = client.get(f"/{escaped_uname('src', 'args.tar')}?{args_query(json.dumps({'dtype': 'uint8'}))}")
    assert response.status_code == 200, response.text
    assert_transformed(inputs, response.content, dtype="uint8")


def test_hpull_missing_object_is_an_error_naming_it(client: httpx.Client, target: FakeTarget) -> None:
    response = client.get(f"/{escaped_uname('src', 'gone.tar')}")
    assert response.status_code in (404, 502)
    assert "gone.tar" in response.text


def test_hpull_fetch_dropped_mid_body_is_502(client: httpx.Client, target: FakeTarget) -> None:
    target.objects[uname("src", "dropped.tar")] = image_shard(2)
    target.set_fault(uname("src", "dropped.tar"), Fault(drop_after=700))
    response = client.get(f"/{escaped_uname('src', 'dropped.tar')}")
    # A truncated upstream body is the upstream's failure, not an unreadable shard (422).
    assert response.status_code == 502
    assert "dropped.tar" in response.text


def test_hpull_fetch_answered_503_is_an_upstream_error(client: httpx.Client, target: FakeTarget) -> None:
    target.objects[uname("src", "busy.tar")] = image_shard(1)
    target.set_fault(uname("src", "busy.tar"), Fault(status=503, body=b"target is busy"))
    response = client.get(f"/{escaped_uname('src', 'busy.tar')}")
    assert response.status_code in (502, 503)
    assert "busy.tar" in response.text


def test_fake_target_refuses_a_wrong_secret_and_a_split_uname(target: FakeTarget) -> None:
    # The fake itself: the checks the tests above rely on are real.
    target.objects[uname("a", "b")] = b"x"
    base = f"{target.base_url}/v1/etl/_object/{target.etl_name}"
    assert httpx.get(f"{base}/WRONG/{escaped_uname('a', 'b')}").status_code == 403
    assert httpx.get(f"{base}/{target.secret}/ais/@%23/a/b").status_code == 400
    assert httpx.get(f"{base}/{target.secret}/{escaped_uname('a', 'b')}").content == b"x"


def test_hpull_fetch_stalled_past_obj_timeout_is_504(impatient: Service, target: FakeTarget) -> None:
    target.objects[uname("src", "slow.tar")] = image_shard(1)
    target.set_fault(uname("src", "slow.tar"), Fault(stall=6.0))
    started = time.monotonic()
    response = httpx.get(f"{impatient.url}/{escaped_uname('src', 'slow.tar')}", timeout=20)
    elapsed = time.monotonic() - started
    assert response.status_code == 504
    assert "slow.tar" in response.text
    assert elapsed < 5.0  # within the 2 s obj_timeout (plus slack), not after the upstream's 6 s


def test_hpull_skip_sends_the_rest_of_the_shard(client: httpx.Client, disk: AisDisk) -> None:
    inputs = imagenet_like_members(4)
    fqn = disk.put("train", "skip.tar", make_tar(inputs))
    seeded = {"preset": "imagenet-train", "dtype": "uint8", "seed": 9}
    whole = client.get(f"/{escaped_uname('train', 'skip.tar')}?{fqn_query(fqn, json.dumps(seeded))}")
    rest = client.get(f"/{escaped_uname('train', 'skip.tar')}?{fqn_query(fqn, json.dumps({**seeded, 'skip': 3}))}")
    assert whole.status_code == rest.status_code == 200, rest.text
    tail = [(n, d) for n, d in read_tar(whole.content) if n.startswith("sample-000003")]
    assert [(n, d) for n, d in read_tar(rest.content) if not n.startswith("__etl__")] == tail  # same draws
    bad = client.get(f"/{escaped_uname('train', 'skip.tar')}?{fqn_query(fqn, json.dumps({'skip': -2}))}")
    assert bad.status_code == 400 and "skip" in bad.text
