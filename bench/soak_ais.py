"""A soak through a real AIS, pods killed as it runs: ``python -m bench.soak --through-ais --duration 1800``.

The path training jobs depend on, for hours: reader -> AIS proxy -> target -> ETL pod -> reader, on
the tests' real cluster (``testbed/etl_cluster.py``: a proxy and two targets in Kubernetes mode,
each ETL pod run by the fake kubelet; in a network namespace of this process, so root or an
unprivileged user namespace). The soak registers ETLs of its own, one per communication type
(imagenet-train, uint8, seeded), and for ``--duration`` seconds:

* inline readers read through each ETL with the client's reader (``whole_shard_samples``: the end
  marker checked, a cut read fetched again and continued). Per ETL, ``--readers`` plain readers (the
  client's defaults: an ETL that is down is an error at once) and as many patient ones (they wait
  for the ETL to come back, up to ``--patience`` seconds, as a loader with long retries would).
  They read good shards in two epochs and hostile shards (``testbed/inputs.py``: broken
  images, decompression bombs, odd member names, gzip, cut tars, not a tar, a sample failing under
  ``on_error=fail``);
* offline copies of the good shards (``transform_bucket``, through the hpush ETL, or the first one);
* every ``--kill-every`` seconds one pod of the next ETL in turn is killed: with ``--kill pod`` every
  process of it (``kube.kill``: SIGKILL, as a node losing it), with ``--kill server`` its server
  process alone (its worker processes must then go by themselves: within 15 s none may be left, and
  a shard in flight is cut, never completed short); AIS aborts that ETL on every target, and the
  soak starts it again as an operator would (``Etl.start``). ``--processes N`` gives each pod N
  transform worker processes, the design of pods with more than 4 CPUs, on any machine.

Every sample delivered is compared with a reference: the first clean read of each shard (seeded ETLs
give the same bytes for the same seed, epoch, object and key; the communication types agree; an
offline copy equals an inline read without ``etl_args``). A read either delivers every sample of
its reference, or ends in an error that names the shard. Samples short of a shard without such an
error are *lost*; a sample unlike its reference is *wrong*.

Every ``--quiet-every`` seconds (and after warm-up, and at the end) the load is held: every reader
finishes its shard and waits, the offline copy and a kill in progress end, the stage polls pause, the
soak closes its own idle connections, and after ``--settle`` seconds RSS, threads and fds of each
aisnode and pod are read. Those idle readings are what the bounds compare (see ``Bounds``);
``bench/soak_watch.py`` has the stage, ``/health`` and ``/proc`` watchers, ``bench/soak_report.py``
the figures, table and plot.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.soak_plan import (
    LEFT_SECONDS,
    SEED,
    Gate,
    Kill,
    Kind,
    OfflineCopy,
    Options,
    Read,
    add_arguments,
    digest,
    etl_down,
    good_name,
    hostile_shards,
    kinds,
    offline_kind,
    options_from,
    process_tree,
    still_alive,
)
from bench.soak_watch import HealthProber, ProcessSampler, StageWatch, etl_stages

# ------------------------------------------------------------------------------------------------- soak


class Soak:
    """The soak on ``cluster`` (an ``EtlCluster``) through ``client``; ``run()`` returns its report."""

    def __init__(self, cluster, client, options: Options, folder: Path, progress=print):
        self.cluster, self.client, self.options, self.folder = cluster, client, options, folder
        self.progress = progress
        self.etls = {comm: f"{options.prefix}-{comm}" for comm in options.comms}
        self.offline_etl = self.etls.get("hpush", next(iter(self.etls.values())))
        self.bucket = f"{options.prefix}-src"
        self.ref_bucket = f"{options.prefix}-ref"
        self.gate = Gate()
        self.lock = threading.Lock()
        self.reads: list[Read] = []
        self.copies: list[OfflineCopy] = []
        self.kills: list[Kill] = []
        self.quiet: list[dict] = []
        self.failures: list[str] = []  # a worker that died: the soak cannot be trusted
        self.exited: dict[str, str] = {}  # aisnode processes that exited, and why
        self.etl_lock = threading.Lock()
        self.warmed = threading.Event()
        self.setup_s = 0.0
        self.panics: dict[str, int] = {}
        self.git = ""
        self.kinds: list[Kind] = []
        self.references: dict[str, list[bytes]] = {}  # kind -> the digests of its samples
        self.urls: dict[tuple[str, str], str] = {}  # (comm, kind) -> URL
        self.t0 = time.monotonic()

    # -- setup ----------------------------------------------------------------------------------------

    def setup(self) -> None:
        from testbed.etl_cluster import settings
        from testbed.shardgen import shard_bytes
        from transformer.client import register, shard_urls

        options = self.options
        hostile = hostile_shards(options.samples)
        bucket = self.client.bucket(self.bucket)
        bucket.create(exist_ok=True)
        for index in range(options.shards):
            bucket.object(good_name(index)).get_writer().put_content(shard_bytes(index, options.samples))
        reference = self.client.bucket(self.ref_bucket)
        reference.create(exist_ok=True)
        for name, shard in hostile.items():
            bucket.object(name).get_writer().put_content(shard.data)
            if shard.whole is not None:  # the same object name: the same seeded draws
                reference.object(name).get_writer().put_content(shard.whole)
        self.kinds = kinds(options, hostile)
        started = time.monotonic()
        design = {"workers": 2, "env": {"ETL_PROCESSES": str(options.processes)}} if options.processes else {}
        for comm, etl in self.etls.items():
            register(self.client, etl, settings(comm, preset="imagenet-train", seed=SEED, obj_timeout="120s",
                                                init_timeout="300s", **design))
        self.progress(f"registered {', '.join(self.etls.values())} in {time.monotonic() - started:.0f} s")
        every = [*self.kinds, *(offline_kind(i) for i in range(options.shards))]
        for comm, etl in self.etls.items():
            for kind in every:
                (self.urls[comm, kind.name],) = shard_urls(self.client, self.bucket, etl, names=[kind.object],
                                                           etl_args=kind.args)
        first = next(iter(self.etls))
        for kind in every:
            self.references[kind.name] = self._reference(kind, self.urls[first, kind.name])
        self.progress(f"references: {len(every)} reads through {self.etls[first]}")

    def _reference(self, kind: Kind, url: str) -> list[bytes]:
        """The digests of the samples a read of ``kind`` must deliver: its first clean read, or for a refused
        shard the whole read it is like (after checking that it is refused, naming the shard)."""
        from transformer.client import shard_urls, whole_shard_samples

        refusal = None
        try:
            samples = [digest(sample) for sample in whole_shard_samples(url, retries=0)]
        except Exception as exc:  # noqa: BLE001
            refusal = exc
        if kind.refused != (refusal is not None) or (refusal is not None and kind.object not in str(refusal)):
            raise RuntimeError(f"setup: the first read of {kind.name} was "
                               f"{refusal or 'whole'}, expected {'a refusal naming it' if kind.refused else 'whole'}")
        if not kind.refused:
            return samples
        if kind.like is None:
            return []
        bucket, args = kind.like
        (like,) = shard_urls(self.client, self.bucket if bucket == "src" else self.ref_bucket,
                             self.etls[next(iter(self.etls))], names=[kind.object], etl_args=args)
        return [digest(sample) for sample in whole_shard_samples(like, retries=0)]

    def teardown(self) -> None:
        from transformer.client import unregister

        for etl in self.etls.values():
            with contextlib.suppress(Exception):
                unregister(self.client, etl)
        copies = [f"{self.options.prefix}-dst-{n}" for n in range(len(self.copies) + 1)]
        for name in [self.bucket, self.ref_bucket, *copies]:
            with contextlib.suppress(Exception):
                self.client.bucket(name).delete(missing_ok=True)

    # -- readers --------------------------------------------------------------------------------------

    def _opener(self, read: Read, etl: str, patient: bool):
        from transformer.client import ShardFetchError
        from transformer.client.reading import open_shard

        def opener(url: str):
            deadline = time.monotonic() + self.options.patience
            while True:
                read.opens += 1
                try:
                    return open_shard(url)
                except ShardFetchError as exc:
                    if not patient or not etl_down(exc, etl) or time.monotonic() > deadline or self.gate.stopped \
                            or self.down():
                        raise
                time.sleep(1.0)

        return opener

    def read_once(self, comm: str, kind: Kind, patient: bool) -> Read:
        from transformer.client import whole_shard_samples

        reference = self.references[kind.name]
        read = Read(comm, "patient" if patient else "plain", kind.name, time.monotonic(),
                    expected=0 if kind.refused else len(reference), refused=kind.refused)
        opener = self._opener(read, self.etls[comm], patient)
        try:
            samples = whole_shard_samples(self.urls[comm, kind.name], opener=opener, retries=5 if patient else 2)
            for position, sample in enumerate(samples):
                read.delivered += 1
                if position >= len(reference) or digest(sample) != reference[position]:
                    read.wrong += 1
        except Exception as exc:  # noqa: BLE001 - every error a reader can see is an outcome
            read.error = f"{exc.__class__.__name__}: {exc}"
            read.named = kind.object in str(exc)
        read.end = time.monotonic()
        return read

    def reader(self, comm: str, patient: bool, number: int) -> None:
        rng = random.Random(f"{self.options.seed}-{comm}-{patient}-{number}")
        weights = [kind.weight for kind in self.kinds]
        try:
            while True:
                kind = rng.choices(self.kinds, weights)[0]
                with self.gate.item() as going:
                    if not going:
                        return
                    read = self.read_once(comm, kind, patient)
                with self.lock:
                    self.reads.append(read)
                if read.error is not None and not read.refused:
                    time.sleep(0.5)  # its ETL is down: no busy loop of failing reads
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"reader {comm}/{number}: {exc.__class__.__name__}: {exc}")

    # -- offline copies -------------------------------------------------------------------------------

    def offline(self) -> None:
        number = 0
        try:
            while not self.gate.wait(self.options.offline_every):
                with self.gate.item() as going:
                    if not going:
                        return
                    copy = self.copy_once(number)
                number += 1
                with self.lock:
                    self.copies.append(copy)
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"offline: {exc.__class__.__name__}: {exc}")

    def copy_once(self, number: int) -> OfflineCopy:
        from transformer.client import transform_bucket
        from transformer.client.reading import shard_samples

        destination = f"{self.options.prefix}-dst-{number}"
        copy = OfflineCopy(time.monotonic())
        with self._offline_turn() as turn:
            copy.start = time.monotonic()
            if not turn:
                copy.outcome, copy.error, copy.end = "skipped", f"{self.offline_etl} not Running", time.monotonic()
                return copy
            try:
                job = transform_bucket(self.client, self.offline_etl, self.bucket, destination, prefix="good-",
                                       options={"preset": "imagenet-train", "dtype": "uint8", "seed": SEED},
                                       timeout=600)
                copy.job, copy.outcome = job.job_id, "success" if job.success else "failed"
                copy.error, copy.object_errors = job.error or "", [name for name, _ in job.object_errors]
            except Exception as exc:  # noqa: BLE001 - a copy that raises told its caller
                copy.outcome, copy.error = "raised", f"{exc.__class__.__name__}: {exc}"
            copy.end = time.monotonic()
        bucket = self.client.bucket(destination)
        try:
            stored = {entry.name for entry in bucket.list_all_objects()}
        except Exception:  # noqa: BLE001 - no destination bucket: nothing was stored
            stored = set()
        for index in range(self.options.shards):
            name = good_name(index)
            reference = self.references[offline_kind(index).name]
            said = copy.outcome != "success" or any(error.endswith(f"/{name}") for error in copy.object_errors)
            if name not in stored:
                copy.missing.append(name)
                if not said:
                    copy.lost.append(name)
                continue
            data = bucket.object(name).get_reader().read_all()
            try:
                got = [digest(sample) for sample in shard_samples(io.BytesIO(data), f"ais://{destination}/{name}")]
            except Exception:  # noqa: BLE001 - a stored shard without a valid end marker
                copy.cut.append(name)
                if not said:
                    copy.lost.append(name)
                continue
            if got == reference:
                copy.whole += 1
            else:
                copy.wrong.append(name)
        with contextlib.suppress(Exception):
            bucket.delete(missing_ok=True)
        return copy

    @contextlib.contextmanager
    def _offline_turn(self):
        """Whether an offline copy may start now, held while it runs.

        AIS 5.0 registers a restarted ETL with its targets before its pod is ready, without the HTTP
        client it calls the pod with: an offline job that starts while the ETL is Initializing
        dereferences that nil client on every target and crashes them (an inline read in that window
        only loses its connection). So, guarded, a copy starts only while the ETL is Running, and the
        ETL is not started again while a copy runs: the operator's rule in docs/reliability.md.
        """
        if not self.options.guard_offline:
            yield True
            return
        deadline = time.monotonic() + self.options.patience
        while time.monotonic() < deadline and not self.down():
            if self._stage(self.offline_etl) == "Running":
                with self.etl_lock:
                    if self._stage(self.offline_etl) == "Running":
                        yield True
                        return
            time.sleep(0.5)
        yield False

    # -- kills ----------------------------------------------------------------------------------------

    def killer(self) -> None:
        rng = random.Random(f"{self.options.seed}-kills")
        order = list(self.etls.values())
        try:
            while not self.warmed.is_set():  # the first kill comes after the warm-up's quiet point
                if self.gate.wait(0.2):
                    return
            if self.gate.wait(2.0):
                return
            turn = 0
            while True:
                with self.gate.item() as going:
                    if not going:
                        return
                    self.kills.append(self.kill(order[turn % len(order)], rng))
                turn += 1
                if self.gate.wait(self.options.kill_every):
                    return
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"killer: {exc.__class__.__name__}: {exc}")

    def kill(self, etl: str, rng: random.Random) -> Kill:
        kube = self.cluster.kube
        pods = sorted(kube.running_pods(etl), key=lambda pod: pod.name)
        if not pods:
            return Kill(etl, "", time.monotonic(), error=f"{etl} has no running pod to kill")
        victim = rng.choice(pods)
        self.prober.set_pods(etl, [])
        kill = Kill(etl, victim.name, time.monotonic())
        pod = process_tree(victim.container.pid)
        self.progress(f"{self._elapsed():6.0f} s: killing {'the server of ' * (self.options.kill == 'server')}"
                      f"pod {victim.name} ({len(pod)} processes)")
        if self.options.kill == "server":
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.container.pid, signal.SIGKILL)
        else:
            kube.kill(victim)
        kill.left = still_alive(pod, kill.at + LEFT_SECONDS)
        if kill.left:
            self.progress(f"{self._elapsed():6.0f} s: {kill.left} processes of pod {victim.name} outlived the kill")

        def wait(condition, timeout: float) -> float | None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not self.down():
                if condition():
                    return round(time.monotonic() - kill.at, 2)
                time.sleep(0.2)
            return None

        kill.aborted_s = wait(lambda: self._stage(etl) == "Aborted", 120)
        kill.pods_gone_s = wait(lambda: not kube.pods_of(etl), 120)
        targets = len(self.cluster.targets)
        with self.etl_lock:  # not while an offline copy runs (see _offline_turn)
            for _ in range(5):
                if self.down():
                    break
                try:
                    self.client.etl(etl).start()
                    break
                except Exception as exc:  # noqa: BLE001 - an operator tries again
                    kill.start_errors.append(f"{exc.__class__.__name__}: {exc}"[:500])
                    time.sleep(2.0)
        kill.running_s = wait(lambda: self._stage(etl) == "Running" and len(kube.running_pods(etl)) == targets, 300)
        if kill.recovered:
            self.prober.set_pods(etl, kube.running_pods(etl))
            self.progress(f"{self._elapsed():6.0f} s: {etl} aborted after {kill.aborted_s} s, running again "
                          f"after {kill.running_s} s")
        else:
            kill.error = f"{etl} not Running with {targets} pods within 300 s of start"
            self.progress(f"{self._elapsed():6.0f} s: {kill.error}")
        return kill

    def node_panics(self) -> dict[str, int]:
        """Per aisnode, the panics its HTTP server recovered from (a reader's connection dropped), from its
        output; a panic elsewhere ends the process (``down``)."""
        return {node.role + ("" if node.role == "proxy" else str(number)): node.output.read_text(errors="replace")
                .count("http: panic serving") for number, node in enumerate(self.cluster.nodes(), 1)}

    def down(self) -> bool:
        """Whether an aisnode has exited (each exit is recorded once, with the end of its output)."""
        for node in self.cluster.nodes():
            code = node.process.poll()
            if code is not None and node.role + str(node.process.pid) not in self.exited:
                self.exited[node.role + str(node.process.pid)] = (
                    f"{node.role} (pid {node.process.pid}) exited with {code}: "
                    + node.output.read_text(errors="replace")[-3000:])
        return bool(self.exited)

    def _stage(self, etl: str) -> str:
        stage = etl_stages(self.client, {etl})[etl]
        self.stages.observe(etl, stage)
        return stage

    # -- quiet points ---------------------------------------------------------------------------------

    def quiet_point(self, label: str) -> None:
        """Hold the load, let it settle, read every process idle, and let the load go on (``run``)."""
        started = time.monotonic()
        drained = self.gate.hold(timeout=600)
        held = time.monotonic() - started
        self.stages.pause()
        # The soak's own idle keep-alive connections (the SDK's pool, responses not yet collected) would be
        # counted among aisnode's sockets: close them, so that what is read is AIS's and the pods' own.
        gc.collect()
        with contextlib.suppress(AttributeError):  # aistore 2.0.0's session pool
            self.client._request_client.session_manager.session.close()
        time.sleep(self.options.settle)
        readings = self.sampler.sample()
        self.stages.resume()
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # who holds the sockets, for a reader
            sockets = subprocess.run(["ss", "-tanp"], capture_output=True, text=True, timeout=30).stdout
            with open(self.folder / "quiet-sockets.txt", "a") as out:
                out.write(f"--- {self._elapsed():.0f} s ({label})\n" + "".join(
                    line + "\n" for line in sockets.splitlines() if "aisnode" in line or "python" in line))
        self.warmed.set()
        self.quiet.append({"t": time.monotonic(), "label": label, "drained": drained, "hold_s": round(held, 1),
                           "processes": readings})
        self.progress(f"{self._elapsed():6.0f} s: quiet point ({label}) after {held:.0f} s of draining")

    # -- the run --------------------------------------------------------------------------------------

    def processes(self) -> dict[str, int]:
        """What the sampler reads: each aisnode by role, each running pod of the soak by name and pid."""
        found = {"proxy": self.cluster.proxy.process.pid}
        for number, target in enumerate(self.cluster.targets, 1):
            found[f"target{number}"] = target.process.pid
        for etl in self.etls.values():
            for pod in self.cluster.kube.running_pods(etl):
                found[f"{pod.name}@{pod.pid}"] = pod.pid
        return found

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> dict:
        loadavg_start = os.getloadavg()
        # The readers' warnings (a cut shard read again) go to a file of the run, not to the terminal.
        client_log = logging.getLogger("transformer.client")
        handler = logging.FileHandler(self.folder / "client.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        client_log.addHandler(handler)
        propagate, client_log.propagate = client_log.propagate, False
        try:
            return self._run(loadavg_start)
        finally:
            client_log.removeHandler(handler)
            client_log.propagate = propagate
            handler.close()

    def _run(self, loadavg_start: tuple[float, float, float]) -> dict:
        from bench.soak_report import build_report
        from bench.stamp import git_state

        options = self.options
        self.git = git_state()["git"]
        started = time.monotonic()
        self.setup()
        self.setup_s = time.monotonic() - started
        self.prober = HealthProber(self.folder)
        for etl in self.etls.values():
            self.prober.set_pods(etl, self.cluster.kube.running_pods(etl))
        self.stages = StageWatch(self.client, set(self.etls.values()))
        self.stages.start()
        self.sampler = ProcessSampler(self.processes)
        self.sampler.start()
        self.t0 = time.monotonic()
        workers = [threading.Thread(target=self.reader, args=(comm, patient, n), daemon=True,
                                    name=f"soak-{comm}-{'patient' if patient else 'plain'}-{n}")
                   for comm in self.etls for patient in (False, True) for n in range(options.readers)]
        workers.append(threading.Thread(target=self.offline, name="soak-offline", daemon=True))
        workers.append(threading.Thread(target=self.killer, name="soak-killer", daemon=True))
        for worker in workers:
            worker.start()
        deadline = self.t0 + options.duration
        next_quiet = self.t0 + options.warm_up
        try:
            while time.monotonic() < deadline and not self.down():
                if time.monotonic() >= next_quiet:
                    self.quiet_point("warm-up" if not self.quiet else "periodic")
                    self.gate.release()
                    next_quiet = time.monotonic() + options.quiet_every
                time.sleep(min(0.5, max(0.0, min(deadline, next_quiet) - time.monotonic())))
            if not self.down():
                self.quiet_point("end")
            else:
                self.progress(f"{self._elapsed():6.0f} s: stopped: {next(iter(self.exited.values()))[:300]}")
        finally:
            self.gate.stop()
            for worker in workers:
                worker.join(timeout=options.patience + 700)
            self.sampler.stop()
            self.stages.stop()
            probes = self.prober.stop()
            self.panics = self.node_panics()
        return build_report(self, probes, loadavg_start)


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    from bench.soak_report import write_report
    from testbed.cluster import install_aisnode
    from testbed.etl_cluster import NODES, start_etl_cluster
    from testbed.netns import enter_network_namespace

    parser = argparse.ArgumentParser(prog="python -m bench.soak --through-ais", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    options = options_from(args)
    binary = install_aisnode(log=lambda message: print(message, file=sys.stderr))
    root = Path(tempfile.mkdtemp(prefix="soak-ais-"))
    namespace = enter_network_namespace(list(NODES.values()))
    report = None
    try:
        with start_etl_cluster(binary, root / "cluster") as cluster:
            soak = Soak(cluster, cluster.client(), options, root, progress=lambda line: print(line, flush=True))
            try:
                report = soak.run()
            finally:
                soak.teardown()
    finally:
        namespace.leave()
        if report is not None and report["passed"] and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:  # the nodes' and pods' logs, the probes, the readers' warnings
            print(f"kept {root} (cluster/: AIS and pod logs; client.log, health-probes.txt)", file=sys.stderr)
    report["command"] = "python -m bench.soak --through-ais " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(report, args.out)
    print((args.out / "results.md").read_text())
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

