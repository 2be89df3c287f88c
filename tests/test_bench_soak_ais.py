"""The through-AIS soak's own judgement (bench/soak_ais.py, bench/soak_plan.py, bench/soak_report.py), without a
cluster: a read is whole, wrong, short or refused as it really was; each bound fails when what it bounds goes wrong; the
answers AIS gives while an ETL is down are told from a refused shard. The soak itself runs through the
real cluster in tests/ais/etl/test_soak.py."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import soak_plan as plan
from bench.soak_ais import Soak
from bench.soak_report import build_report, load_report, main, markdown, write_report
from bench.soak_watch import HealthProber, Probe, StageWatch
from testbed.httpserve import StaticServer
from testbed.shardgen import make_tar, sealed
from transformer.client import ShardFetchError
from transformer.client.reading import shard_samples


def _shard(samples: int, start: int = 0) -> bytes:
    """A shard as the pod writes it (end marker included): ``samples`` samples of a .npy-like and a .cls."""
    members = []
    for i in range(start, start + samples):
        members += [(f"s{i:04d}.npy", bytes([i % 256]) * 300), (f"s{i:04d}.cls", str(i).encode())]
    return sealed(make_tar(members))


def _digests(data: bytes) -> list[bytes]:
    return [plan.digest(sample) for sample in shard_samples(io.BytesIO(data), "reference")]


@pytest.fixture
def server():
    whole = _shard(4)
    files = {
        "/whole/good.tar": whole,
        "/short/good.tar": _shard(3),  # one sample fewer, with a marker that says so: whole, but short
        "/cut/good.tar": whole[: len(whole) // 2],  # cut inside a member: no end marker
        "/other/good.tar": _shard(4, start=1),  # the same length, other samples
    }
    origin = StaticServer(files)
    yield origin, whole
    origin.close()


def _soak(tmp_path, origin, path: str, reference: list[bytes], refused: bool = False) -> tuple[Soak, plan.Kind]:
    soak = Soak(None, None, plan.Options(comms=("hpush",), patience=0.0), tmp_path)
    kind = plan.Kind("good.tar@0", "good.tar", {"seed": 1}, refused=refused)
    soak.urls[("hpush", kind.name)] = origin.url + path
    soak.references[kind.name] = reference
    return soak, kind


@pytest.mark.parametrize(("path", "delivered", "wrong", "error"), [
    ("/whole/good.tar", 4, 0, None),
    ("/other/good.tar", 4, 4, None),
    ("/short/good.tar", 3, 0, None),
    ("/cut/good.tar", 2, 0, "IncompleteShard"),
])
def test_a_read_counts_what_it_delivered_against_the_reference(tmp_path, server, path, delivered, wrong,
                                                               error) -> None:
    origin, whole = server
    soak, kind = _soak(tmp_path, origin, path, _digests(whole))
    read = soak.read_once("hpush", kind, patient=False)
    assert (read.expected, read.delivered, read.wrong) == (4, delivered, wrong)
    assert (read.error or "").split(":")[0] == (error or "")
    if error:
        assert read.named and read.opens == 3  # the client's reader tried the cut shard three times


def test_a_refused_shard_may_deliver_only_the_first_samples_of_its_whole_read(tmp_path, server) -> None:
    origin, whole = server
    soak, kind = _soak(tmp_path, origin, "/cut/good.tar", _digests(whole), refused=True)
    read = soak.read_once("hpush", kind, patient=False)
    assert read.refused and read.named and read.wrong == 0 and read.delivered == 2 and read.expected == 0
    soak.references[kind.name] = _digests(_shard(4, start=7))
    assert soak.read_once("hpush", kind, patient=False).wrong == 2


def _error(status: int | None, body: str) -> ShardFetchError:
    return ShardFetchError("http://proxy/v1/objects/b/o.tar?etl_name=soak-hpush", body, status)


@pytest.mark.parametrize(("status", "body", "down"), [
    (404, '{"message":"t[x]: soak-hpush does not exist - try starting new ETL with ..."}', True),
    (404, '{"message":"t[x]: soak-ws does not exist - try starting new ETL with ..."}', False),
    (404, '{"message":"object not found"}', False),
    (400, '{"message":"Put \\"http://198.51.100.12:30001/b/o.tar\\": dial tcp 198.51.100.12:30001: connect: '
          'connection refused"}', True),
    (400, '{"message":"trying to execute \\"easy URL\\" via AIS target? (hint: use proxy)"}', True),
    (400, '{"message":"user abort","method":"GET","url_path":"/v1/objects/b/o.tar","status":400}', True),
    (422, "shard 'b/o.tar': not a tar archive", False),
    (400, "invalid etl_args field 'preset': unknown preset", False),
    (None, "connection failed: refused", True),
    (503, "busy", True),
])
def test_what_aisnode_answers_while_the_etl_is_down_is_told_from_a_refusal(status, body, down) -> None:
    assert plan.etl_down(_error(status, body), "soak-hpush") is down


def test_the_gate_holds_until_every_item_ends_and_stop_releases_every_wait() -> None:
    gate, ended = plan.Gate(), []

    def item() -> None:
        with gate.item() as going:
            assert going
            time.sleep(0.3)
            ended.append(time.monotonic())

    import threading

    worker = threading.Thread(target=item)
    worker.start()
    time.sleep(0.05)
    assert gate.hold(timeout=5) and ended  # hold returned only once the item had ended
    waiting = threading.Thread(target=lambda: ended.append(gate.wait(60)))
    waiting.start()
    gate.stop()
    waiting.join(5)
    assert ended[-1] is True
    with gate.item() as going:
        assert not going
    worker.join(5)


def test_a_stage_seen_between_two_polls_is_still_a_transition() -> None:
    watch = StageWatch(client=None, names={"soak-hpush"}, current={"soak-hpush": "Running"})
    watch.observe("soak-hpush", "Aborted")
    watch.observe("soak-hpush", "Aborted")
    watch.observe("soak-hpush", "Initializing")
    assert [(old, new) for _, _, old, new in watch.transitions] == [("Running", "Aborted"), ("Aborted", "Initializing")]


def test_the_prober_probes_the_pods_it_is_given_from_a_process_of_its_own(tmp_path) -> None:
    origin = StaticServer({"/health": b"OK"})
    try:
        host, port = origin.server_address
        prober = HealthProber(tmp_path, interval=0.05)
        prober.set_pods("soak-hpush", [SimpleNamespace(name="soak-hpush-t1", host=host, port=port)])
        time.sleep(1.0)
        prober.set_pods("soak-hpush", [SimpleNamespace(name="soak-hpush-t2", host=host, port=1)])
        time.sleep(0.5)
        probes = prober.stop()
    finally:
        origin.close()
    first = [p for p in probes if p.pod == "soak-hpush-t1"]
    assert first and all(p.ok and 0 <= p.seconds < 5 for p in first)
    assert any(p.pod == "soak-hpush-t2" and not p.ok for p in probes)  # port 1: refused


# ------------------------------------------------------------------------------------------------- the bounds

T0 = 1000.0


def _fake_soak(**changes) -> SimpleNamespace:
    """A soak that went well: 20 whole reads, a kill recovered, two quiet idle readings of every process."""
    options = plan.Options(comms=("hpush",), warm_up=10, quiet_every=60)
    reads = [plan.Read("hpush", "plain", "good-000.tar@0", T0 + i, T0 + i + 0.5, expected=4, delivered=4, opens=1)
             for i in range(20)]
    idle = {"rss": 100 * 2**20, "threads": 10, "fds": 20, "sockets": 8}
    processes = ["proxy", "target1", "target2", "soak-hpush-t1@7"]
    soak = SimpleNamespace(
        options=options, etls={"hpush": "soak-hpush"}, offline_etl="soak-hpush", t0=T0, reads=reads,
        copies=[plan.OfflineCopy(T0 + 1, T0 + 5, job="j", outcome="success", whole=2)],
        kills=[plan.Kill("soak-hpush", "soak-hpush-t1", T0 + 30, aborted_s=3, pods_gone_s=3, running_s=20)],
        quiet=[{"t": T0 + t, "label": label, "drained": True, "hold_s": 0.1,
                "processes": {p: dict(idle) for p in processes}} for t, label in ((12, "warm-up"), (80, "end"))],
        sampler=SimpleNamespace(samples=[{"t": T0 + t, "id": p, **idle} for t in (0, 12, 80) for p in processes],
                                load=[(T0, 1.0, 1.0, 1.0)]),
        stages=SimpleNamespace(transitions=[(T0 + 31, "soak-hpush", "Running", "Aborted")], errors=[]),
        failures=[], exited={}, setup_s=1.0, panics={}, git="abc1234")
    for name, value in changes.items():
        setattr(soak, name, value)
    return soak


def _probes(milliseconds: float = 5.0, ok: bool = True) -> list[Probe]:
    return [Probe(T0 + i * 0.1, T0 + i * 0.1 + milliseconds / 1000, "soak-hpush-t1", ok) for i in range(200)]


def test_a_soak_that_went_well_holds_every_bound(tmp_path) -> None:
    report = build_report(_fake_soak(), _probes(), (1.0, 1.0, 1.0))
    assert report["passed"], report["criteria"]
    assert report["samples"] == {"delivered": 80, "lost": 0, "wrong": 0, "withheld_named": 0}
    assert "| samples delivered | 80: 0 lost, 0 wrong |" in markdown(report)
    assert report["health"]["series"][0] == [0.0, 100, 5.0, 5.0, 5.0]  # 10 s: 100 probes of 5 ms
    write_report(report, tmp_path)
    assert load_report(tmp_path)["passed"]
    assert (tmp_path / "results.png").stat().st_size > 10_000


def _worse(soak: SimpleNamespace, what: str) -> list[Probe]:
    """Make ``soak`` go wrong in one way; the probes of its run."""
    if what == "short shard":
        soak.reads[3].delivered = 3  # whole by the marker, one sample fewer than the reference
    elif what == "wrong sample":
        soak.reads[4].wrong = 1
    elif what == "error not naming the shard":
        soak.reads[5].error, soak.reads[5].delivered = "ConnectionError: reset", 1
    elif what == "error while the ETL is up":
        soak.reads[6].error, soak.reads[6].named, soak.reads[6].delivered = "ShardFetchError: good-000.tar", True, 0
    elif what == "refused shard delivered":
        soak.reads[7].refused, soak.reads[7].expected = True, 0
    elif what == "offline object lost":
        soak.copies[0].lost = ["good-001.tar"]
    elif what == "kill not recovered":
        soak.kills[0].running_s = None
    elif what == "pod process left":
        soak.kills[0].left = 1
    elif what == "aisnode exited":
        soak.exited = {"target1": "target1 exited with 2: panic"}
    elif what == "health p99":
        return _probes(milliseconds=150.0)
    elif what == "health failure":
        return [*_probes(), Probe(T0 + 90, T0 + 90.1, "soak-hpush-t1", False, "ConnectionRefusedError")]
    elif what in ("rss", "threads", "fds"):
        grown = {"rss": 60 * 2**20, "threads": plan.Bounds().thread_slack + 1, "fds": plan.Bounds().fd_slack + 1}[what]
        soak.quiet[-1]["processes"]["target2"][what] += grown
    elif what == "drain":
        soak.quiet[-1]["drained"] = False
    return _probes()


@pytest.mark.parametrize(("what", "criterion"), [
    ("short shard", "samples_delivered_none_lost_or_wrong"),
    ("wrong sample", "samples_delivered_none_lost_or_wrong"),
    ("refused shard delivered", "samples_delivered_none_lost_or_wrong"),
    ("offline object lost", "samples_delivered_none_lost_or_wrong"),
    ("error not naming the shard", "samples_delivered_none_lost_or_wrong every_error_names_its_shard"),
    ("error while the ETL is up", "no_error_while_the_etl_is_up"),
    ("kill not recovered", "every_kill_recovered"),
    ("pod process left", "no_pod_process_outlived_a_kill"),
    ("aisnode exited", "every_aisnode_stayed_up"),
    ("health p99", "health_p99_under_100ms_while_up"),
    ("health failure", "health_p99_under_100ms_while_up"),
    ("rss", "rss_growth_under_50mb"),
    ("threads", "threads_flat"),
    ("fds", "fds_flat"),
    ("drain", "every_worker_ran_and_drained"),
])
def test_each_bound_fails_when_what_it_bounds_goes_wrong(what: str, criterion: str) -> None:
    soak = _fake_soak()
    probes = _worse(soak, what)
    report = build_report(soak, probes, (1.0, 1.0, 1.0))
    assert not report["passed"]
    assert [name for name, held in report["criteria"].items() if not held] == criterion.split()


def test_an_offline_copy_aborted_by_the_kill_of_another_etl_is_not_an_error_while_up() -> None:
    """AIS aborts every offline ETL job when any ETL stops: a copy through a healthy ETL fails then."""
    soak = _fake_soak(etls={"hpush": "soak-hpush", "ws": "soak-ws"})
    soak.kills[0].etl = "soak-ws"
    soak.copies.append(plan.OfflineCopy(T0 + 31, T0 + 33, job="k", outcome="failed", error="IC(notifications) abort",
                                   missing=["good-000.tar"]))
    report = build_report(soak, _probes(), (1.0, 1.0, 1.0))
    assert report["passed"], report["criteria"]
    soak.copies[-1].start, soak.copies[-1].end = T0 + 60, T0 + 62  # after the ws ETL was back: an error while up
    assert not build_report(soak, _probes(), (1.0, 1.0, 1.0))["criteria"]["no_error_while_the_etl_is_up"]


def test_an_error_while_the_etl_is_down_is_named_not_lost_and_a_probe_then_is_left_out() -> None:
    soak = _fake_soak()
    soak.reads[8].start, soak.reads[8].end = T0 + 35, T0 + 36  # inside the kill's window (30 s to 50 s)
    soak.reads[8].error, soak.reads[8].named, soak.reads[8].delivered = "ShardFetchError: good-000.tar 404", True, 1
    probes = [*_probes(), Probe(T0 + 40, T0 + 45, "soak-hpush-t1", False, "ConnectionRefusedError")]
    report = build_report(soak, probes, (1.0, 1.0, 1.0))
    assert report["passed"], report["criteria"]
    assert report["samples"]["withheld_named"] == 3 and report["reads"]["named_errors_etl_down"] == 1
    assert report["kills"][0]["reads_named_errors"] == 1 and report["health"]["left_out_etl_down"] == 1


KEPT = Path(__file__).resolve().parents[1] / "bench" / "results" / "soak-ais"


def test_the_kept_soaks_table_comes_back_from_its_compressed_report(capsys) -> None:
    """The kept 30-minute run (docs/reliability.md's figures) is stored gzipped: its table is rendered again
    from it, row for row. The run predates the count of aisnode's recovered panics: that row renders '-'."""
    report = load_report(KEPT)
    assert (report["samples"]["delivered"], report["health"]["probes_while_up"], report["health"]["p99_ms"]) == (
        313_483, 75_434, 34.9)
    assert main([str(KEPT)]) == 0
    rendered = capsys.readouterr().out.splitlines()
    panics = [line for line in rendered if line.startswith("| panics aisnode's")]
    assert panics == ["| panics aisnode's HTTP server recovered from (a read dropped) | - |"]
    assert [line for line in rendered if line not in panics] == (KEPT / "results.md").read_text().splitlines()


def test_a_killed_pods_processes_are_counted_until_they_are_gone() -> None:
    """``--kill server``'s check: the processes of the pod still alive at the deadline, or 0 as soon as none is."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tree = plan.process_tree(sleeper.pid)
        assert [p.pid for p in tree] == [sleeper.pid]
        assert plan.still_alive(tree, time.monotonic() + 0.5) == 1
        sleeper.kill()
        sleeper.wait()
        started = time.monotonic()
        assert plan.still_alive(tree, started + 10) == 0 and time.monotonic() - started < 1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_kill_and_design_options_reach_the_soak() -> None:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    options = plan.options_from(parser.parse_args(["--processes", "2", "--kill", "server", "--duration", "60"]))
    assert (options.processes, options.kill) == (2, "server")
    assert (plan.Options().processes, plan.Options().kill) == (0, "pod")
