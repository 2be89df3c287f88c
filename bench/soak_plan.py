"""The soak through AIS, planned (``bench/soak_ais.py`` runs it): its options and the bounds it must hold, the
kinds of read it makes and their references, the records of what happened (reads, offline copies, kills),
the gate that holds the load at a quiet point, and the command line that sets the options.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

COMMS = ("hpush", "hpull", "ws")
SEED = 11
EPOCHS = (0, 1)
LEFT_SECONDS = 15.0  # a killed pod's processes must all be gone within this


@dataclass(frozen=True)
class Bounds:
    """What the soak must hold, fixed before it runs; ``report.criteria`` checks each.

    * ``/health`` p99 under ``health_p99_ms`` over every probe of a pod whose ETL is up (a probe that
      overlaps the time from a kill until AIS reports the ETL ``Running`` again is left out), and no
      probe of such a pod failing;
    * RSS growth under ``rss_growth_mb``, idle to idle: for an aisnode, from the quiet point after
      warm-up to the last one; for a pod, from its first quiet point (once it has been up for the
      warm-up) to its last;
    * threads and fds *flat*: at every later quiet point, a process has at most ``thread_slack``
      threads and ``fd_slack`` fds more than at that first one (a leak of one per shard, per read or
      per kill grows past them within minutes; Go starts a thread for each blocked system call and
      keeps it, so aisnode may gain a few and then stay).
    """

    health_p99_ms: float = 100.0
    rss_growth_mb: float = 50.0
    thread_slack: int = 4
    fd_slack: int = 4


@dataclass
class Options:
    duration: float = 1800.0
    kill_every: float = 120.0
    quiet_every: float = 120.0
    warm_up: float = 120.0
    settle: float = 8.0  # AIS closes idle keep-alive connections to the pods after 6 s
    shards: int = 12
    samples: int = 8
    readers: int = 1  # plain readers per ETL; as many patient ones
    patience: float = 180.0
    offline_every: float = 20.0
    guard_offline: bool = True  # start offline copies only while the ETL is Running (see Soak._offline_turn)
    comms: tuple[str, ...] = COMMS
    processes: int = 0  # transform worker processes per pod; 0: the pod's own choice for this machine's CPUs
    kill: str = "pod"  # "pod": every process of it; "server": the server process alone
    prefix: str = "soak"
    seed: int = 1
    bounds: Bounds = field(default_factory=Bounds)


# ----------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Kind:
    """One kind of read: an object read with ``args``.

    ``refused``: every read must end in an error naming the shard; the samples it delivers before that
    must be the first samples of the whole read ``like`` names (a bucket, ``"src"`` or ``"ref"``, and
    its args), or none at all when ``like`` is None.
    """

    name: str
    object: str
    args: dict | None
    refused: bool = False
    weight: int = 1
    like: tuple[str, dict | None] | None = None


def good_name(index: int) -> str:
    return f"good-{index:03d}.tar"


@dataclass(frozen=True)
class Hostile:
    """A hostile shard: its bytes, whether the pod refuses it, and the whole shard it was cut from."""

    data: bytes
    refused: bool = False
    whole: bytes | None = None


def hostile_shards(samples: int) -> dict[str, Hostile]:
    """Object name -> hostile shard, from the reliability tests' hostile inputs."""
    import tarfile

    from testbed.inputs import (
        cut_inside_header,
        cut_inside_member,
        garbage_jpeg,
        good_members,
        gzip_tar,
        jpeg_bomb,
        long_name_tar,
        png_bomb,
        truncated_jpeg,
    )
    from testbed.shardgen import make_tar

    good = good_members(samples)
    broken = good[:2] + [("s09001.jpg", truncated_jpeg()), ("s09002.jpg", garbage_jpeg()),
                         ("s09003.png", png_bomb()), ("s09004.jpg", jpeg_bomb()), ("s09005.jpg", b"")] + good[2:]
    whole = make_tar(good)
    names = make_tar(good[:2])[:-1024]  # the end-of-archive blocks come after the odd names
    for member in (long_name_tar(tarfile.GNU_FORMAT, "gnu/" + "n" * 150 + ".cls", b"1"),
                   long_name_tar(tarfile.PAX_FORMAT, "pax/" + "\u00e9" * 120 + ".cls", b"2"),
                   long_name_tar(tarfile.USTAR_FORMAT, "../up.cls", b"3"),
                   long_name_tar(tarfile.USTAR_FORMAT, "dots.in.key.x.cls", b"4")):
        names += member[:-1024]
    names += b"\0" * 1024
    return {
        "hostile-broken-images.tar": Hostile(make_tar(broken)),  # each bad sample skipped, listed in errors.json
        "hostile-gzip.tar": Hostile(gzip_tar(good)),
        "hostile-odd-names.tar": Hostile(names),
        "hostile-not-a-tar.tar": Hostile(b"definitely not a tar\n" * 64, refused=True),
        "hostile-cut-header.tar": Hostile(cut_inside_header(whole, 2 * samples - 3), refused=True, whole=whole),
        "hostile-cut-member.tar": Hostile(cut_inside_member(whole, 2 * samples - 3), refused=True, whole=whole),
    }


def kinds(options: Options, hostile: dict[str, Hostile]) -> list[Kind]:
    """Good shards in each epoch (weighted so that about four reads in five are good), hostile shards,
    and a shard whose broken sample fails it under ``on_error=fail``."""
    args = {"seed": SEED}
    weight = max(1, options.shards // 2)
    out = [Kind(f"{good_name(i)}@{epoch}", good_name(i), {"seed": SEED, "epoch": epoch}, weight=4)
           for i in range(options.shards) for epoch in EPOCHS]
    out += [Kind(name, name, args, refused=shard.refused, weight=weight, like=("ref", args) if shard.whole else None)
            for name, shard in hostile.items()]
    out.append(Kind("hostile-broken-images.tar@fail", "hostile-broken-images.tar", {**args, "on_error": "fail"},
                    refused=True, weight=weight, like=("src", args)))
    return out


def offline_kind(index: int) -> Kind:
    """What an offline copy of a good shard must equal: the ETL's output without ``etl_args``."""
    return Kind(f"{good_name(index)}@offline", good_name(index), None)


def etl_down(error, etl: str) -> bool:
    """Whether a ``ShardFetchError`` says the ETL is down rather than the shard refused.

    What AIS 5.0 answers: between a pod's death and the abort, 400 with the Go error of its call to the
    pod ("dial tcp ...: connect: connection refused"), or for hpull, whose reader is sent to the pod
    itself, no answer; for ws, 400 "user abort" as the ETL is aborted; 404 "<etl> does not exist" once
    it is; while it starts again, a
    dropped connection (hpush, ws) or, for hpull, a redirect back to the target that answers 400 "trying
    to execute "easy URL" via AIS target?" (the pod's address is not known yet); a 5xx while a target
    is busy with it.
    """
    if error.status is None or error.status >= 500:
        return True
    if error.status == 404:
        return f"{etl} does not exist" in error.reason
    return error.status == 400 and any(text in error.reason for text in _ETL_GOING)


_ETL_GOING = ("connect: connection refused", "connection reset by peer", "dial tcp",
              "via AIS target? (hint: use proxy)", '"message":"user abort"')


def digest(sample: dict) -> bytes:
    """A sample's key and members (name and bytes), hashed: what two deliveries of it must share."""
    h = hashlib.blake2b(sample["__key__"].encode(), digest_size=16)
    for extension in sorted(k for k in sample if not k.startswith("__")):
        h.update(b"\0" + extension.encode() + b"\0" + len(sample[extension]).to_bytes(8, "little"))
        h.update(sample[extension])
    return h.digest()


# --------------------------------------------------------------------------------------------- outcomes


@dataclass
class Read:
    """One read of a shard by one reader: what it delivered, and how it ended."""

    comm: str
    reader: str  # "plain" or "patient"
    kind: str
    start: float
    end: float = 0.0
    expected: int = 0  # samples of the reference (0 for a refused shard: it has no whole read)
    delivered: int = 0
    wrong: int = 0
    opens: int = 0  # requests made for it: more than one after a cut or while its ETL was down
    error: str | None = None
    named: bool = False  # the error names the shard
    refused: bool = False


@dataclass
class OfflineCopy:
    """One offline copy of the good shards and what the destination held afterwards."""

    start: float
    end: float = 0.0
    job: str = ""
    outcome: str = ""  # "success", "failed" (AIS's job status) or "raised" (transform_bucket raised)
    error: str = ""
    object_errors: list[str] = field(default_factory=list)
    whole: int = 0  # stored, equal to the reference
    wrong: list[str] = field(default_factory=list)  # stored whole but unlike the reference
    cut: list[str] = field(default_factory=list)  # stored without a valid end marker
    missing: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # missing or cut, and neither the job nor an error said so


@dataclass
class Kill:
    """One pod killed and its ETL brought back: times are seconds after the kill."""

    etl: str
    pod: str
    at: float
    aborted_s: float | None = None  # AIS lists the ETL as Aborted
    pods_gone_s: float | None = None  # AIS deleted every pod of it
    running_s: float | None = None  # started again, Running, one pod per target
    left: int | None = None  # processes of the pod still alive LEFT_SECONDS after the kill
    start_errors: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def recovered(self) -> bool:
        return self.running_s is not None

    @property
    def window(self) -> tuple[float, float]:
        """From the kill until the ETL was Running again (open-ended if it never was)."""
        return self.at, self.at + (self.running_s if self.running_s is not None else 1e9)


def process_tree(pid: int) -> list:
    """The process ``pid`` and every process it started (a pod's server, its fork server and workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def still_alive(processes: list, deadline: float) -> int:
    """How many of ``processes`` are still alive (not zombies) at ``deadline``; returns as soon as none is."""
    import psutil

    def alive() -> int:
        count = 0
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                count += process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        return count

    while (count := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


# ------------------------------------------------------------------------------------------------- gate


class Gate:
    """Lets the workers run, or holds each at its next item so that the processes can be read idle."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._busy = 0
        self.stopped = False

    @contextlib.contextmanager
    def item(self):
        """Wait until the gate is open; yields False once the soak is over."""
        with self._cond:
            while not self._open and not self.stopped:
                self._cond.wait()
            if self.stopped:
                yield False
                return
            self._busy += 1
        try:
            yield True
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def hold(self, timeout: float) -> bool:
        """Close the gate and wait until no item runs; False if one still ran after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._open = False
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.01, deadline - time.monotonic()))
            return not self._busy

    def release(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True once the soak is over."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while not self.stopped and time.monotonic() < deadline:
                self._cond.wait(timeout=deadline - time.monotonic())
            return self.stopped


# ------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Options()
    parser.add_argument("--duration", type=float, default=defaults.duration, help="seconds of load (default 1800)")
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every,
                        help="seconds between two pod kills, after warm-up (default 120)")
    parser.add_argument("--quiet-every", type=float, default=defaults.quiet_every,
                        help="seconds between two quiet points (default 120)")
    parser.add_argument("--warm-up", type=float, default=None, help="seconds before the first quiet point "
                        "(default: a tenth of the duration, at most 120)")
    parser.add_argument("--settle", type=float, default=defaults.settle,
                        help="idle seconds at a quiet point before the processes are read (default 8)")
    parser.add_argument("--shards", type=int, default=defaults.shards, help="good shards (default 12)")
    parser.add_argument("--samples", type=int, default=defaults.samples, help="samples per shard (default 8)")
    parser.add_argument("--readers", type=int, default=defaults.readers,
                        help="plain readers per ETL, and as many patient ones (default 1)")
    parser.add_argument("--patience", type=float, default=defaults.patience,
                        help="seconds a patient reader waits for its ETL to come back (default 180)")
    parser.add_argument("--offline-every", type=float, default=defaults.offline_every,
                        help="seconds between two offline copies (default 20)")
    parser.add_argument("--unguarded-offline", action="store_true",
                        help="start offline copies whatever the ETL's stage, and restart the ETL while one runs "
                             "(crashes AIS 5.0 targets, see docs/reliability.md)")
    parser.add_argument("--comms", default=",".join(COMMS), help="communication types, one ETL each "
                        "(default hpush,hpull,ws)")
    parser.add_argument("--processes", type=int, default=defaults.processes,
                        help="transform worker processes per pod, 2 threads in all (default: the pod's choice)")
    parser.add_argument("--kill", choices=("pod", "server"), default=defaults.kill,
                        help="what a kill ends: every process of the pod, or its server process alone (default pod)")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (AIS and pod logs, the "
                        "probes, the readers' warnings, the sockets at each quiet point) also when every bound held")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "soak-ais",
                        help="folder for results.json.gz, results.md, results.png (default bench/results/soak-ais)")


def options_from(args: argparse.Namespace) -> Options:
    comms = tuple(comm.strip() for comm in args.comms.split(",") if comm.strip())
    unknown = [comm for comm in comms if comm not in COMMS]
    if unknown or not comms:
        raise SystemExit(f"--comms: {', '.join(unknown) or 'none'} is not one of {', '.join(COMMS)}")
    warm_up = args.warm_up if args.warm_up is not None else min(120.0, args.duration / 10)
    return Options(duration=args.duration, kill_every=args.kill_every, quiet_every=args.quiet_every,
                   warm_up=warm_up, settle=args.settle, shards=args.shards, samples=args.samples,
                   readers=args.readers, patience=args.patience, offline_every=args.offline_every, comms=comms,
                   guard_offline=not args.unguarded_offline, processes=args.processes, kill=args.kill)
