"""Nothing lost through AIS: a sample failing after the first byte, a pod killed mid-shard, a pod that will
not start, and a shard over obj_timeout each end in an error that names the shard, never in a shorter
shard taken as whole; AIS's own view (stage, errors, job) is what the documents say."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from testbed.etl_cluster import EtlCluster
from testbed.shardgen import imagenet_like_members, make_tar
from transformer.client import (
    ErrorCounter,
    EtlRequestError,
    IncompleteCopy,
    IncompleteShard,
    etl_logs,
    make_loader,
    register,
    shard_urls,
    transform_bucket,
    unregister,
)
from transformer.client.reading import open_shard, shard_samples

from .conftest import owner_of, settings
from .test_register import stage, wait_stage

pytestmark = [pytest.mark.ais, pytest.mark.ais_etl]
BAD_AT, SAMPLES = 18, 24


def failing_shard(samples: int = SAMPLES, bad: int = BAD_AT) -> bytes:
    members = []
    for name, data in imagenet_like_members(samples):
        if name == f"sample-{bad:06d}.jpg":
            data = data[:200]  # a JPEG cut short: a decode error for this sample only
        members.append((name, data))
    return make_tar(members)


@pytest.fixture(scope="module")
def failing(etl_client, etls: dict[str, str]) -> dict[str, str]:
    bucket = etl_client.bucket("fail-src")
    bucket.create(exist_ok=True)
    bucket.object("mid-fail.tar").get_writer().put_content(failing_shard())
    for i in range(3):
        bucket.object(f"good-{i}.tar").get_writer().put_content(make_tar(imagenet_like_members(4)))
    return etls


def raw_read(url: str) -> tuple[int, bytes] | str:
    """What a plain HTTP client gets: (status, body), or the name of the error it raised."""
    try:
        response = requests.get(url, timeout=60)
    except requests.RequestException as exc:
        return type(exc).__name__
    return response.status_code, response.content


@pytest.mark.parametrize("comm", ["hpush", "hpull", "ws"])
def test_sample_failing_after_the_first_byte_is_an_error_naming_the_shard(etl_client, failing, comm: str) -> None:
    (url,) = shard_urls(etl_client, "fail-src", failing[comm], names=["mid-fail.tar"],
                        etl_args={"on_error": "fail", "dtype": "uint8"})
    # What AIS hands a reader (docs/contract.md): hpush, the tar so far and AIS's JSON error after it, in a
    # 200 that ends cleanly; ws, the tar so far and the pod's JSON error (the sample named); hpull, the pod's
    # own response cut short.
    got = raw_read(url)
    if comm == "hpull":
        assert got == "ChunkedEncodingError"
    else:
        status, body = got
        assert status == 200 and len(body) > 1_000_000
        tail = body[-400:]
        if comm == "hpush":
            assert b'{"message":"unexpected EOF"' in tail and b'"status":400' in tail
        else:
            assert b"sample 'sample-000018'" in tail and b'"status": 422' in tail
    with pytest.raises(IncompleteShard, match="mid-fail.tar"):
        list(shard_samples(open_shard(url), url))
    errors = ErrorCounter()
    batches = list(make_loader([url], batch_size=4, keys=("npy", "cls"), num_workers=0, shuffle_buffer=0,
                               errors=errors))
    assert errors.count == 1
    assert sum(len(batch[1]) for batch in batches) <= BAD_AT  # never the rest of the shard, never a duplicate
    # AIS's view: the ETL keeps running; hpush records the object among the ETL's errors (ais etl show errors)
    assert stage(etl_client, failing[comm]) == "Running"
    recorded = [(e.obj_name, e.msg) for e in etl_client.etl(failing[comm]).view().obj_errors or []]
    if comm == "hpush":
        assert ("ais://fail-src/mid-fail.tar", "unexpected EOF") in recorded
    else:
        assert not [entry for entry in recorded if entry[0] == "ais://fail-src/mid-fail.tar"], recorded


# What an offline job does with an object whose sample fails after the first byte, by comm type and by
# where the copy goes (the target that holds the source, or the other one, through a direct put): each
# outcome AIS may give, with its message when it records the object's error (docs/contract.md).
# ws to the other target is AIS's race, not a choice: the pod's Binary reply fails the task
# ("task.w is nil"), but transformTask.done() calls wg.Done() before it sets task.err, and the waiter
# returns task.err right after wg.Wait() (ext/etl/websocket_comm.go, aistore v1.5.0: done() and the
# wait at its line 261), so the job records the error on some runs and takes it for a success on others.
OFFLINE_OUTCOMES: dict[tuple[str, str], dict[str, str | None]] = {
    ("hpush", "local"): {"recorded": "unexpected EOF"},  # the target read the cut reply: AIS's own message
    ("hpush", "remote"): {"recorded": "sample 'sample-000018'"},  # the direct put failed: the pod's 422
    ("ws", "local"): {"cut": None},  # ws has no error reply: the cut tar is stored, and no error recorded
    ("ws", "remote"): {"recorded": "expected direct put but got result", "missing": None},  # the race above
}


def destination_for(client, cluster: EtlCluster, comm: str, placement: str) -> str:
    """A new destination bucket where ``mid-fail.tar`` lands on the source's target ("local") or the other."""
    source = owner_of(cluster, "fail-src", "mid-fail.tar")
    for attempt in range(16):
        name = f"fail-dst-{comm}-{placement}-{attempt}"
        bucket = client.bucket(name)
        bucket.create(exist_ok=True)
        bucket.object("mid-fail.tar").get_writer().put_content(b"probe")
        lands = owner_of(cluster, name, "mid-fail.tar")
        bucket.object("mid-fail.tar").delete()
        if (lands == source) == (placement == "local"):
            return name
        bucket.delete()
    raise AssertionError(f"no destination bucket put mid-fail.tar {placement}ly in 16 tries")


@pytest.fixture(scope="module")
def failing_etls(etl_client, failing) -> Iterator[dict[str, str]]:
    """An ETL per comm type that fails a shard on its first bad sample (``on_error=fail``): comm -> name."""
    names = {comm: f"fail-off-{comm}" for comm in ("hpush", "ws")}
    for comm, name in names.items():
        register(etl_client, name, settings(comm, on_error="fail"))
    yield names
    for name in names.values():
        unregister(etl_client, name)


def offline_failure(client, cluster: EtlCluster, name: str, comm: str, placement: str) -> str:
    """Copy ``fail-src`` with the ETL ``name``, failing ``mid-fail.tar`` mid-shard; which way the loss was
    reported: "recorded" (among AIS's errors for the job), or the client's own check of the destination,
    "missing" or "cut" (AIS recorded nothing). A silent success fails."""
    destination = destination_for(client, cluster, comm, placement)
    try:
        found = None
        try:
            job = transform_bucket(client, name, "fail-src", destination, timeout=300,
                                   options={"preset": "imagenet-val", "dtype": "uint8", "seed": 7, "on_error": "fail"})
        except IncompleteCopy as exc:
            found, job = exc, exc.job
        stored = sorted(e.name for e in client.bucket(destination).list_all_objects())

        def evidence() -> str:  # evaluated only when an assertion fails
            logs = "\n".join(f"--- {target}\n{text[-3000:]}" for target, text in etl_logs(client, name).items())
            return f"job {job}\nfound {found}\nstored {stored}\npod logs:\n{logs}"

        assert {"good-0.tar", "good-1.tar", "good-2.tar"} <= set(stored), evidence()
        assert job.verified == 3, evidence()  # the good ones, proven whole from their tails
        recorded = dict(job.object_errors)
        if found is None:
            assert list(recorded) == ["ais://fail-src/mid-fail.tar"], evidence()
            expected = OFFLINE_OUTCOMES[(comm, placement)].get("recorded")
            assert expected is not None and expected in recorded["ais://fail-src/mid-fail.tar"], evidence()
            assert "mid-fail.tar" not in stored, evidence()
            return "recorded"
        assert recorded == {}, evidence()
        if "mid-fail.tar" in stored:
            assert found.missing == [] and list(found.cut) == ["mid-fail.tar"], evidence()
            url = client.bucket(destination).object("mid-fail.tar").get_url()
            with pytest.raises(IncompleteShard, match="mid-fail.tar"):  # the copy's reader refuses it too
                list(shard_samples(open_shard(url), url))
            return "cut"
        assert found.missing == ["mid-fail.tar"] and found.cut == {}, evidence()
        assert "missing: mid-fail.tar" in str(found), evidence()
        return "missing"
    finally:
        client.bucket(destination).delete()


@pytest.mark.parametrize(("comm", "placement"), list(OFFLINE_OUTCOMES))
def test_offline_job_records_the_failing_object_or_the_client_finds_it(etl_client, etl_cluster: EtlCluster,
                                                                       failing_etls, comm: str, placement: str) -> None:
    """Never a silent success, and each case as docs/contract.md says: hpush records the object's error
    (either placement); ws on the same target stores the cut tar and records nothing (the client finds it
    cut); ws with a direct put records it or, by AIS's race (OFFLINE_OUTCOMES), drops it (the client finds
    it missing)."""
    outcome = offline_failure(etl_client, etl_cluster, failing_etls[comm], comm, placement)
    allowed = OFFLINE_OUTCOMES[(comm, placement)]
    assert outcome in allowed, f"{comm} {placement}: {outcome}, expected {' or '.join(allowed)}"


def test_pod_killed_mid_shard_is_an_error_for_the_reader_and_aborts_the_etl(etl_client,
                                                                          etl_cluster: EtlCluster) -> None:
    name = "fail-killed"
    bucket = etl_client.bucket("fail-big")
    bucket.create(exist_ok=True)
    bucket.object("big.tar").get_writer().put_content(make_tar(imagenet_like_members(160, extra=False)))
    register(etl_client, name, settings("hpush"))
    try:
        (url,) = shard_urls(etl_client, "fail-big", name, names=["big.tar"], etl_args={"dtype": "uint8"})
        owner = owner_of(etl_cluster, "fail-big", "big.tar")
        pod = etl_cluster.pod_on_target(name, owner)
        samples = shard_samples(open_shard(url), url)
        got = [next(samples) for _ in range(3)]  # the pod is mid-shard: its output far exceeds the socket buffers
        etl_cluster.kube.oom_kill(pod)
        with pytest.raises(IncompleteShard, match="big.tar") as caught:
            for sample in samples:
                got.append(sample)
        assert len(got) < 160 and caught.value.samples == len(got)
        wait_stage(etl_client, name, "Aborted")
    finally:
        unregister(etl_client, name)


@pytest.mark.parametrize(("env", "reason"), [
    ({"ETL_MAX_IMAGE_PIXELS": "many"},
     "wds-transform serve: invalid setting ETL_MAX_IMAGE_PIXELS: 'many' is not an integer"),
    ({"AIS_CRT": "/nonexistent/client.crt", "AIS_CRT_KEY": "/nonexistent/client.key"}, "AIS_CRT"),
], ids=["bad-setting", "unreadable-certificate"])
def test_pod_that_will_not_start_says_why_and_can_be_registered_again(etl_client, etl_cluster: EtlCluster,
                                                                     env: dict, reason: str) -> None:
    """The reason reaches the user in AIS's init error: the pod's termination message, which Kubernetes
    puts in the container status (here the fake kubelet, from the pod's termination log)."""
    name = "fail-nostart"
    with pytest.raises(EtlRequestError) as caught:
        register(etl_client, name, settings(env=env))
    message = str(caught.value)
    assert reason in message and "state: Terminated" in message and "exitCode: 2" in message, message
    assert stage(etl_client, name) == "Aborted"  # AIS keeps the failed ETL; register replaces it
    fixed = register(etl_client, name, settings())
    assert fixed.created and stage(etl_client, name) == "Running"
    assert unregister(etl_client, name) and stage(etl_client, name) == ""


def test_shard_over_obj_timeout_is_an_error_naming_the_shard(etl_client, etl_cluster: EtlCluster) -> None:
    """A reader slower than obj_timeout allows (AIS's timeout covers the whole body): cut, never whole."""
    name = "fail-timeout"
    register(etl_client, name, settings("hpush", obj_timeout="3s"))
    try:
        bucket = etl_client.bucket("fail-slow")
        bucket.create(exist_ok=True)
        bucket.object("slow.tar").get_writer().put_content(make_tar(imagenet_like_members(40, extra=False)))
        (url,) = shard_urls(etl_client, "fail-slow", name, names=["slow.tar"], etl_args={"dtype": "uint8"})
        stream = open_shard(url)
        delivered = 0
        with pytest.raises(IncompleteShard, match="slow.tar"):
            for _ in shard_samples(stream, url):
                delivered += 1
                time.sleep(0.25)  # 40 samples at 4 per second: 10 s, over the 3 s obj_timeout
        assert delivered < 40
        # what a plain reader gets, and what docs/deploy.md's troubleshooting row names: AIS's timeout after the tar
        tail = b""
        with requests.get(url, stream=True, timeout=60) as response:
            for chunk in response.iter_content(256 * 1024):
                tail = (tail + chunk)[-2000:]
                time.sleep(0.25)
        assert b"Client.Timeout" in tail, tail[-400:]
        assert stage(etl_client, name) == "Running"
    finally:
        unregister(etl_client, name)
