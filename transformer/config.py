"""Service settings, read from the environment in one place and validated at start-up.

Every variable, its default and its meaning is listed in ``VARIABLES`` (docs/settings.md's table is generated
from it: ``wds-transform settings --markdown``). AIS itself sets ``AIS_TARGET_URL`` and ``direct_put``
in the pod (ext/etl/boot.go); everything else is ours.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ConfigError, OptionsError
from .wire import DTYPES, ERROR_POLICIES, LAYOUTS

MAX_INFLIGHT_SHARDS = 8  # samples in flight in a process: this many shards' windows (AIS sends 8 shards at once)
# What AIS requires of the pod, not a choice: it calls 0.0.0.0:8000 through the ETL's service, and its targets
# drop an idle connection after 6 s, so the pod's keep-alive must outlast that (a stale connection is never reused).
HOST = "0.0.0.0"
PORT = 8000
KEEPALIVE_SECONDS = 75
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")

# name -> (default, description). The single source of truth for docs/settings.md's table.
VARIABLES: dict[str, tuple[str, str]] = {
    "ETL_PRESET": ("imagenet-train", "Default preset when etl_args names none: imagenet-train, imagenet-val, "
                   "resize-224."),
    "ETL_TRANSFORMS": ("", "Default transform spec (JSON or YAML list of steps); overrides ETL_PRESET."),
    "ETL_DTYPE": ("float32", "Default output dtype: float32, float16, or uint8 (not normalized)."),
    "ETL_LAYOUT": ("CHW", "Default output layout of image arrays: CHW or HWC."),
    "ETL_ON_ERROR": ("skip", "Default per-sample error policy: skip, fail, or passthrough."),
    "ETL_SEED": ("", "Default augmentation seed; empty means fresh randomness per request."),
    "ETL_IMAGE_EXTS": ("jpg,jpeg,png,webp", "Member extensions (last suffix) decoded as images."),
    "ETL_MASK_EXTS": ("trimap.png,mask.png,seg.png", "Full member extensions treated as masks."),
    "ETL_WORKERS": ("", "Transform threads in all; empty = the CPUs this container may use (cgroup aware)."),
    "ETL_PROCESSES": ("", "Transform worker processes the threads are spread over (each shard is led by one and its "
                      "samples run in all); 0 = the server's own process. Empty = 0 up to 4 workers, else one per 3 "
                      "workers (docs/design.md, \"Cores\"): set it only to choose the other design."),
    "ETL_OBJ_TIMEOUT": ("300s", "Time budget per object: the ETL's obj_timeout, given once (the client's register "
                        "and k8s/etl-spec.yaml write both from one value). A Go duration or seconds."),
    "ETL_WORKER_TIMEOUT": ("20s", "With worker processes: a worker whose heartbeat is this late (stopped, or hung in "
                           "native code), or one of whose samples runs this long, is killed and replaced; the shards "
                           "it led fail by name. Detected within 2 x this (docs/reliability.md)."),
    "ETL_MAX_MEMBER_BYTES": ("268435456", "Largest tar member accepted (bytes); larger fails the shard."),
    "ETL_MAX_SHARD_BYTES": ("17179869184", "Largest shard accepted (bytes, any comm type); larger is refused with 413. "
                            "Also caps ws content messages, which are held in memory whole."),
    "ETL_MAX_IMAGE_PIXELS": ("100000000", "Largest decoded image (width x height); larger is a sample error."),
    "ETL_FQN_ROOTS": ("", "Comma-separated roots etl_fqn must lie under; empty = any AIS mountpath."),
    "ETL_CROP_DECODE": ("true", "Decode only the JPEG region the leading crop/resize steps read, with the full "
                        "decode's pixels (false: decode every image whole; etl_args crop_decode overrides it per "
                        "request)."),
    "ETL_DCT_SCALING": ("false", "true: with crop_decode, decode a JPEG at 1/2, 1/4 or 1/8 scale in the DCT domain "
                        "when the region read is at least twice the output: faster on large images, but not "
                        "torchvision's output (docs/design-decoding.md gives the error); etl_args dct_scaling "
                        "overrides it per request."),
    "ETL_ERROR_MANIFEST": ("true", "Append __etl__/errors.json to shards that lost or kept-as-is samples."),
    "ETL_LOG_LEVEL": ("info", "Log level: debug, info, warning, error."),
    "ETL_TERMINATION_LOG": ("/dev/termination-log", "File `serve` writes the reason into when it cannot start (a bad "
                            "setting), for Kubernetes to show in the container status and AIS in `ais etl init`'s "
                            "error; written only if it exists or the variable is set."),
    "AIS_TARGET_URL": ("", "Set by AIS: the target's ETL object endpoint (hpull fetch, direct put)."),
    "AIS_CRT": ("", "Client certificate (PEM file) the pod presents to AIS targets over https (hpull fetch, "
                "direct put): mutual TLS. Needs AIS_CRT_KEY."),
    "AIS_CRT_KEY": ("", "Private key (PEM file, not encrypted) of AIS_CRT."),
    "AIS_CLIENT_CA": ("", "CA certificate(s) (PEM file or folder) that verify AIS targets' certificates; "
                      "empty = httpx's default bundle (certifi, or SSL_CERT_FILE / SSL_CERT_DIR). /download "
                      "origins are verified with that bundle plus these."),
    "AIS_SKIP_VERIFY_CRT": ("false", "true: do not verify AIS targets' certificates (testing only; /download "
                            "origins are always verified). When unset, the older name AIS_SKIP_VERIFY is read."),
}

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(text: str, name: str) -> float:
    """Seconds from a Go duration ('45s', '5m', '1m30s', '500ms') or a plain number of seconds."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ConfigError(name, f"'{text}' is not a duration like 45s, 5m or 1m30s") from None
        scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
        value = sum(float(n) * scale[u] for n, u in parts)
    if not math.isfinite(value) or value <= 0:  # float() accepts 'nan' and 'inf'
        raise ConfigError(name, "must be a positive, finite duration")
    return value


def processes_for(workers: int) -> int:
    """ETL_PROCESSES' default: none (threads of the server process) up to 4 workers, else one per 3 workers.

    The server process's GIL caps its threads at about 5 cores' worth of work, and relaying a shard
    through a worker process costs about a tenth more CPU per image: up to 4 cores the threads deliver
    more. A transform thread holds its GIL about a quarter of its time, so three threads keep a
    worker's GIL under about three quarters busy (docs/design.md, "Cores: threads, then worker processes").
    """
    return 0 if workers <= 4 else math.ceil(workers / 3)


def process_threads(workers: int, processes: int) -> int:
    """The transform threads of one worker process (``processes`` > 0) or of the server's (0)."""
    return workers if processes == 0 else math.ceil(workers / processes)


def available_cpus() -> int:
    """CPUs this process may use: the affinity mask, capped by the cgroup's CPU quota (a K8s CPU limit), read from
    cgroup v2's ``cpu.max`` or, on a cgroup v1 node, ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cpu_quota() -> float | None:
    """The cgroup's CPU quota in CPUs, or None when there is none (or none can be read)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period  # -1: no quota
    except (OSError, ValueError):
        return None


class _Reader:
    """The environment's values as the settings read them: ``VARIABLES``' default for an unset name, and one way
    of reading each kind (text, an integer with a floor, a choice, a true/false flag), each error naming its
    variable."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def text(self, name: str, default: str | None = None) -> str:
        return self.env.get(name, VARIABLES[name][0] if default is None else default).strip()

    def integer(self, name: str, minimum: int, default: int | None = None) -> int:
        raw = self.text(name)
        if raw == "" and default is not None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(name, f"'{raw}' is not an integer") from None
        if value < minimum:
            raise ConfigError(name, f"must be at least {minimum}")
        return value

    def extensions(self, name: str) -> frozenset[str]:
        """A comma-separated list of file extensions, lower case, without leading dots."""
        return frozenset(e.strip().lower().lstrip(".") for e in self.text(name).split(",") if e.strip())

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        raw = self.text(name)
        if raw not in allowed:
            raise ConfigError(name, f"'{raw}' is not one of {', '.join(allowed)}")
        return raw

    def flag(self, name: str, default: str | None = None) -> bool:
        raw = (self.text(name, default) or "false").lower()
        if raw not in _TRUE + _FALSE:
            raise ConfigError(name, "must be true or false")
        return raw in _TRUE


def cores(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(transform threads, worker processes) from ``ETL_WORKERS`` and ``ETL_PROCESSES``, without importing torch:
    ``serve`` reads them before anything else, to start the workers' fork server first."""
    read = _Reader(os.environ if environ is None else environ)
    workers = read.integer("ETL_WORKERS", 1, default=available_cpus())
    processes = read.integer("ETL_PROCESSES", 0, default=processes_for(workers))
    if processes > workers:
        raise ConfigError("ETL_PROCESSES", f"{processes} processes for {workers} transform threads (ETL_WORKERS): "
                          "each process needs at least one")
    return workers, processes


@dataclass(frozen=True)
class Settings:
    """Validated service settings. Build with ``Settings.from_env()``."""

    preset: str = "imagenet-train"
    transforms: object = None  # parsed default spec, or None to use ``preset``
    dtype: str = "float32"
    layout: str = "CHW"
    on_error: str = "skip"
    seed: int | None = None
    image_exts: frozenset[str] = frozenset({"jpg", "jpeg", "png", "webp"})
    mask_exts: frozenset[str] = frozenset({"trimap.png", "mask.png", "seg.png"})
    workers: int = 1
    processes: int = 0  # transform worker processes (server/processes.py); 0: threads of the server process
    window: int = 4
    max_inflight: int = 8
    obj_timeout: float = 300.0
    worker_timeout: float = 20.0
    max_member_bytes: int = 256 * 2**20
    max_shard_bytes: int = 16 * 2**30
    max_image_pixels: int = 100_000_000
    fqn_roots: tuple[str, ...] = ()
    error_manifest: bool = True
    crop_decode: bool = True
    dct_scaling: bool = False
    direct_send: bool = True  # the output written to the socket by the shard's thread; off only in an A/B benchmark
    log_level: str = "info"
    termination_log: str = "/dev/termination-log"
    ais_target_url: str = ""
    ais_crt: str = ""
    ais_crt_key: str = ""
    ais_client_ca: str = ""
    ais_skip_verify: bool = False
    env: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        read = _Reader(env)
        from .spec import build_pipeline, parse_spec_text  # torch import only when settings are built

        preset = read.text("ETL_PRESET")
        transforms = None
        try:
            build_pipeline(preset, "ETL_PRESET")
            if read.text("ETL_TRANSFORMS"):
                transforms = parse_spec_text(read.text("ETL_TRANSFORMS"), "ETL_TRANSFORMS")
                build_pipeline(transforms, "ETL_TRANSFORMS")
        except OptionsError as exc:
            raise ConfigError(exc.field, exc.reason) from None

        seed = read.integer("ETL_SEED", -(2**63)) if read.text("ETL_SEED") else None
        workers, processes = cores(env)
        window = 2 * workers + 2  # a shard's samples run on every thread, in worker processes too (server/spread.py)
        image_exts = read.extensions("ETL_IMAGE_EXTS")
        if not image_exts:
            raise ConfigError("ETL_IMAGE_EXTS", "needs at least one extension")
        mask_exts = read.extensions("ETL_MASK_EXTS")
        for ext in mask_exts:
            if ext.rsplit(".", 1)[-1] not in image_exts:
                raise ConfigError("ETL_MASK_EXTS", f"'{ext}' does not end in an image extension of ETL_IMAGE_EXTS")
        level = read.text("ETL_LOG_LEVEL").lower()
        if level not in ("debug", "info", "warning", "error"):
            raise ConfigError("ETL_LOG_LEVEL", f"'{level}' is not debug, info, warning or error")
        roots = tuple(os.path.realpath(r.strip()) for r in read.text("ETL_FQN_ROOTS").split(",") if r.strip())
        skip_name = "AIS_SKIP_VERIFY_CRT" if "AIS_SKIP_VERIFY_CRT" in env or "AIS_SKIP_VERIFY" not in env \
            else "AIS_SKIP_VERIFY"
        settings = cls(
            preset=preset,
            transforms=transforms,
            dtype=read.choice("ETL_DTYPE", DTYPES),
            layout=read.choice("ETL_LAYOUT", LAYOUTS),
            on_error=read.choice("ETL_ON_ERROR", ERROR_POLICIES),
            seed=seed,
            image_exts=image_exts,
            mask_exts=mask_exts,
            workers=workers,
            processes=processes,
            window=window,
            # Room for the windows of the 8 shards AIS sends at once (8 ws connections per offline job
            # per target): with fewer slots than the shards' windows, each driver waits for a slot per
            # sample, a wake-up per sample (docs/design.md gives the figure).
            max_inflight=MAX_INFLIGHT_SHARDS * window * max(1, processes),
            obj_timeout=parse_duration(read.text("ETL_OBJ_TIMEOUT"), "ETL_OBJ_TIMEOUT"),
            worker_timeout=parse_duration(read.text("ETL_WORKER_TIMEOUT"), "ETL_WORKER_TIMEOUT"),
            max_member_bytes=read.integer("ETL_MAX_MEMBER_BYTES", 1),
            max_shard_bytes=read.integer("ETL_MAX_SHARD_BYTES", 1),
            max_image_pixels=read.integer("ETL_MAX_IMAGE_PIXELS", 1),
            fqn_roots=roots,
            error_manifest=read.flag("ETL_ERROR_MANIFEST"),
            crop_decode=read.flag("ETL_CROP_DECODE"),
            dct_scaling=read.flag("ETL_DCT_SCALING"),
            log_level=level,
            termination_log=read.text("ETL_TERMINATION_LOG"),
            ais_target_url=read.text("AIS_TARGET_URL").rstrip("/"),
            ais_crt=read.text("AIS_CRT"),
            ais_crt_key=read.text("AIS_CRT_KEY"),
            ais_client_ca=read.text("AIS_CLIENT_CA"),
            ais_skip_verify=read.flag(skip_name, default="false"),
            env=env,
        )
        settings.ais_tls()  # an unreadable or mismatched certificate stops the pod here, naming the variable
        return settings

    def ais_tls(self) -> ssl.SSLContext | bool:
        """TLS for the pod's calls to AIS targets (https ``AIS_TARGET_URL``), for httpx's ``verify``.

        ``True`` (httpx's defaults) when no TLS variable is set. Otherwise a context that verifies the
        target with ``AIS_CLIENT_CA`` (or the usual bundle), or not at all with ``AIS_SKIP_VERIFY_CRT``,
        and presents ``AIS_CRT`` with ``AIS_CRT_KEY`` when the target asks for a client certificate.
        Raises ``ConfigError`` naming the variable at fault.
        """
        if not (self.ais_crt or self.ais_crt_key or self.ais_client_ca or self.ais_skip_verify):
            return True
        if self.ais_crt and not self.ais_crt_key:
            raise ConfigError("AIS_CRT_KEY", "is required with AIS_CRT (the client certificate's private key)")
        if self.ais_crt_key and not self.ais_crt:
            raise ConfigError("AIS_CRT", "is required with AIS_CRT_KEY (the client certificate itself)")
        import httpx

        if self.ais_skip_verify:
            context = httpx.create_ssl_context(verify=False)
        elif self.ais_client_ca:
            context = _verifying_context(self.ais_client_ca)
        else:
            context = httpx.create_ssl_context(verify=True)
        if self.ais_crt:
            _readable("AIS_CRT", self.ais_crt)
            _readable("AIS_CRT_KEY", self.ais_crt_key)
            try:
                ssl.create_default_context(cafile=self.ais_crt)  # parses every certificate in the file
            except ssl.SSLError as exc:
                raise ConfigError("AIS_CRT", f"'{self.ais_crt}' is not a PEM certificate ({exc})") from None
            try:
                # No password prompt on a terminal: an encrypted key fails here instead.
                context.load_cert_chain(self.ais_crt, self.ais_crt_key, password=lambda: b"")
            except ssl.SSLError as exc:
                raise ConfigError("AIS_CRT_KEY", f"'{self.ais_crt_key}' is not the unencrypted PEM private key "
                                  f"of AIS_CRT '{self.ais_crt}' ({exc})") from None
        return context


    def origin_tls(self) -> ssl.SSLContext | bool:
        """TLS for ``/download`` origins, for httpx's ``verify``: any host on the internet or in the
        cluster's network, so always verified (``AIS_SKIP_VERIFY_CRT`` is not applied), against the
        default bundle plus ``AIS_CLIENT_CA``, and never shown the AIS client certificate."""
        if not self.ais_client_ca:
            return True
        import httpx

        self.ais_tls()  # the same checks of AIS_CLIENT_CA, and their messages
        context = httpx.create_ssl_context(verify=True)
        ca = self.ais_client_ca
        context.load_verify_locations(capath=ca) if os.path.isdir(ca) else context.load_verify_locations(cafile=ca)
        return context


def _readable(variable: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(variable, f"cannot read '{path}': {exc.strerror or exc}") from None


def _verifying_context(ca: str) -> ssl.SSLContext:
    """A client context that trusts exactly the CA certificate(s) in ``ca`` (a PEM file or a folder)."""
    if not os.path.isdir(ca):
        _readable("AIS_CLIENT_CA", ca)
    try:
        return ssl.create_default_context(capath=ca) if os.path.isdir(ca) else ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise ConfigError("AIS_CLIENT_CA", f"'{ca}' holds no usable PEM CA certificate ({exc})") from None


def write_termination_log(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Write why the pod could not start to ``ETL_TERMINATION_LOG``; True when written.

    Kubernetes puts that file's content (default path ``/dev/termination-log``, the pod spec's
    ``terminationMessagePath``) in the container's status, and AIS prints it in ``ais etl init``'s
    error. The default path is written only when the file exists (Kubernetes creates it in a
    container), so a local run never creates ``/dev/termination-log``; a path set in the variable is
    written when its folder exists. Read straight from the environment: the settings themselves may be
    what failed. Never raises: a file that cannot be written must not hide the reason.
    """
    env = os.environ if environ is None else environ
    name = "ETL_TERMINATION_LOG"
    path = env.get(name, "").strip()
    if not path:
        path = VARIABLES[name][0]
        if not os.path.isfile(path):
            return False
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message.encode("utf-8")[:4096].decode("utf-8", "ignore"))  # Kubernetes keeps 4096 bytes
        return True
    except (OSError, ValueError):
        return False


def settings_table() -> str:
    """docs/settings.md's settings table, generated from ``VARIABLES``."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, (default, meaning) in VARIABLES.items():
        rows.append(f"| `{name}` | `{default}` | {meaning} |" if default else f"| `{name}` | | {meaning} |")
    return "\n".join(rows)
