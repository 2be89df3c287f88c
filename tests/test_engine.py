"""Ordered parallel map over a shard: order, pass-through, error policies, memory bounds, cancel, deadline."""

from __future__ import annotations

import io
import json
import queue
import random
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest
import webdataset as wds

from testbed.shardgen import jpeg_bytes, make_tar, read_output, read_tar
from transformer import engine
from transformer import pool as pool_module
from transformer.config import Settings
from transformer.engine import ERROR_MANIFEST_NAME, ShardReport, transform_shard
from transformer.errors import Cancelled, InternalError, SampleTransformError, ShardError, TransformerError
from transformer.options import TransformOptions, options_from_mapping
from transformer.pool import TransformPool
from transformer.wire import END_MARKER_FORMAT, END_MARKER_NAME

RunShard = Callable[..., tuple[bytes, ShardReport]]
MakeOptions = Callable[..., TransformOptions]

SMALL = (96, 72)  # small photos keep the suite fast; the pipeline does the same work at any size


def mixed_members(samples: int, bad: dict[int, bytes] | None = None) -> list[tuple[str, bytes]]:
    """Samples with an image + label + metadata; every third one has no image at all."""
    bad = bad or {}
    members = []
    for i in range(samples):
        key = f"s-{i:04d}"
        if i % 3 == 2:
            members += [(f"{key}.cls", b"%d" % i), (f"{key}.txt", b"caption %d" % i)]
            continue
        members += [(f"{key}.jpg", bad.get(i, jpeg_bytes(i, SMALL))), (f"{key}.cls", b"%d" % i),
                    (f"{key}.json", b'{"i": %d}' % i)]
    return members


def expected_names(members: list[tuple[str, bytes]], dropped: set[str] = frozenset()) -> list[str]:
    kept = [n for n, _ in members if n.split(".")[0] not in dropped]
    return [n[: -len(".jpg")] + ".npy" if n.endswith(".jpg") else n for n in kept]


def tar_members(data: bytes, output: bool = True) -> list[tarfile.TarInfo]:
    """An output's members before its end marker (checked: last, counting every member and byte before
    it); with ``output=False``, every member of an input."""
    if output:
        read_output(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return archive.getmembers()[:-1] if output else archive.getmembers()


def slow_transforms(monkeypatch: pytest.MonkeyPatch, seconds: float | Callable[[str], float]) -> dict:
    """Make every sample transform take a while; returns live counters (calls, running, max running)."""
    real = engine.transform_sample
    stats = {"calls": 0, "running": 0, "max_running": 0}
    lock = threading.Lock()

    def slow(sample, *args):
        with lock:
            stats["calls"] += 1
            stats["running"] += 1
            stats["max_running"] = max(stats["max_running"], stats["running"])
        try:
            time.sleep(seconds(sample.key) if callable(seconds) else seconds)
            return real(sample, *args)
        finally:
            with lock:
                stats["running"] -= 1

    monkeypatch.setattr(engine, "transform_sample", slow)
    return stats


# --- order and pass-through -----------------------------------------------------------------------


def test_output_order_equals_input_order_and_other_members_are_byte_identical(
    monkeypatch: pytest.MonkeyPatch, run_shard: RunShard, make_options: MakeOptions
) -> None:
    jitter = random.Random(1)
    delays = {f"s-{i:04d}": jitter.uniform(0, 0.03) for i in range(14)}  # finish out of order
    slow_transforms(monkeypatch, lambda key: delays[key])
    members = mixed_members(14)
    out, report = run_shard(make_tar(members), make_options(seed=1), window=4)

    infos = tar_members(out)
    assert [m.name for m in infos] == expected_names(members)
    original = dict(members)
    for name, data in read_tar(out):
        if not name.endswith(".npy"):
            assert data == original[name], name
    source_infos = {m.name: m for m in tar_members(make_tar(members), output=False)}
    for info in infos:
        if not info.name.endswith(".npy"):
            source = source_infos[info.name]
            assert (info.mode, info.mtime, info.uname) == (source.mode, source.mtime, source.uname)
    assert (report.samples_in, report.samples_out, report.images, report.errors) == (14, 14, 10, [])
    assert ERROR_MANIFEST_NAME not in [m.name for m in infos]


def test_seeded_output_is_byte_identical_whatever_the_window_and_workers(make_options: MakeOptions) -> None:
    data = make_tar(mixed_members(9))
    options = make_options(seed=77)
    outputs = set()
    for workers, window in ((1, 1), (2, 2), (2, 7)):
        pool = TransformPool(workers=workers, max_inflight=8)
        try:
            outputs.add(b"".join(transform_shard(io.BytesIO(data), options, pool, shard="s", object_name="o",
                                                 window=window)))
        finally:
            pool.shutdown()
    assert len(outputs) == 1


def test_samples_without_images_never_reach_the_pool(
    monkeypatch: pytest.MonkeyPatch, run_shard: RunShard, make_options: MakeOptions
) -> None:
    stats = slow_transforms(monkeypatch, 0)
    members = [(f"k{i}.cls", b"1") for i in range(5)] + [("k9.jpg", jpeg_bytes(0, SMALL))]
    out, report = run_shard(make_tar(members), make_options())
    assert stats["calls"] == 1
    assert [n for n, _ in read_tar(out)] == [f"k{i}.cls" for i in range(5)] + ["k9.npy"]


# --- error policies -------------------------------------------------------------------------------

BAD = {1: b"not a jpeg", 4: b""}


def test_skip_drops_failed_samples_and_lists_them_in_the_manifest(
    run_shard: RunShard, make_options: MakeOptions
) -> None:
    members = mixed_members(7, BAD)
    out, report = run_shard(make_tar(members), make_options(on_error="skip"), shard="bucket/shard-3.tar")
    names = [m.name for m in tar_members(out)]
    assert names[:-1] == expected_names(members, dropped={"s-0001", "s-0004"})
    assert names[-1] == ERROR_MANIFEST_NAME  # at the end of the shard
    manifest = json.loads(read_tar(out)[-1][1])
    assert manifest == {
        "shard": "bucket/shard-3.tar",
        "object": "bucket/shard-3.tar",
        "policy": "skip",
        "samples_in": 7,
        "samples_out": 5,
        "errors": [
            {"key": "s-0001", "member": "s-0001.jpg", "reason": manifest["errors"][0]["reason"], "action": "skipped"},
            {"key": "s-0004", "member": "s-0004.jpg", "reason": "empty image member (0 bytes)", "action": "skipped"},
        ],
    }
    assert "not a decodable image" in manifest["errors"][0]["reason"]
    assert (report.samples_in, report.samples_out, len(report.errors)) == (7, 5, 2)


def test_passthrough_keeps_the_original_bytes_of_failed_samples(
    run_shard: RunShard, make_options: MakeOptions
) -> None:
    members = mixed_members(7, BAD)
    out, report = run_shard(make_tar(members), make_options(on_error="passthrough"))
    produced = read_tar(out)
    expected = [n if n.split(".")[0] in ("s-0001", "s-0004") else e for (n, _), e in
                zip(members, expected_names(members))]
    assert [n for n, _ in produced[:-1]] == expected
    produced_map = dict(produced)
    assert produced_map["s-0001.jpg"] == b"not a jpeg" and produced_map["s-0004.jpg"] == b""
    assert produced_map["s-0001.cls"] == b"1"
    manifest = json.loads(produced[-1][1])
    assert [(e["key"], e["action"]) for e in manifest["errors"]] == [("s-0001", "passed-through"),
                                                                    ("s-0004", "passed-through")]
    assert manifest["samples_out"] == 7 and report.samples_out == 7


def test_fail_raises_the_sample_error(run_shard: RunShard, make_options: MakeOptions) -> None:
    with pytest.raises(SampleTransformError) as info:
        run_shard(make_tar(mixed_members(7, BAD)), make_options(on_error="fail"), shard="shard-9.tar")
    assert (info.value.shard, info.value.key, info.value.member) == ("shard-9.tar", "s-0001", "s-0001.jpg")
    assert info.value.status == 422


@pytest.mark.parametrize("policy", ["skip", "passthrough", "fail"])
def test_an_unexpected_exception_fails_the_shard_under_every_policy(
    monkeypatch: pytest.MonkeyPatch, run_shard: RunShard, make_options: MakeOptions, policy: str
) -> None:
    """A bug of ours on a good sample is the pod's failure, not the sample's: no policy skips or passes it."""
    real = engine.transform_sample

    def flaky(sample, *args):
        if sample.key == "s-0003":
            raise RuntimeError("boom")
        return real(sample, *args)

    monkeypatch.setattr(engine, "transform_sample", flaky)
    with pytest.raises(InternalError) as info:
        run_shard(make_tar(mixed_members(5)), make_options(on_error=policy), shard="shard-7.tar")
    message = info.value.message
    assert "shard 'shard-7.tar'" in message and "'s-0003'" in message and "boom" in message, message
    assert "not completed" in message and info.value.status == 500


def test_a_cancelled_task_fails_the_shard(monkeypatch: pytest.MonkeyPatch, run_shard: RunShard,
                                          make_options: MakeOptions) -> None:
    """A sample's task cancelled under it (its pool shut down, its worker process gone) is never a skipped sample."""
    real = engine.transform_sample

    def cancelled(sample, *args):
        if sample.key == "s-0004":
            raise CancelledError()
        return real(sample, *args)

    monkeypatch.setattr(engine, "transform_sample", cancelled)
    with pytest.raises(InternalError, match="'s-0004' was not transformed"):
        run_shard(make_tar(mixed_members(5)), make_options(on_error="skip"))


def test_no_manifest_without_errors_or_when_disabled(run_shard: RunShard) -> None:
    settings = Settings.from_env({"ETL_ERROR_MANIFEST": "false"})
    options = options_from_mapping({"on_error": "skip"}, settings)
    out, report = run_shard(make_tar(mixed_members(4, {0: b"junk"})), options)
    assert len(report.errors) == 1
    assert ERROR_MANIFEST_NAME not in [n for n, _ in read_tar(out)]


def test_webdataset_readers_skip_the_manifest_and_the_end_marker(tmp_path, run_shard: RunShard,
                                                                  make_options: MakeOptions) -> None:
    out, _ = run_shard(make_tar(mixed_members(6, BAD)), make_options(on_error="skip"))
    assert read_tar(out)[-1][0] == ERROR_MANIFEST_NAME
    path = tmp_path / "out.tar"
    path.write_bytes(out)
    decoded = list(wds.WebDataset(str(path), shardshuffle=False).decode())
    assert [s["__key__"] for s in decoded] == ["s-0000", "s-0002", "s-0003", "s-0005"]
    assert all(not k.startswith("__etl") for s in decoded for k in s)


def test_the_end_marker_counts_what_the_shard_holds(run_shard: RunShard, make_options: MakeOptions) -> None:
    import xxhash

    from transformer import __version__
    from transformer.options import settings_digest

    options = make_options(on_error="skip")
    source = make_tar(mixed_members(6, BAD)) + bytes(8192)  # a tar writer's padding past the end-of-archive blocks
    out, report = run_shard(source, options)
    with tarfile.open(fileobj=io.BytesIO(out)) as archive:
        infos = archive.getmembers()
        marker = json.loads(archive.extractfile(infos[-1]).read())
    assert infos[-1].name == END_MARKER_NAME and infos[-2].name == ERROR_MANIFEST_NAME
    # what it was made from: every input byte (the padding too), hashed as AIS's "xxhash2" checksum
    identity = {"size": len(source), "cksum_type": "xxhash2", "cksum": xxhash.xxh64(source, seed=0).hexdigest()}
    assert marker == {"format": END_MARKER_FORMAT, "samples_in": 6, "samples_out": 4, "skipped": 2, "passed_through": 0,
                      "members": len(infos) - 1, "bytes": infos[-1].offset, "input": identity,
                      "settings": settings_digest(options), "version": __version__}
    assert report.samples_out == 4  # neither the manifest nor the marker is a sample
    assert len(json.dumps(marker, indent=1)) < 512  # one tar block: a tail read of 2 KiB holds it


def test_the_settings_digest_follows_every_setting_that_shapes_the_output(make_options: MakeOptions) -> None:
    from transformer.options import settings_digest

    base = settings_digest(make_options(seed=3))
    assert settings_digest(make_options(seed=3)) == base  # stable across requests and processes
    for change in ({"dtype": "float16"}, {"layout": "HWC"}, {"seed": 4}, {"epoch": 1}, {"on_error": "fail"},
                   {"crop_decode": False}, {"dct_scaling": True}, {"skip": 1},
                   {"transforms": [{"Resize": {"size": [8, 8]}}]}):
        assert settings_digest(make_options(**{"seed": 3, **change})) != base, change
    unseeded = settings_digest(make_options())
    assert settings_digest(make_options()) == unseeded  # a seed drawn at random is no setting


def test_the_end_marker_digest_covers_a_compressed_input_as_stored(run_shard: RunShard,
                                                                   make_options: MakeOptions) -> None:
    import gzip

    import xxhash

    stored = gzip.compress(make_tar(mixed_members(3)))
    out, _ = run_shard(stored, make_options())
    with tarfile.open(fileobj=io.BytesIO(out)) as archive:
        marker = json.loads(archive.extractfile(archive.getmembers()[-1]).read())
    assert marker["input"] == {"size": len(stored), "cksum_type": "xxhash2",
                               "cksum": xxhash.xxh64(stored).hexdigest()}


def test_an_input_written_by_this_etl_gets_a_new_marker_not_two(run_shard: RunShard,
                                                                 make_options: MakeOptions) -> None:
    first, _ = run_shard(make_tar(mixed_members(5)), make_options(seed=1))
    second, report = run_shard(first, make_options(seed=1))  # a second stage: nothing left to decode
    assert read_output(second) == read_output(first)
    assert report.samples_in == 5
    names = [m.name for m in tarfile.open(fileobj=io.BytesIO(second)).getmembers()]
    assert names.count(END_MARKER_NAME) == 1 and names[-1] == END_MARKER_NAME


def test_an_input_whose_marker_does_not_match_is_refused(run_shard: RunShard, make_options: MakeOptions) -> None:
    first, _ = run_shard(make_tar(mixed_members(5)), make_options())
    infos = tar_members(first)
    with pytest.raises(ShardError, match="cut.tar.*the end marker counts"):
        run_shard(first[infos[3].offset:], make_options(), shard="cut.tar")  # the first sample gone
    extra = make_tar([("late.cls", b"1")])
    with pytest.raises(ShardError, match="member 'late.cls' after the end marker"):
        run_shard(first[:-1024] + extra, make_options(), shard="late.tar")


def test_skip_writes_the_rest_of_the_shard_byte_for_byte(run_shard: RunShard, make_options: MakeOptions,
                                                         pool: TransformPool) -> None:
    data = make_tar(mixed_members(8))
    crop = [{"RandomResizedCrop": {"size": 16, "antialias": True}}]
    whole, _ = run_shard(data, make_options(seed=5, transforms=crop))
    samples = [(n, d) for n, d in read_output(whole) if not n.startswith("__etl__")]
    for skip in (0, 1, 3, 7, 8, 20):
        rest, report = run_shard(data, make_options(seed=5, skip=skip, transforms=crop))
        keys = sorted({n.split(".")[0] for n, _ in samples})[skip:]
        assert [(n, d) for n, d in read_output(rest) if not n.startswith("__etl__")] == \
            [(n, d) for n, d in samples if n.split(".")[0] in keys]  # the same crops: per-sample seeds
        assert report.samples_in == len(keys)  # the skipped samples are not counted as read
        tar_members(rest)  # its own end marker, counting what it holds
    relayed = b"".join(bytes(c) for c in transform_shard(io.BytesIO(data), make_options(seed=5, skip=3), pool,
                                                          shard="s", object_name="s", window=4,
                                                          writer=lambda chunk: engine.Write.REFUSED))
    direct, _ = run_shard(data, make_options(seed=5, skip=3), shard="s")
    assert relayed == direct  # the relayed path skips the same way


def test_skip_counts_input_samples_not_output_ones(run_shard: RunShard, make_options: MakeOptions) -> None:
    members = mixed_members(7, BAD)  # s-0001 and s-0004 fail and are dropped under on_error=skip
    out, report = run_shard(make_tar(members), make_options(on_error="skip", skip=2))
    names = [m.name for m in tar_members(out)]
    assert names[:-1] == expected_names(members[6:], dropped={"s-0004"})  # s-0000 and s-0001 passed over
    assert (report.samples_in, report.samples_out) == (5, 4)


def test_broken_shard_raises_after_partial_output(run_shard: RunShard, make_options: MakeOptions) -> None:
    data = make_tar(mixed_members(6))
    with pytest.raises(ShardError, match="cut.tar"):
        run_shard(data[: len(data) // 2], make_options(), shard="cut.tar")


# --- memory bounds --------------------------------------------------------------------------------


def test_at_most_window_samples_of_a_shard_are_in_flight(
    monkeypatch: pytest.MonkeyPatch, pool: TransformPool, make_options: MakeOptions
) -> None:
    slow_transforms(monkeypatch, 0.02)
    read_count = 0
    real_read = engine.read_samples

    def counting_read(*args, **kwargs):
        nonlocal read_count
        for sample in real_read(*args, **kwargs):
            read_count += 1
            yield sample

    monkeypatch.setattr(engine, "read_samples", counting_read)
    members = [(f"k{i:02d}.jpg", jpeg_bytes(i, SMALL)) for i in range(16)]
    window = 3
    emitted, in_flight = 0, []
    for piece in transform_shard(io.BytesIO(make_tar(members)), make_options(), pool, shard="s", object_name="s",
                                 window=window):
        if len(piece) >= 3 * 224 * 224 * 4:  # one image payload, yielded as a piece of its own
            in_flight.append(read_count - emitted)  # read from the input but not yet written out
            emitted += 1
    assert emitted == 16
    assert max(in_flight) == window  # the window is used (parallel read-ahead) and never exceeded


def test_max_inflight_bounds_two_concurrent_shards(monkeypatch: pytest.MonkeyPatch, make_options: MakeOptions) -> None:
    stats = slow_transforms(monkeypatch, 0.03)
    pool = TransformPool(workers=2, max_inflight=3)
    outstanding = {"now": 0, "max": 0}
    lock = threading.Lock()

    class CountingTask(pool_module.Task):  # submitted and not yet finished: what holds a slot
        __slots__ = ()

        def __init__(self, fn, args, on_done=None):
            with lock:
                outstanding["now"] += 1
                outstanding["max"] = max(outstanding["max"], outstanding["now"])
            super().__init__(fn, args, on_done)

        def run(self) -> None:
            super().run()
            with lock:
                outstanding["now"] -= 1

    monkeypatch.setattr(pool_module, "Task", CountingTask)
    shards = {name: make_tar([(f"{name}-{i}.jpg", jpeg_bytes(i, SMALL)) for i in range(8)]) for name in "ab"}
    outputs: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        try:
            outputs[name] = b"".join(transform_shard(io.BytesIO(shards[name]), make_options(), pool, shard=name,
                                                     object_name=name, window=4))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=consume, args=(name,)) for name in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        pool.shutdown()
    assert not errors and not any(t.is_alive() for t in threads)
    assert outstanding["max"] == 3  # both shards' windows (4 + 4) compete for 3 slots
    assert stats["max_running"] <= 2
    for name in "ab":
        assert [n for n, _ in read_tar(outputs[name])] == [f"{name}-{i}.npy" for i in range(8)]


def all_slots_free(pool: TransformPool, slots: int, within: float = 3.0) -> bool:
    """Whether all ``slots`` can be taken within ``within`` seconds (then gives them back)."""
    taken = 0
    deadline = time.monotonic() + within
    while taken < slots and time.monotonic() < deadline:
        try:
            pool._slots.get(timeout=0.05)
            taken += 1
        except queue.Empty:
            pass
    for _ in range(taken):
        pool._slots.put(None)
    return taken == slots


def test_cancel_stops_the_work_promptly_and_releases_slots(
    monkeypatch: pytest.MonkeyPatch, make_options: MakeOptions
) -> None:
    stats = slow_transforms(monkeypatch, 0.15)
    pool = TransformPool(workers=2, max_inflight=4)
    try:
        cancel = threading.Event()
        members = [(f"k{i:02d}.jpg", jpeg_bytes(i, SMALL)) for i in range(30)]
        chunks = transform_shard(io.BytesIO(make_tar(members)), make_options(), pool, shard="s", object_name="s",
                                 window=4, cancel=cancel)
        next(chunks)
        cancel.set()
        started = time.monotonic()
        with pytest.raises(Cancelled, match="'s'"):
            for _ in chunks:
                pass
        assert time.monotonic() - started < 1.5  # the rest of the shard would take over 2 s
        assert all_slots_free(pool, 4)
        calls = stats["calls"]
        time.sleep(0.3)
        assert stats["calls"] == calls < 12  # nothing new starts after the cancel
    finally:
        pool.shutdown()


def test_cancel_while_waiting_for_a_slot(make_options: MakeOptions) -> None:
    pool = TransformPool(workers=1, max_inflight=2)
    try:
        for _ in range(2):  # another shard holds every slot
            pool._slots.get(timeout=1)
        cancel = threading.Event()
        outcome: list[BaseException] = []

        def consume() -> None:
            try:
                b"".join(transform_shard(io.BytesIO(make_tar([("k.jpg", jpeg_bytes(0, SMALL))])), make_options(),
                                         pool, shard="s", object_name="s", window=2, cancel=cancel))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        time.sleep(0.2)
        assert thread.is_alive() and not outcome  # blocked on the pool, not failed
        cancel.set()
        thread.join(timeout=2)
        assert not thread.is_alive() and isinstance(outcome[0], Cancelled)
        for _ in range(2):
            pool._slots.put(None)
        assert all_slots_free(pool, 2)
    finally:
        pool.shutdown()


def test_closing_the_output_cancels_pending_samples(monkeypatch: pytest.MonkeyPatch, make_options: MakeOptions) -> None:
    stats = slow_transforms(monkeypatch, 0.1)
    pool = TransformPool(workers=1, max_inflight=6)
    try:
        members = [(f"k{i:02d}.jpg", jpeg_bytes(i, SMALL)) for i in range(20)]
        chunks = transform_shard(io.BytesIO(make_tar(members)), make_options(), pool, shard="s", object_name="s",
                                 window=6)
        next(chunks)
        chunks.close()  # the caller went away (the server closes the generator)
        assert all_slots_free(pool, 6)
        assert stats["calls"] < 6  # queued samples were cancelled, not run
    finally:
        pool.shutdown()


def test_deadline(monkeypatch: pytest.MonkeyPatch, pool: TransformPool, make_options: MakeOptions) -> None:
    slow_transforms(monkeypatch, 0.1)
    members = [(f"k{i:02d}.jpg", jpeg_bytes(i, SMALL)) for i in range(60)]  # 3 s of work on 2 workers
    started = time.monotonic()
    with pytest.raises(TransformerError) as info:
        b"".join(transform_shard(io.BytesIO(make_tar(members)), make_options(), pool, shard="late.tar",
                                 object_name="late.tar", window=4, deadline=time.monotonic() + 0.4))
    assert 0.35 < time.monotonic() - started < 2.5
    assert "late.tar" in info.value.message and "timeout" in info.value.message
    assert all_slots_free(pool, 8)


def test_deadline_already_passed(pool: TransformPool, make_options: MakeOptions) -> None:
    with pytest.raises(TransformerError, match="timeout"):
        b"".join(transform_shard(io.BytesIO(make_tar(mixed_members(3))), make_options(), pool, shard="s",
                                 object_name="s", window=2, deadline=time.monotonic() - 1))


def test_pool_tasks_behave_as_the_engine_expects_of_futures() -> None:
    pool = TransformPool(workers=2, max_inflight=4)
    try:
        ok = pool.submit(sum, [1, 2, 3])
        failed = pool.submit(int, "not a number")
        assert ok.result() == 6 and ok.done()
        with pytest.raises(ValueError, match="not a number"):
            failed.result()
        gate = threading.Event()
        blockers = [pool.submit(gate.wait, 5) for _ in range(2)]  # both threads busy
        skipped = pool.submit(sum, [1])
        skipped.cancel()  # not started yet: never runs
        assert not skipped.done()
        gate.set()
        assert all(b.result() for b in blockers)
        with pytest.raises(CancelledError):
            skipped.result()
        assert all_slots_free(pool, 4)  # every finished or skipped task gave its slot back
    finally:
        pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(sum, [1])


def test_pool_shutdown_skips_queued_tasks_and_stops_its_threads() -> None:
    pool = TransformPool(workers=1, max_inflight=4)
    gate, started = threading.Event(), threading.Event()

    def run() -> bool:
        started.set()
        return gate.wait(5)

    running = pool.submit(run)
    assert started.wait(5)  # the worker holds it before shutdown: a running task is never skipped
    queued = [pool.submit(sum, [i]) for i in range(3)]
    threading.Timer(0.2, gate.set).start()
    pool.shutdown()  # waits for the running task; the queued ones are skipped
    assert running.result() is True
    for task in queued:
        with pytest.raises(CancelledError):
            task.result()
    assert not any(t.is_alive() for t in pool._threads)


# --- written by the transform threads (engine._Relay, used by direct send) --------------------------


class Stream:
    """One output stream written by a relay's ``writer`` (any thread) and by the driver's yields, in order."""

    def __init__(self, refuse: Callable[[int], engine.Write] = lambda _: engine.Write.OK):
        self.parts: list[bytes] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.writing = 0
        self.concurrent = False
        self._refuse, self._calls = refuse, 0

    def writer(self, chunk) -> engine.Write:
        with self.lock:
            self.writing += 1
            self.concurrent |= self.writing > 1
            self._calls += 1
            done = self._refuse(self._calls)
        try:
            if done is not engine.Write.REFUSED:
                self.parts.append(bytes(chunk))
                self.threads.add(threading.current_thread().name)
            return done
        finally:
            with self.lock:
                self.writing -= 1

    def consume(self, chunks) -> bytes:
        for chunk in chunks:
            with self.lock:
                self.concurrent |= self.writing > 0
            self.parts.append(bytes(chunk))
        return b"".join(self.parts)


def relayed(pool: TransformPool, data: bytes, options: TransformOptions, stream: Stream, **kwargs) -> bytes:
    return stream.consume(transform_shard(io.BytesIO(data), options, pool, shard="s", object_name="s", window=6,
                                          writer=stream.writer, **kwargs))


@pytest.mark.parametrize("policy", ["skip", "passthrough"])
def test_relay_writes_the_same_bytes_as_the_driver(pool: TransformPool, make_options: MakeOptions,
                                                   monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    # Transforms finishing out of order, pass-through samples, bad samples and the error manifest.
    slow_transforms(monkeypatch, lambda key: random.Random(key).uniform(0, 0.01))
    members = mixed_members(40, bad={4: b"not a jpeg", 19: b"\xff\xd8 broken"})
    data = make_tar(members)
    options = make_options(seed=3, on_error=policy)
    reference = b"".join(bytes(c) for c in transform_shard(io.BytesIO(data), options, pool, shard="s",
                                                          object_name="s", window=6))
    stream = Stream()
    assert relayed(pool, data, options, stream) == reference
    assert not stream.concurrent  # one writer at a time, never the driver and a transform thread at once
    assert any(name.startswith("transform_") for name in stream.threads)  # the transform threads wrote


@pytest.mark.parametrize("answer", [engine.Write.FULL, engine.Write.REFUSED])
def test_relay_hands_over_to_the_driver_and_back(pool: TransformPool, make_options: MakeOptions,
                                                 monkeypatch: pytest.MonkeyPatch, answer: engine.Write) -> None:
    # Every 5th write finds the socket full (taken) or is refused (not taken): the driver writes the rest of
    # that sample and what is ready after it, then the transform threads go on. Nothing lost or doubled.
    slow_transforms(monkeypatch, lambda key: random.Random(key).uniform(0, 0.01))
    data = make_tar(mixed_members(40))
    options = make_options(seed=3)
    reference = b"".join(bytes(c) for c in transform_shard(io.BytesIO(data), options, pool, shard="s",
                                                          object_name="s", window=6))
    stream = Stream(lambda call: answer if call % 5 == 0 else engine.Write.OK)
    assert relayed(pool, data, options, stream) == reference
    assert not stream.concurrent


def test_relay_raises_a_fail_policy_error_met_by_a_transform_thread(pool: TransformPool,
                                                                    make_options: MakeOptions) -> None:
    data = make_tar(mixed_members(30, bad={13: b"not a jpeg"}))
    stream = Stream()
    with pytest.raises(SampleTransformError, match="s-0013"):
        relayed(pool, data, make_options(on_error="fail"), stream)
    assert not any(b"s-0013" in part for part in stream.parts)  # nothing of the failed sample went out
    assert all_slots_free(pool, 8)


def test_relay_raises_when_the_caller_goes_away_and_stops_writing(pool: TransformPool,
                                                                  make_options: MakeOptions) -> None:
    def gone(call: int) -> engine.Write:
        if call > 6:
            raise Cancelled("caller went away while receiving")
        return engine.Write.OK

    stream = Stream(gone)
    with pytest.raises(Cancelled):
        relayed(pool, make_tar(mixed_members(60)), make_options(), stream)
    written = len(stream.parts)
    time.sleep(0.2)
    assert len(stream.parts) == written  # no transform thread writes after the shard ended
    assert all_slots_free(pool, 8)


def test_relay_closed_early_lets_no_transform_thread_write_after(pool: TransformPool, make_options: MakeOptions,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    slow_transforms(monkeypatch, 0.005)
    stream = Stream(lambda call: engine.Write.REFUSED if call == 1 else engine.Write.OK)
    chunks = transform_shard(io.BytesIO(make_tar(mixed_members(60))), make_options(), pool, shard="s",
                             object_name="s", window=6, writer=stream.writer)
    next(chunks)  # the driver holds the first sample (refused), as jobs does before direct send starts
    chunks.close()
    written = len(stream.parts)
    time.sleep(0.2)
    assert len(stream.parts) == written
    assert all_slots_free(pool, 8)


def test_relay_sends_the_first_output_before_the_window_fills(pool: TransformPool, make_options: MakeOptions) -> None:
    # Before direct send starts every write is refused: the driver must pass the first sample on as soon
    # as it is ready, not once `window` samples have arrived (a slow upload would hold the first byte).
    data = make_tar(mixed_members(30))

    class SlowBody(io.BytesIO):
        def read(self, size=-1):
            time.sleep(0.002)  # an upload trickling in: 512 bytes every 2 ms
            return super().read(min(size, 512) if size and size > 0 else 512)

        readinto = None  # read() only, as an upstream stream without readinto

    body = SlowBody(data)
    stream = Stream(lambda call: engine.Write.REFUSED)
    chunks = transform_shard(body, make_options(seed=3), pool, shard="s", object_name="s", window=64,
                             writer=stream.writer)
    first = next(chunks)
    assert body.tell() < len(data) // 2  # the first output did not wait for the rest of the body
    output = stream.consume([first, *chunks])
    reference = b"".join(bytes(c) for c in transform_shard(io.BytesIO(data), make_options(seed=3), pool, shard="s",
                                                          object_name="s", window=6))
    assert output == reference


def test_relay_close_waits_for_a_write_in_progress_and_none_starts_after() -> None:
    # jobs closes the engine before it closes the socket: a transform thread still inside writer()
    # must be done before close() returns, and no thread may start writing afterwards.
    class Pieces:
        def pieces(self, sample, task):
            yield sample

    entered, release, calls = threading.Event(), threading.Event(), []

    def writer(chunk) -> engine.Write:
        calls.append(chunk)
        entered.set()
        release.wait(10)
        return engine.Write.OK

    relay = engine._Relay(Pieces(), writer)
    for name in (b"first", b"second", b"third"):
        relay.add(name, None)  # no task: ready at once
    writing = threading.Thread(target=relay.pump)
    writing.start()
    assert entered.wait(10)
    closing = threading.Thread(target=relay.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive(), "close() returned while a transform thread was still writing"
    release.set()
    closing.join(10)
    writing.join(10)
    assert not closing.is_alive() and not writing.is_alive()
    relay.pump()  # a task finishing after the close
    assert calls == [b"first"]
    assert relay.unwritten() == 0
