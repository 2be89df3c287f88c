# Quick start: `make demo` (install, demo shards, service, one shard through it) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_WORKERS ?= 2  # make test: pytest-xdist workers; --dist loadfile keeps each test file on one worker

.PHONY: install lock demo test bench aisnode k8s-tools ais-etl cluster image test-image test-k8s image-tools k8s-host-tools \
	gpu-wheels scaling-wheels \
	lint clean

install: $(VENV)/.installed

# Exactly the locked set (requirements/dev.txt, from uv.lock: every version and file hash fixed, so a new release on
# PyPI changes nothing), then the package itself, editable, built by the locked setuptools without fetching another.
# torch is PyPI's 2.15.0 (a CUDA build that also runs on CPU, ~6 GB installed).
$(VENV)/.installed: pyproject.toml requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torchvision.transforms.v2, transformer.server"
	touch $@

# uv.lock again from pyproject.toml, and every file generated from it (requirements/lock.py says which).
lock: install
	$(PY) requirements/lock.py

demo: install
	PY=$(PY) bash scripts/demo.sh

# The 'ais' tests (part of `make test`) run a real AIStore on 127.0.0.1: aisnode is built once with Go >= 1.26
# into ~/.cache/ais-wds-transformer (testbed/cluster.py); `make aisnode` builds it ahead of a test run.
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

# The headline benchmark at HEAD (a few minutes on 2 cores): bench/results/headline/<date>-<time>-<commit>/, then
# the README's and docs/' generated sections rewritten from it (bench/headline.py).
bench: install
	$(PY) -m bench.headline

aisnode: install
	$(PY) -m testbed.cluster --build-only

# The real Kubernetes' binaries (Kubernetes, CoreDNS and AIS's aisinit built with Go from the module proxy;
# containerd, etcd and the registry from Debian packages), made once into ~/.cache/ais-wds-transformer
# (testbed/k8s/build.py, testbed/k8s/gobuilds.py).
k8s-tools: install
	$(PY) -m testbed.k8s.build

# The pod's image from the Dockerfile: Docker where an engine runs, else buildah as root (scripts/image.py says
# which base and torch index it picks, and why). Tagged localhost/ais-wds-transformer:dev.
image:
	$(PYTHON) -m scripts.image

# Host tools the container targets need, Debian's packages installed as root when their command is missing
# (scripts/host-tools.sh): buildah, mmdebstrap build the image; podman, runc run and push it; iptables is kube-proxy's.
IMAGE_TOOLS := buildah podman runc mmdebstrap
image-tools:
	bash scripts/host-tools.sh $(IMAGE_TOOLS)

k8s-host-tools:
	bash scripts/host-tools.sh $(IMAGE_TOOLS) iptables

# The image's own tests, then the whole real-ETL suite with every ETL pod a podman container of the image.
test-image: install image-tools image
	AIS_WDS_POD_RUNTIME=container $(PY) -m pytest -q -m 'image or ais_etl' tests/image tests/ais/etl

# The real-ETL suite on the cluster users run (testbed/k8s, docs/kubernetes.md): two real Kubernetes nodes, AIS's
# proxy and targets as pods, the image pushed to the cluster's registry and pulled by both nodes, every ETL pod
# scheduled on its target's node and run by that node's kubelet.
test-k8s: install k8s-host-tools image k8s-tools
	AIS_WDS_KUBE=real $(PY) -m pytest -q -m 'ais_etl or k8s' tests/ais/etl

# That cluster, until Ctrl-C or SIGTERM: it prints the proxy's URL, the kubeconfig, kubectl and the image's name
# in the cluster's registry (docs/kubernetes.md says how to reach it with ais, the SDK and kubectl).
cluster: install k8s-host-tools image k8s-tools
	$(PY) -m testbed.k8s.up

# A real AIS with ETL (one proxy, two targets, a fake Kubernetes) in a network namespace, until Ctrl-C.
ais-etl: install
	$(PY) -m testbed.etl_cluster

# The wheels python -m bench.gpu installs on a GPU machine without network (docs/benchmarks.md, GPU): CPython 3.12
# wheels of requirements/gpu-check.txt into GPU_WHEELS, by the venv's pip (a plain python3 may have none).
GPU_WHEELS ?= .gpu-wheels
gpu-wheels: install
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) -r requirements/gpu-check.txt

# The pod's, the bench's and the SDK peer's packages for bench/device_scaling.sh on a machine without them or a
# network (requirements/scaling-check.txt): CPython 3.12 manylinux wheels into .scaling-wheels/.
scaling-wheels:
	rm -rf .scaling-wheels
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .scaling-wheels -r requirements/scaling-check.txt

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf demo-out .pytest_cache
