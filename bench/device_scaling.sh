#!/usr/bin/env bash
# bench.scaling on a machine with many cores and no network (the 16-core device machine), in one command.
#
#   bash bench/device_scaling.sh [more bench.scaling arguments for the sweep, e.g. --no-peer]
#
# SCALING_SWEEP, SCALING_SECONDS, SCALING_SHARDS and SCALING_SAMPLES size it (defaults: 1,2,4,8,16 workers, 15 s of
# full load per case, 4 shards of 150 demo samples: about 7.5 minutes on 16 cores, an estimate).
# From the repository's root, with .scaling-wheels/ beside it (`make scaling-wheels`, requirements/scaling-check.txt).
# 1. a venv that sees the launching python3's packages (its torch and torchvision: the venv's own site-packages
#    come first, so the carried wheels win over any other version there), the wheels installed into it offline;
# 2. the import check: the pod, the transforms, the SDK peer, py-spy, curl; every requirement of the installed
#    wheels met;
# 3. python -m bench.scaling --sweep 1,2,4,8,16: images/s of the threads design, the processes design and the SDK
#    peer at each worker count (py-spy's GIL shares and the pod's PSS at the largest), into $OUT/scaling;
# 4. the 16-worker run again with its GIL shares and PSS (both designs, no peer), into $OUT/gil16, and a summary.
# Everything it prints also goes to $OUT/device.log; each step is bounded so that the whole ends within
# SCALING_BUDGET seconds (default 540) and what was measured comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/bench/results/scaling-device}
PY=${PYTHON:-python3}
WHEELS=${SCALING_WHEELS:-$REPO/.scaling-wheels}
VENV=${SCALING_VENV:-/tmp/scaling-venv}
WORK=${SCALING_WORK:-/tmp/scaling-work}
BUDGET=${SCALING_BUDGET:-540}
SWEEP=${SCALING_SWEEP:-1,2,4,8,16}
# --photos 0: the sweep measures the demo's ImageNet-size JPEGs only; 6 MP photo shards would cost their making.
SIZE=(--seconds "${SCALING_SECONDS:-15}" --shards "${SCALING_SHARDS:-4}" --samples "${SCALING_SAMPLES:-150}" --photos 0
      --work "$WORK")
START=$SECONDS
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1

# The services' logs come back too, whatever happens (bench.scaling writes them under $WORK/logs).
trap 'tar -czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null' EXIT
left() { echo $((BUDGET - (SECONDS - START))); }
fail() { echo "device_scaling: $*"; exit 1; }

echo "== machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)), $(free -g | awk '/Mem:/{print $2}') GiB," \
     "$(uname -r), $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
command -v curl >/dev/null || fail "no curl on this machine: bench.scaling drives the pod with curl, as an AIS target"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || fail "$PY is not Python 3.12: the wheels are cp312"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || fail "no wheels in $WHEELS (make scaling-wheels, then carry .scaling-wheels)"

echo "== venv $VENV over $("$PY" -c 'import sys; print(sys.prefix)')"
rm -rf "$VENV"
"$PY" -m venv --system-site-packages --without-pip "$VENV" || fail "python3 -m venv failed"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# --system-site-packages shows the base interpreter's packages; where python3 is itself a venv (the device's
# is), its own site-packages hold torch, so they are added after the venv's by a .pth file.
"$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$SITE/device-python.pth"
# pip runs from its carried wheel (none need be on the machine); --ignore-installed puts every carried wheel into
# the venv, also where python3 has the same version.
PIP=$(ls "$WHEELS"/pip-*.whl | head -1)/pip
timeout 180 "$VENV/bin/python" "$PIP" install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --ignore-installed "$WHEELS"/*.whl || fail "the offline install of $WHEELS failed"
export PATH="$VENV/bin:$PATH" PYTHONUNBUFFERED=1
echo "   $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), installed in $((SECONDS - START)) s"

echo "== import check"
timeout 120 "$VENV/bin/python" - "$SITE" <<'EOF' || fail "the import check failed"
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement
from packaging.version import Version

site = sys.argv[1]
import torch  # noqa: E402
import torchvision.transforms.v2  # noqa: E402,F401

import transformer.server  # noqa: E402,F401
from aistore.sdk.etl.webserver.fastapi_server import FastAPIServer  # noqa: E402,F401
import fastapi, psutil, simplejpeg, uvicorn, webdataset, wsproto  # noqa: E401,E402,F401
import matplotlib, skimage  # noqa: E401,E402,F401  (the demo's photographs ship in them)
from transformer import cropdecode  # noqa: E402

assert not torch.__file__.startswith(site), f"torch should be the machine's, not {torch.__file__}"
for module in (fastapi, uvicorn, webdataset, psutil):
    assert module.__file__.startswith(site), f"{module.__name__} from {module.__file__}, not the carried wheel"
unmet = []
for dist in metadata.distributions(path=[site]):
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            found = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
            continue
        if not requirement.specifier.contains(Version(found), prereleases=True):
            unmet.append(f"{dist.metadata['Name']} needs {requirement}: {found} is installed")
assert not unmet, "\n".join(unmet)
print(f"   python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {metadata.version('torchvision')}, "
      f"numpy {metadata.version('numpy')}, pillow {metadata.version('pillow')}; window decoder "
      f"{'nvImageCodec' if cropdecode.nvimgcodec is not None else 'MISSING'}; every requirement met")
EOF
py-spy --version || fail "py-spy does not run"
curl --version | head -1

# The sweep: each worker count x (2 pod designs + the peer), each case --seconds of full load after a warm-up shard.
echo "== sweep $SWEEP ($(left) s left)"
timeout --kill-after=10 $(( $(left) - 75 )) "$VENV/bin/python" -m bench.scaling --sweep "$SWEEP" "${SIZE[@]}" \
    --out "$OUT/scaling" "$@"
echo "   sweep exit $? after $((SECONDS - START)) s"

# The largest worker count again, both designs: GIL shares by process, PSS, and a second images/s figure.
LAST=${SWEEP##*,}
if [ "$(left)" -gt 60 ]; then
    echo "== $LAST workers again: GIL shares and PSS ($(left) s left)"
    timeout --kill-after=10 $(( $(left) - 10 )) "$VENV/bin/python" -m bench.scaling --sweep "$LAST" --no-peer \
        "${SIZE[@]}" --out "$OUT/gil$LAST"
    echo "   exit $? after $((SECONDS - START)) s"
else
    echo "== $LAST workers again: left out, $(left) s left"
fi

echo "== summary"
"$VENV/bin/python" - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
for name in ("scaling", *sorted(p.name for p in out.glob("gil*"))):
    path = out / name / "scaling.json"
    if not path.exists():
        print(f"{name}: no scaling.json (stopped before the end; device.log has the cases measured)")
        continue
    result = json.loads(path.read_text())
    rows = result["cores_sweep"]
    print(f"## {name}: {result['machine']['cpus']} CPUs, {result['date']}, commit {result['commit']}\n")
    print("| design | workers | images/s | / (1-worker rate x workers) | pod CPU ms/image | PSS MiB | "
          "GIL share (server; workers) | server GIL / pod CPU per image |")
    print("|---|---|---|---|---|---|---|---|")
    ones = {r["design"]: r["images_per_second"] for r in rows if r["workers"] == 1}
    for r in rows:
        one = ones.get(r["design"])
        efficiency = f"{r['images_per_second'] / (one * r['workers']):.2f}" if one else "n/a"
        shares = "; ".join("n/a" if p["gil_share"] is None else f"{100 * p['gil_share']:.1f}%"
                           for p in r.get("per_process", []) if p["role"] != "forkserver")
        fraction = r.get("server_gil_fraction")
        # the pod's PSS under load, as LoadRun.summary() records it (bench/scaling.py's memory())
        pss_bytes = (r.get("memory") or {}).get("pss")
        pss = f"{pss_bytes / 2**20:,.0f}" if pss_bytes else ""
        print(f"| {r['design']} | {r['workers']} | {r['images_per_second']:,.0f} | {efficiency} | "
              f"{r['cpu_ms_per_image']:.2f} | {pss} | {shares} | "
              f"{'' if fraction is None else f'1/{1 / fraction:,.0f}' if fraction else ''} |")
    print()
EOF
echo "== done in $((SECONDS - START)) s"
