"""The images the cluster runs, and how they get into its registry.

- **One-binary images** (the pod sandbox, CoreDNS): a single layer holding one static binary, put into the
  registry through its HTTP API (no image tool is needed for a one-file image).
- **The aisnode image**: the aisnode the project builds (``testbed/cluster.py``) and AIS's ``aisinit``
  (``gobuilds.py``) on the Debian base ``make image`` already makes (``scripts/image.py``), built with buildah
  as root. Its entry point is ``aisnode``, as in AIS's production image; the init container runs ``aisinit``
  from the same image. Its tag carries a digest of both binaries, so a rebuilt aisnode is a new image.
- ``push``: a local image into the registry with podman, from the caller's network namespace.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import requests

from scripts.image import base_image, container_env

from .build import KubernetesUnavailable
from .topology import REGISTRY

MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
AISNODE_REPOSITORY = "ais-wds-aisnode"
AISNODE_CONTAINERFILE = """\
ARG BASE
FROM ${BASE}
COPY aisnode aisinit /usr/bin/
ENTRYPOINT ["aisnode"]
"""


def digest(*files: Path) -> str:
    """The first 16 hex digits of the files' SHA-256: an image tag that changes whenever a binary does."""
    hashed = hashlib.sha256()
    for file in files:
        hashed.update(file.read_bytes())
    return hashed.hexdigest()[:16]


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # the registry is in the cluster's network: no proxy variable may route it away
    return session


def put_binary_image(reference: str, binary: Path, entrypoint: list[str] | None = None) -> None:
    """``<REGISTRY>/<name>:<tag>`` as one layer holding ``binary`` at ``/<its name>``; nothing if already there."""
    name, tag = reference.split("/", 1)[1].rsplit(":", 1)
    base = f"http://{REGISTRY}/v2/{name}"
    session = _session()
    if session.head(f"{base}/manifests/{tag}", timeout=5, headers={"Accept": MANIFEST}).ok:
        return
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as archive:
        info = tarfile.TarInfo(binary.name)
        info.size, info.mode = binary.stat().st_size, 0o755
        with open(binary, "rb") as data:
            archive.addfile(info, data)
    diff_id = "sha256:" + hashlib.sha256(layer.getvalue()).hexdigest()
    compressed = gzip.compress(layer.getvalue(), mtime=0)
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": entrypoint or [f"/{binary.name}"]},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()

    def put_blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        upload = session.post(f"{base}/blobs/uploads/", timeout=30)
        upload.raise_for_status()
        location = upload.headers["Location"]
        location = location if location.startswith("http") else f"http://{REGISTRY}{location}"
        session.put(location, params={"digest": digest}, data=data, timeout=120,
                    headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        return digest

    manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "size": len(config), "digest": put_blob(config)},
                "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                            "size": len(compressed), "digest": put_blob(compressed)}]}
    session.put(f"{base}/manifests/{tag}", data=json.dumps(manifest), timeout=30,
                headers={"Content-Type": MANIFEST}).raise_for_status()


def _podman(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=container_env())


def aisnode_image(aisnode: Path, aisinit: Path, log=print) -> str:
    """The local aisnode image (``localhost/ais-wds-aisnode:<digest>``), built first if it is not there."""
    local = f"localhost/{AISNODE_REPOSITORY}:{digest(aisnode, aisinit)}"
    if _podman("image", "exists", local).returncode == 0:
        return local
    base = base_image("buildah")
    log(f"building {local} from {base}")
    with tempfile.TemporaryDirectory(prefix="ais-wds-aisnode-") as work:
        for binary in (aisnode, aisinit):
            shutil.copy(binary, Path(work) / binary.name)
        (Path(work) / "Containerfile").write_text(AISNODE_CONTAINERFILE)
        done = subprocess.run(["buildah", "bud", "--pull=never", "--format", "docker",
                               "--build-arg", f"BASE={base}", "-t", local, "-f", f"{work}/Containerfile", work],
                              capture_output=True, text=True, timeout=600, env=container_env())
    if done.returncode != 0:
        raise KubernetesUnavailable(f"building {local} failed ({done.returncode}): {done.stderr[-3000:]}")
    return local


def push(local: str, *names: str) -> list[str]:
    """Push a local image into the registry as each of ``names`` (``repo:tag``); returns the references."""
    pushed = []
    for name in names:
        reference = f"{REGISTRY}/{name}"
        done = _podman("push", "--quiet", "--tls-verify=false", "--format", "v2s2", local, f"docker://{reference}",
                       timeout=1800)
        if done.returncode != 0:
            raise KubernetesUnavailable(f"podman push {local} -> {reference}: {done.stderr.strip()}")
        pushed.append(reference)
    return pushed
