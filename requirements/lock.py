"""Regenerate the image's pinned requirements from pyproject.toml: ``python requirements/lock.py``.

Writes two files the Dockerfile installs, in this order:

* ``requirements/server.txt``: every runtime package of ``.[server]`` except torch and torchvision, each
  pinned with the sha256 of every wheel of that release (installed with ``--no-deps --require-hashes``:
  the file *is* the dependency set, nothing is resolved at build time);
* ``requirements/torch.txt``: ``torch`` and ``torchvision`` pins, installed from PyTorch's own index
  (CPU wheels by default, a CUDA index via the Dockerfile's ``TORCH_INDEX`` build argument). No hashes:
  the CPU and CUDA builds of one version are different files.

Resolution is pip's own (``pip install --dry-run --report``) for the image's platform, CPython 3.11 on
manylinux x86_64, against PyPI. PyPI's torch wheel is the CUDA build; its CUDA runtime requirements
(``nvidia-*``, ``cuda-*``, ``triton``) are left out because the CPU wheel does not have them and a CUDA
index brings its own. pip-tools and uv cannot drop one package's requirements by pattern, hence this
script. Hashes come from the index's ``#sha256=`` links (one page per pinned package).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.11"  # must match the Dockerfile's PYTHON_VERSION (tests/test_deploy.py checks)
PYTHON_FULL = "3.11.14"
# Debian trixie has glibc 2.41; pip does not expand a manylinux tag to older ones, so list them all.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(41, 16, -1)] + ["manylinux2014_x86_64"]
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": PYTHON_FULL,
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": PYTHON_FULL,
    "python_version": PYTHON,
    "sys_platform": "linux",
}
TORCH_PACKAGES = ("torch", "torchvision")
_CUDA_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
INDEX = "https://pypi.org"


def project_requirements() -> list[str]:
    """Runtime dependencies + the server extra + the build backend (the image builds the package)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return (
        project["project"]["dependencies"]
        + project["project"]["optional-dependencies"]["server"]
        + project["build-system"]["requires"]
    )


def resolve(requirements: list[str]) -> dict:
    """pip's resolution for the image's platform, as its JSON installation report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", str(report), "--only-binary=:all:", *platforms, "--python-version", PYTHON,
             "--implementation", "cp", "--abi", "cp" + PYTHON.replace(".", ""),
             "--index-url", f"{INDEX}/simple", *requirements],
            check=True,
        )
        return json.loads(report.read_text())


def reachable(report: dict, roots: list[str]) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, names that require it), walking requirements with markers for the image."""
    installs = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    found: dict[str, tuple[str, set[str]]] = {}
    pending = [(Requirement(text), "pyproject.toml") for text in roots]
    seen_extras: set[tuple[str, str]] = set()
    while pending:
        requirement, parent = pending.pop()
        name = canonicalize_name(requirement.name)
        if parent == "torch" and _CUDA_RUNTIME.match(name):
            continue  # PyPI's CUDA build only; see the module docstring
        metadata = installs[name]
        version, parents = found.setdefault(name, (metadata["version"], set()))
        parents.add(parent)
        for extra in [""] + sorted(requirement.extras):
            if (name, extra) in seen_extras:
                continue
            seen_extras.add((name, extra))
            for text in metadata.get("requires_dist") or []:
                child = Requirement(text)
                if child.marker is not None and not child.marker.evaluate({**TARGET_ENV, "extra": extra}):
                    continue
                if child.marker is None and extra:
                    continue  # unconditional requirements were taken with extra ""
                pending.append((child, name))
    return found


class _Links(HTMLParser):
    """The file links of a PEP 503 simple-index page (what pip itself reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(value for key, value in attrs if key == "href" and value)


def wheel_hashes(name: str, version: str, context: ssl.SSLContext) -> list[str]:
    """sha256 of every wheel of ``name==version``, from the index page's ``#sha256=`` fragments."""
    with urllib.request.urlopen(f"{INDEX}/simple/{name}/", timeout=60, context=context) as reply:
        links = _Links()
        links.feed(reply.read().decode())
    hashes = []
    for href in links.hrefs:
        url, _, fragment = href.partition("#")
        filename = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        if not filename.endswith(".whl") or not fragment.startswith("sha256="):
            continue
        try:
            wheel_name, wheel_version, _, _ = parse_wheel_filename(filename)
        except InvalidWheelFilename:  # ancient uploads with non-standard names
            continue
        if wheel_name == name and wheel_version == Version(version):
            hashes.append(fragment.removeprefix("sha256="))
    if not hashes:
        raise SystemExit(f"{name}=={version} has no wheels on {INDEX}; the image installs wheels only")
    return sorted(hashes)


def main() -> int:
    report = resolve(project_requirements())
    packages = reachable(report, project_requirements())
    # pip's own certificate setting (e.g. a corporate proxy's CA) applies to the hash look-ups too.
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    lines = [
        "# Runtime packages of the image except torch/torchvision (requirements/torch.txt), pinned with",
        "# the sha256 of every wheel of each release. Generated by `python requirements/lock.py` from",
        "# pyproject.toml (dependencies + [server] extra + build backend); do not edit by hand.",
        f"# python: {PYTHON}",
        "",
    ]
    for name in sorted(packages):
        version, parents = packages[name]
        if name in TORCH_PACKAGES:
            continue
        hashes = wheel_hashes(name, version, context)
        lines.append(f"{name}=={version} \\")
        lines.extend(f"    --hash=sha256:{digest} \\" for digest in hashes[:-1])
        lines.append(f"    --hash=sha256:{hashes[-1]}")
        lines.append(f"    # via {', '.join(sorted(parents))}")
    (ROOT / "requirements" / "server.txt").write_text("\n".join(lines) + "\n")
    torch_lines = [
        "# torch and torchvision from PyTorch's wheel index (Dockerfile build argument TORCH_INDEX; CPU",
        "# wheels by default). No hashes: the CPU and CUDA builds of a version are different files.",
        "# Generated by `python requirements/lock.py`; do not edit by hand.",
        *(f"{name}=={packages[name][0]}" for name in TORCH_PACKAGES),
    ]
    (ROOT / "requirements" / "torch.txt").write_text("\n".join(torch_lines) + "\n")
    print(f"pinned {len(packages) - len(TORCH_PACKAGES)} packages in requirements/server.txt, "
          f"{', '.join(f'{n}=={packages[n][0]}' for n in TORCH_PACKAGES)} in requirements/torch.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
