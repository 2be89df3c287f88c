"""Faults around the service: callers that leave, upstreams and hops that fail.

Every wait here is bounded by the service's object timeout (``OBJ_TIMEOUT``): retries happen inside
it, then the answer is a clear error naming the object and the reason, never a 204 and never a
cleanly terminated partial tar. A caller that goes away stops the work and releases its thread.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from testbed import inputs
from testbed.fake_ais import FakeStage, Fault
from testbed.ports import free_port
from testbed.service import Service
from testbed.shardgen import make_tar, read_tar
from tests.contract.harness import escaped_uname

from .conftest import OBJ_TIMEOUT, SECRET, HeadAwareTarget, metric, threads_of, wait_until

SHARD = make_tar(inputs.good_members(3))
MARGIN = 3.0  # scheduling slack on a busy 2-core CI machine


def destination(target: HeadAwareTarget, name: str) -> str:
    """An Ais-Node-Url destination entry as AIS writes it (the fake target plays the destination)."""
    return f"{target.base_url}/{escaped_uname('dst', name)}?owt=3&uuid=tcb-1"


# --------------------------------------------------------------------------- caller disconnects


def _put_and_hang_up(service: Service, path: str, body: bytes, read_bytes: int) -> int:
    """Send a whole hpush request on a raw socket, read ``read_bytes`` of the answer, close. Returns bytes read."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
        head = (f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
                "Content-Type: application/x-tar\r\n\r\n").encode()
        sock.sendall(head + body)
        got = 0
        while got < read_bytes:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += len(chunk)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    return got


def test_caller_disconnect_mid_stream_stops_the_work_and_releases_the_thread(still_serving: Service) -> None:
    service = still_serving
    samples = 60
    shard = make_tar(inputs.good_members(samples))
    pid = service.process.pid
    assert httpx.put(f"{service.url}/train/warm-up.tar", content=SHARD, timeout=30).status_code == 200
    baseline_threads = threads_of(pid)  # the pool's worker threads exist from here on
    cancelled = metric(service, "etl_shards_total", 'comm="hpush",outcome="cancelled"')
    ok_samples = metric(service, "etl_samples_total", 'outcome="ok"')

    got = _put_and_hang_up(service, "/train/leaver.tar", shard, read_bytes=700_000)  # about one sample
    assert got >= 700_000

    assert wait_until(lambda: metric(service, "etl_inflight_shards") == 0, timeout=10), "the shard job never ended"
    assert metric(service, "etl_shards_total", 'comm="hpush",outcome="cancelled"') == cancelled + 1
    done = metric(service, "etl_samples_total", 'outcome="ok"') - ok_samples
    assert done < samples, f"all {samples} samples were transformed for a caller that left"
    assert wait_until(lambda: threads_of(pid) <= baseline_threads, timeout=5), (threads_of(pid), baseline_threads)


def test_repeated_disconnects_leak_no_threads(still_serving: Service) -> None:
    service = still_serving
    pid = service.process.pid
    shard = make_tar(inputs.good_members(24))
    _put_and_hang_up(service, "/train/warm.tar", shard, read_bytes=10)  # pool threads exist from here on
    assert wait_until(lambda: metric(service, "etl_inflight_shards") == 0, timeout=10)
    baseline = threads_of(pid)
    for i in range(6):
        _put_and_hang_up(service, f"/train/leaver-{i}.tar", shard, read_bytes=10 + i * 100_000)
    assert wait_until(lambda: metric(service, "etl_inflight_shards") == 0, timeout=15)
    assert wait_until(lambda: threads_of(pid) <= baseline, timeout=5), (threads_of(pid), baseline)


def test_caller_disconnect_while_the_upstream_stalls_ends_by_the_object_deadline(
    still_serving: Service, target: HeadAwareTarget
) -> None:
    # A driver thread blocked on a stalled upstream read notices the cancel when the read returns,
    # at the latest at the object deadline: bounded, never leaked.
    target.objects["ais/@#/src/stall-leave.tar"] = SHARD
    target.set_fault("ais/@#/src/stall-leave.tar", Fault(stall=OBJ_TIMEOUT + 5))
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{still_serving.url}/{escaped_uname('src', 'stall-leave.tar')}", timeout=1.0)
    assert wait_until(lambda: metric(still_serving, "etl_inflight_shards") == 0, timeout=OBJ_TIMEOUT + MARGIN)
    assert time.monotonic() - started < OBJ_TIMEOUT + MARGIN + 1


# ---------------------------------------------------------------------------------------- hpull


def test_hpull_upstream_stall_is_a_504_within_the_object_timeout(client: httpx.Client, target: HeadAwareTarget,
                                                                 still_serving: Service) -> None:
    target.objects["ais/@#/src/slow.tar"] = SHARD
    target.set_fault("ais/@#/src/slow.tar", Fault(stall=OBJ_TIMEOUT + 5))
    started = time.monotonic()
    response = client.get(f"/{escaped_uname('src', 'slow.tar')}")
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert "timed out" in response.text and "slow.tar" in response.text and SECRET not in response.text
    assert OBJ_TIMEOUT - 1 < elapsed < OBJ_TIMEOUT + MARGIN


def test_hpull_upstream_reset_mid_body_is_a_502(client: httpx.Client, target: HeadAwareTarget,
                                                still_serving: Service) -> None:
    target.objects["ais/@#/src/reset.tar"] = SHARD
    target.set_fault("ais/@#/src/reset.tar", Fault(drop_after=700))  # inside the first member
    response = client.get(f"/{escaped_uname('src', 'reset.tar')}")
    assert response.status_code == 502, response.text
    assert "reset.tar" in response.text and SECRET not in response.text


def test_hpull_upstream_reset_after_output_started_breaks_the_transfer(client: httpx.Client,
                                                                       target: HeadAwareTarget,
                                                                       still_serving: Service) -> None:
    big = make_tar(inputs.good_members(12))
    target.objects["ais/@#/src/late-reset.tar"] = big
    target.set_fault("ais/@#/src/late-reset.tar", Fault(drop_after=len(big) * 3 // 4))
    try:
        response = client.get(f"/{escaped_uname('src', 'late-reset.tar')}")
    except httpx.RemoteProtocolError:
        return  # output had started: the transfer is cut, never a clean short tar
    assert response.status_code == 502, "a clean 200 would be a truncated shard"


@pytest.mark.parametrize(("upstream", "expected"), [(404, 404), (500, 502), (403, 502)])
def test_hpull_upstream_error_status(upstream: int, expected: int, client: httpx.Client, target: HeadAwareTarget,
                                     still_serving: Service) -> None:
    target.set_fault("ais/@#/src/err.tar", Fault(status=upstream, body=b"upstream says no"))
    response = client.get(f"/{escaped_uname('src', 'err.tar')}")
    assert response.status_code == expected
    assert f"{upstream} upstream says no" in response.text and SECRET not in response.text


# ------------------------------------------------------------------------------------ direct put


def test_direct_put_refused_connection_retries_then_502_never_204(client: httpx.Client,
                                                                  still_serving: Service) -> None:
    entry = f"http://127.0.0.1:{free_port()}/{escaped_uname('dst', 'nowhere.tar')}"
    started = time.monotonic()
    response = client.put("/src/nowhere.tar", content=SHARD, headers={"Ais-Node-Url": entry})
    elapsed = time.monotonic() - started
    # A one-shot body cannot be replayed by us: AIS is asked to re-send it (ext/etl/communicator.go:
    # 503 + Ais-Etl-Retry-Reason).
    assert response.status_code == 503, response.text
    assert response.headers["ais-etl-retry-reason"] == "direct-put-transient"
    assert "ConnectError" in response.text and SECRET not in response.text
    assert elapsed < OBJ_TIMEOUT + MARGIN


def test_direct_put_5xx_is_retried_within_the_deadline_then_propagated(client: httpx.Client,
                                                                       target: HeadAwareTarget,
                                                                       still_serving: Service) -> None:
    target.objects["ais/@#/src/five.tar"] = SHARD  # hpull input: replayable, so we retry ourselves
    target.set_fault("ais/@#/dst/five.tar", Fault(status=500, body=b"destination broken"))
    started = time.monotonic()
    response = client.get(f"/{escaped_uname('src', 'five.tar')}",
                          headers={"Ais-Node-Url": destination(target, "five.tar")})
    elapsed = time.monotonic() - started
    assert response.status_code == 500, response.text
    assert "destination broken" in response.text and SECRET not in response.text
    attempts = [r for r in target.recorded("PUT")]
    assert len(attempts) >= 3, "5xx must be retried"
    assert elapsed < OBJ_TIMEOUT + MARGIN


def test_direct_put_refusal_4xx_is_propagated_at_once(client: httpx.Client, target: HeadAwareTarget,
                                                      still_serving: Service) -> None:
    target.set_fault("ais/@#/dst/denied.tar", Fault(status=403, body=b"bucket is read-only"))
    response = client.put("/src/denied.tar", content=SHARD, headers={"Ais-Node-Url": destination(target, "denied.tar")})
    assert response.status_code == 403
    assert response.text == "bucket is read-only"
    assert len(target.recorded("PUT")) == 1


def test_direct_put_stall_is_a_504_within_the_object_timeout(client: httpx.Client, target: HeadAwareTarget,
                                                             still_serving: Service) -> None:
    target.set_fault("ais/@#/dst/stuck.tar", Fault(stall=OBJ_TIMEOUT + 5))
    started = time.monotonic()
    response = client.put("/src/stuck.tar", content=SHARD, headers={"Ais-Node-Url": destination(target, "stuck.tar")})
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert "timed out" in response.text and SECRET not in response.text
    assert elapsed < OBJ_TIMEOUT + MARGIN


def test_direct_put_success_is_the_only_204(client: httpx.Client, target: HeadAwareTarget,
                                            still_serving: Service) -> None:
    response = client.put("/src/fine.tar", content=SHARD, headers={"Ais-Node-Url": destination(target, "fine.tar")})
    assert response.status_code == 204
    (put,) = target.recorded("PUT")
    assert [n for n, _ in read_tar(put.body)] == ["s00000.npy", "s00000.cls", "s00001.npy", "s00001.cls",
                                                  "s00002.npy", "s00002.cls"]


# -------------------------------------------------------------------------------------- pipeline


def test_next_stage_5xx_is_propagated_with_its_message(client: httpx.Client, stage: FakeStage,
                                                       still_serving: Service) -> None:
    stage.set_fault("*", Fault(status=500, body=b"stage B crashed"))
    started = time.monotonic()
    response = client.put("/src/piped.tar", content=SHARD, headers={"Ais-Node-Url": stage.base_url})
    assert response.status_code in (500, 503), response.text
    assert "stage B crashed" in response.text
    assert time.monotonic() - started < OBJ_TIMEOUT + MARGIN


def test_next_stage_unreachable_is_an_error_never_a_204(client: httpx.Client, target: HeadAwareTarget,
                                                        still_serving: Service) -> None:
    target.objects["ais/@#/src/lonely.tar"] = SHARD
    started = time.monotonic()
    response = client.get(f"/{escaped_uname('src', 'lonely.tar')}",
                          headers={"Ais-Node-Url": f"http://127.0.0.1:{free_port()}"})
    assert response.status_code == 502, response.text
    assert "ConnectError" in response.text
    assert time.monotonic() - started < OBJ_TIMEOUT + MARGIN


def test_next_stage_stall_is_a_504(client: httpx.Client, stage: FakeStage, still_serving: Service) -> None:
    stage.set_fault("*", Fault(stall=OBJ_TIMEOUT + 5))
    started = time.monotonic()
    response = client.put("/src/slow-stage.tar", content=SHARD, headers={"Ais-Node-Url": stage.base_url})
    assert response.status_code == 504, response.text
    assert time.monotonic() - started < OBJ_TIMEOUT + MARGIN
