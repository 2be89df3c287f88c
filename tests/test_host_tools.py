"""scripts/host-tools.sh: what make test-image and make test-k8s install on the host, with fake apt-get and id."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host-tools.sh"


def _fakes(tmp_path: Path, uid: int, installs: bool = True) -> tuple[Path, dict[str, str]]:
    """A bin folder first on PATH with an ``id`` that says ``uid`` and an ``apt-get`` that logs its arguments and,
    for ``install``, creates each package's command there (unless ``installs`` is false)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    make = ('for p in "$@"; do case "$p" in -*|install) ;; '
            '*) printf "#!/bin/sh\\n" > "$BIN/$p"; chmod +x "$BIN/$p";; esac; done')
    scripts = {
        "id": f'#!/bin/sh\necho {uid}\n',
        "apt-get": f'#!/bin/sh\necho "$@" >> "{log}"\n'
                   + (f'[ "$1" = install ] && {{ {make}; }}\n' if installs else "") + "exit 0\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "BIN": str(bin_dir),
           "HOST_TOOLS_SBIN": str(tmp_path / "sbin")}
    return log, env


def _run(env: dict[str, str], *tools: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *tools], env=env, capture_output=True, text=True, timeout=60)


def test_a_missing_tool_is_installed_as_root(tmp_path: Path) -> None:
    log, env = _fakes(tmp_path, uid=0)
    done = _run(env, "sh", "ais-wds-absent-a", "ais-wds-absent-b")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq ais-wds-absent-a ais-wds-absent-b"]
    assert (tmp_path / "bin" / "ais-wds-absent-a").exists()


def test_present_tools_install_nothing(tmp_path: Path) -> None:
    log, env = _fakes(tmp_path, uid=0)
    (tmp_path / "sbin").mkdir()
    (tmp_path / "sbin" / "ais-wds-in-sbin").write_text("#!/bin/sh\n")
    (tmp_path / "sbin" / "ais-wds-in-sbin").chmod(0o755)
    done = _run(env, "sh", "ais-wds-in-sbin")  # found on PATH, and in sbin off PATH (iptables for a user)
    assert done.returncode == 0, done.stderr
    assert not log.exists()


def test_without_root_the_error_names_each_missing_package(tmp_path: Path) -> None:
    log, env = _fakes(tmp_path, uid=1000)
    done = _run(env, "sh", "ais-wds-absent-a", "ais-wds-absent-b")
    assert done.returncode == 1 and not log.exists()
    assert "missing on this host: ais-wds-absent-a ais-wds-absent-b" in done.stderr
    assert "apt-get install -y ais-wds-absent-a ais-wds-absent-b" in done.stderr


def test_an_install_that_leaves_no_command_fails(tmp_path: Path) -> None:
    _, env = _fakes(tmp_path, uid=0, installs=False)
    done = _run(env, "ais-wds-absent-a")
    assert done.returncode == 1
    assert "apt-get installed ais-wds-absent-a, yet no ais-wds-absent-a command" in done.stderr


def test_the_container_targets_install_what_they_run() -> None:
    makefile = (SCRIPT.parents[1] / "Makefile").read_text()
    assert "IMAGE_TOOLS := buildah podman runc mmdebstrap" in makefile
    assert "test-image: install image-tools image" in makefile
    assert "test-k8s: install k8s-host-tools image k8s-tools" in makefile
    assert "bash scripts/host-tools.sh $(IMAGE_TOOLS) iptables" in makefile
