"""Service settings: every environment variable parsed and validated, Go durations, cgroup CPU quota."""

from __future__ import annotations

import io
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.tlscerts import TlsFiles, make_tls_files
from transformer import config
from transformer.config import (
    VARIABLES,
    Settings,
    available_cpus,
    parse_duration,
    settings_table,
    write_termination_log,
)
from transformer.engine import ERROR_MANIFEST_NAME
from transformer.errors import ConfigError
from transformer.spec import build_pipeline


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_defaults_match_the_variables_table() -> None:
    settings = Settings.from_env({"ETL_WORKERS": "3"})
    assert settings.preset == VARIABLES["ETL_PRESET"][0] == "imagenet-train"
    assert settings.transforms is None
    assert (settings.dtype, settings.layout, settings.on_error, settings.seed) == ("float32", "CHW", "skip", None)
    assert settings.image_exts == {"jpg", "jpeg", "png", "webp"}
    assert settings.mask_exts == {"trimap.png", "mask.png", "seg.png"}
    assert (settings.workers, settings.window, settings.max_inflight) == (3, 8, 64)
    assert settings.obj_timeout == 300.0
    assert settings.max_member_bytes == 256 * 2**20 and settings.max_image_pixels == 100_000_000
    assert settings.max_shard_bytes == 16 * 2**30
    assert settings.fqn_roots == () and settings.error_manifest is True
    assert settings.log_level == "info" and settings.direct_send is True
    assert settings.ais_target_url == ""


def test_every_variable_is_read(tls_files: TlsFiles) -> None:
    env = {
        "ETL_PRESET": "imagenet-val",
        "ETL_TRANSFORMS": '[{"Resize": {"size": 64}}]',
        "ETL_DTYPE": "float16",
        "ETL_LAYOUT": "HWC",
        "ETL_ON_ERROR": "fail",
        "ETL_SEED": "-12",
        "ETL_IMAGE_EXTS": " JPG, .png ,tif",
        "ETL_MASK_EXTS": "Label.PNG",
        "ETL_WORKERS": "5",
        "ETL_PROCESSES": "2",
        "ETL_OBJ_TIMEOUT": "1m30s",
        "ETL_WORKER_TIMEOUT": "45s",
        "ETL_MAX_MEMBER_BYTES": "1024",
        "ETL_MAX_SHARD_BYTES": "1048576",
        "ETL_MAX_IMAGE_PIXELS": "4096",
        "ETL_FQN_ROOTS": "/ais/mp1, /ais/mp2/../mp3,",
        "ETL_CROP_DECODE": "no",
        "ETL_DCT_SCALING": "Yes",
        "ETL_ERROR_MANIFEST": "No",
        "ETL_LOG_LEVEL": "DEBUG",
        "ETL_TERMINATION_LOG": "/tmp/why",
        "AIS_TARGET_URL": "http://target:8080/v1/etl/_object/x/SECRET/",
        "AIS_CRT": str(tls_files.client_cert),
        "AIS_CRT_KEY": str(tls_files.client_key),
        "AIS_CLIENT_CA": str(tls_files.ca),
        "AIS_SKIP_VERIFY_CRT": "yes",
    }
    assert set(env) == set(VARIABLES)  # this test covers every variable there is
    s = Settings.from_env(env)
    assert s.preset == "imagenet-val"
    assert s.transforms == [{"Resize": {"size": 64}}]
    assert (s.dtype, s.layout, s.on_error, s.seed) == ("float16", "HWC", "fail", -12)
    assert s.image_exts == {"jpg", "png", "tif"} and s.mask_exts == {"label.png"}
    assert (s.workers, s.processes, s.window, s.max_inflight) == (5, 2, 12, 192)  # derived from the workers
    assert (s.obj_timeout, s.worker_timeout) == (90.0, 45.0)
    assert (s.max_member_bytes, s.max_shard_bytes, s.max_image_pixels) == (1024, 2**20, 4096)
    assert s.fqn_roots == (os.path.realpath("/ais/mp1"), os.path.realpath("/ais/mp3"))
    assert s.error_manifest is False and s.crop_decode is False
    assert s.dct_scaling is True
    assert s.log_level == "debug"
    assert s.termination_log == "/tmp/why"
    assert s.ais_target_url == "http://target:8080/v1/etl/_object/x/SECRET"
    assert (s.ais_crt, s.ais_crt_key, s.ais_client_ca) == (env["AIS_CRT"], env["AIS_CRT_KEY"], env["AIS_CLIENT_CA"])
    assert s.ais_skip_verify is True


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETL_DTYPE", "uint8")
    monkeypatch.setenv("ETL_WORKERS", "2")
    settings = Settings.from_env()
    assert settings.dtype == "uint8" and settings.workers == 2
    assert settings.env["ETL_DTYPE"] == "uint8"


def test_window_and_inflight_are_derived_from_the_workers() -> None:
    settings = Settings.from_env({"ETL_WORKERS": "4", "ETL_PROCESSES": "0"})
    assert (settings.window, settings.max_inflight) == (10, 80)  # room for 8 shards' windows
    # A shard's samples run on every thread, in worker processes too; each process has room for 8 windows.
    settings = Settings.from_env({"ETL_WORKERS": "8"})
    assert (settings.processes, settings.window, settings.max_inflight) == (3, 18, 432)


def test_what_ais_requires_is_a_constant_not_a_setting() -> None:
    """0.0.0.0:8000 and a keep-alive above the target's 6 s idle timeout: nothing a user could get wrong."""
    assert (config.HOST, config.PORT) == ("0.0.0.0", 8000) and config.KEEPALIVE_SECONDS > 6
    assert not {"ETL_HOST", "ETL_PORT", "ETL_KEEPALIVE", "ETL_WINDOW", "ETL_MAX_INFLIGHT", "ETL_DIRECT_SEND"} & set(
        VARIABLES)


def test_the_settings_and_the_names_the_package_reads_stay_few() -> None:
    """What a user sets, and nothing else: at most 26 settings, at most 28 ETL_/AIS_ names read anywhere."""
    assert len(VARIABLES) <= 26
    package = Path(config.__file__).parent
    read = {name for path in package.rglob("*.py")
            for name in re.findall(r"[\"']((?:ETL|AIS)_[A-Z0-9_]+)[\"']", path.read_text())}
    assert len(read) <= 28, sorted(read)
    assert set(VARIABLES) <= read


def test_cores_are_read_without_torch_and_agree_with_the_settings() -> None:
    """``serve`` reads the cores before torch is imported (to start the fork server first): one parse, the same."""
    for env in ({"ETL_WORKERS": "8"}, {"ETL_WORKERS": "2", "ETL_PROCESSES": "2"}, {"ETL_WORKERS": "3"}):
        settings = Settings.from_env(env)
        assert config.cores(env) == (settings.workers, settings.processes)
    with pytest.raises(ConfigError, match="ETL_PROCESSES"):
        config.cores({"ETL_WORKERS": "2", "ETL_PROCESSES": "3"})


@pytest.mark.parametrize(
    "variable, value",
    [
        ("ETL_PRESET", "imagenet"),
        ("ETL_PRESET", ""),
        ("ETL_TRANSFORMS", "[{"),
        ("ETL_TRANSFORMS", '[{"Lambda": {}}]'),
        ("ETL_TRANSFORMS", '[{"Resize": {"sizee": 5}}]'),
        ("ETL_TRANSFORMS", "- Normalize: {mean: [0.5], std: [0.5]}\n- Resize: {size: 8}"),
        ("ETL_DTYPE", "float64"),
        ("ETL_DTYPE", "FLOAT32"),
        ("ETL_LAYOUT", "NCHW"),
        ("ETL_ON_ERROR", "ignore"),
        ("ETL_SEED", "abc"),
        ("ETL_SEED", "1.5"),
        ("ETL_IMAGE_EXTS", ""),
        ("ETL_IMAGE_EXTS", " , "),
        ("ETL_MASK_EXTS", "trimap.tif"),
        ("ETL_MASK_EXTS", "mask"),
        ("ETL_WORKERS", "0"),
        ("ETL_WORKERS", "two"),
        ("ETL_OBJ_TIMEOUT", "forever"),
        ("ETL_OBJ_TIMEOUT", "0s"),
        ("ETL_OBJ_TIMEOUT", "nan"),
        ("ETL_MAX_MEMBER_BYTES", "0"),
        ("ETL_MAX_MEMBER_BYTES", "1GB"),
        ("ETL_MAX_SHARD_BYTES", "0"),
        ("ETL_MAX_SHARD_BYTES", "16GiB"),
        ("ETL_MAX_IMAGE_PIXELS", "-5"),
        ("ETL_ERROR_MANIFEST", "maybe"),
        ("ETL_CROP_DECODE", "sometimes"),
        ("ETL_PROCESSES", "-1"),
        ("ETL_LOG_LEVEL", "trace"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"ETL_WORKERS": "2", variable: value})
    assert info.value.variable.startswith(variable), info.value.variable
    assert variable in info.value.message and info.value.reason


@pytest.mark.parametrize("text, expected", [("true", True), ("1", True), ("YES", True), ("False", False),
                                             ("0", False), ("no", False)])
def test_boolean_settings(text: str, expected: bool) -> None:
    assert Settings.from_env({"ETL_ERROR_MANIFEST": text}).error_manifest is expected
    assert Settings.from_env({"ETL_CROP_DECODE": text}).crop_decode is expected
    assert Settings.from_env({"AIS_SKIP_VERIFY_CRT": text}).ais_skip_verify is expected
    assert Settings.from_env({"AIS_SKIP_VERIFY": text}).ais_skip_verify is expected  # the older name


def test_the_newer_skip_verify_name_wins() -> None:
    assert Settings.from_env({"AIS_SKIP_VERIFY_CRT": "false", "AIS_SKIP_VERIFY": "true"}).ais_skip_verify is False
    assert Settings.from_env({}).ais_skip_verify is False
    assert Settings.from_env({}).ais_tls() is True  # nothing set: httpx's own defaults


def test_tls_to_the_target_with_a_client_certificate(tls_files: TlsFiles) -> None:
    settings = Settings.from_env({"AIS_CRT": str(tls_files.client_cert), "AIS_CRT_KEY": str(tls_files.client_key),
                                  "AIS_CLIENT_CA": str(tls_files.ca)})
    context = settings.ais_tls()
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "wds test CA"),),)]
    skipping = Settings.from_env({"AIS_SKIP_VERIFY_CRT": "true", "AIS_CLIENT_CA": str(tls_files.ca)}).ais_tls()
    assert isinstance(skipping, ssl.SSLContext) and skipping.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    "names, variable, reason",
    [
        ({"AIS_CRT": "client_cert"}, "AIS_CRT_KEY", "is required with AIS_CRT"),
        ({"AIS_CRT_KEY": "client_key"}, "AIS_CRT", "is required with AIS_CRT_KEY"),
        ({"AIS_CRT": "missing", "AIS_CRT_KEY": "client_key"}, "AIS_CRT", "cannot read"),
        ({"AIS_CRT": "client_cert", "AIS_CRT_KEY": "missing"}, "AIS_CRT_KEY", "cannot read"),
        ({"AIS_CRT": "not_pem", "AIS_CRT_KEY": "client_key"}, "AIS_CRT", "not a PEM certificate"),
        ({"AIS_CRT": "client_cert", "AIS_CRT_KEY": "other_key"}, "AIS_CRT_KEY", "not the unencrypted PEM private key"),
        ({"AIS_CRT": "client_cert", "AIS_CRT_KEY": "encrypted_key"}, "AIS_CRT_KEY", "not the unencrypted"),
        ({"AIS_CLIENT_CA": "missing"}, "AIS_CLIENT_CA", "cannot read"),
        ({"AIS_CLIENT_CA": "not_pem"}, "AIS_CLIENT_CA", "no usable PEM CA certificate"),
        ({"AIS_SKIP_VERIFY_CRT": "sometimes"}, "AIS_SKIP_VERIFY_CRT", "true or false"),
        ({"AIS_SKIP_VERIFY": "maybe"}, "AIS_SKIP_VERIFY", "true or false"),
    ],
)
def test_bad_tls_settings_name_the_variable(tls_files: TlsFiles, tmp_path, names: dict[str, str], variable: str,
                                           reason: str) -> None:
    (tmp_path / "not.pem").write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(tls_files.client_key), "-aes256", "-passout", "pass:secret",
                    "-out", str(encrypted)], check=True, capture_output=True, timeout=60)
    paths = {"missing": str(tmp_path / "missing.pem"), "not_pem": str(tmp_path / "not.pem"),
             "encrypted_key": str(encrypted)}
    env = {name: paths.get(key) or str(getattr(tls_files, key, key)) for name, key in names.items()}
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert info.value.variable == variable
    assert reason in info.value.reason, info.value.reason


def test_serve_stops_at_start_up_on_a_certificate_without_its_key(tls_files: TlsFiles) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETL_", "AIS_"))}
    env["AIS_CRT"] = str(tls_files.client_cert)
    result = subprocess.run([sys.executable, "-m", "transformer", "serve", "--port", "1"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "invalid setting AIS_CRT_KEY: is required with AIS_CRT" in result.stderr


@pytest.mark.parametrize(("setting", "message"), [
    ({"ETL_DTYPE": "float64"}, "invalid setting ETL_DTYPE: 'float64' is not one of float32, float16, uint8"),
    ({"AIS_CRT": "/nonexistent/crt.pem", "AIS_CRT_KEY": "/nonexistent/key.pem"},
     "invalid setting AIS_CRT: cannot read '/nonexistent/crt.pem': No such file or directory"),
], ids=["bad value", "unreadable certificate"])
def test_serve_writes_why_it_stopped_to_the_termination_log(setting: dict[str, str], message: str,
                                                            tmp_path: Path) -> None:
    # Kubernetes puts this file in the container status, and AIS prints it in `ais etl init`'s error.
    why = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETL_", "AIS_"))}
    env.update(setting, ETL_TERMINATION_LOG=str(why),
               AIS_TARGET_URL="http://10.0.0.5:51081/v1/etl/_object/wds-etl/Ab3dEf9hIjK")
    result = subprocess.run([sys.executable, "-m", "transformer", "serve", "--port", "1"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert why.read_text() == f"wds-transform serve: {message}"


def test_the_termination_log_is_written_only_where_kubernetes_made_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    default = tmp_path / "dev" / "termination-log"
    monkeypatch.setitem(VARIABLES, "ETL_TERMINATION_LOG", (str(default), VARIABLES["ETL_TERMINATION_LOG"][1]))
    assert write_termination_log("why", {}) is False  # the default path, absent: not created
    assert not default.parent.exists()
    default.parent.mkdir()
    default.touch()
    assert write_termination_log("why", {}) is True and default.read_text() == "why"
    chosen = tmp_path / "chosen.log"
    assert write_termination_log("x" * 5000, {"ETL_TERMINATION_LOG": str(chosen)}) is True
    assert chosen.read_text() == "x" * 4096  # what Kubernetes keeps
    unwritable = {"ETL_TERMINATION_LOG": str(tmp_path / "no" / "such" / "folder" / "log")}
    assert write_termination_log("why", unwritable) is False  # never an error of its own


def test_environment_transforms_are_validated_and_kept_parsed() -> None:
    settings = Settings.from_env({"ETL_TRANSFORMS": "- Resize: {size: 32}\n- CenterCrop: {size: 24}"})
    assert settings.transforms == [{"Resize": {"size": 32}}, {"CenterCrop": {"size": 24}}]
    assert build_pipeline(settings.transforms).normalize is None


@pytest.mark.parametrize(
    "text, seconds",
    [("45s", 45.0), ("5m", 300.0), ("1m30s", 90.0), ("500ms", 0.5), ("1h", 3600.0), ("1.5h", 5400.0),
     ("1h2m3s", 3723.0), ("2m500ms", 120.5), ("10", 10.0), ("2.5", 2.5), (" 45s ", 45.0)],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "ETL_OBJ_TIMEOUT") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "5x", "5 s", "-5s", "1m30", "m5", "0", "-1", "0ms", "nan", "inf", "5s5"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(text, "ETL_OBJ_TIMEOUT")
    assert info.value.variable == "ETL_OBJ_TIMEOUT"


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch):
    """An 8-CPU affinity mask and controllable cgroup files: ``set(cpu_max, v1=(quota, period))``."""
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(8)))

    def set_files(cpu_max: str | None, v1: tuple[str, str] | None = None) -> None:
        files = {"/sys/fs/cgroup/cpu.max": cpu_max}
        if v1 is not None:
            files.update({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": v1[0], "/sys/fs/cgroup/cpu/cpu.cfs_period_us": v1[1]})

        def fake_open(path, *args, **kwargs):
            assert path.startswith("/sys/fs/cgroup/"), path
            if files.get(path) is None:
                raise FileNotFoundError(path)
            return io.StringIO(files[path])

        monkeypatch.setattr(config, "open", fake_open, raising=False)

    return set_files


@pytest.mark.parametrize(
    "cpu_max, cpus",
    [
        (None, 8),  # no cgroup file at all (bare metal): the affinity mask
        ("max 100000\n", 8),  # no quota
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),  # 1.5 CPUs rounds up: a fractional CPU is still worth a thread
        ("50000 100000\n", 1),
        ("1000 100000\n", 1),
        ("1600000 100000\n", 8),  # the quota never raises the count above the affinity mask
        ("", 8),
        ("garbage\n", 8),
        ("a b\n", 8),
    ],
)
def test_cgroup_cpu_max(eight_cpus, cpu_max: str | None, cpus: int) -> None:
    eight_cpus(cpu_max)
    assert available_cpus() == cpus


@pytest.mark.parametrize(
    "quota, period, cpus",
    [
        ("-1\n", "100000\n", 8),  # no quota
        ("200000\n", "100000\n", 2),  # a kubelet's limit of 2 CPUs on a cgroup v1 node
        ("150000\n", "100000\n", 2),
        ("50000\n", "100000\n", 1),
        ("1600000\n", "100000\n", 8),
        ("x\n", "100000\n", 8),
        ("100000\n", "0\n", 8),
    ],
)
def test_cgroup_v1_cfs_quota(eight_cpus, quota: str, period: str, cpus: int) -> None:
    eight_cpus(None, v1=(quota, period))
    assert available_cpus() == cpus


def test_workers_default_to_available_cpus(eight_cpus) -> None:
    eight_cpus("300000 100000\n")
    settings = Settings.from_env({})
    assert (settings.workers, settings.window, settings.max_inflight) == (3, 8, 64)


def test_settings_table_lists_every_variable_and_the_real_manifest_name() -> None:
    table = settings_table()
    for name, (default, _) in VARIABLES.items():
        assert f"| `{name}` |" in table
        if default:
            assert f"`{default}`" in table
    assert ERROR_MANIFEST_NAME in VARIABLES["ETL_ERROR_MANIFEST"][1]


def test_docs_settings_shows_the_settings_table_as_generated() -> None:
    """docs/settings.md's table is ``wds-transform settings --markdown`` pasted: a new or reworded setting
    shows there too."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert settings_table().strip() in doc
