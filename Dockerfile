# syntax=docker/dockerfile:1
# AIStore ETL transformer for WebDataset shards: `wds-transform serve` on 0.0.0.0:8000 (docs/deploy.md).
#
#   CPU (default): docker build -t REGISTRY/ais-wds-transformer:0.1.0 .
#   CUDA variant:  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#                      -t REGISTRY/ais-wds-transformer:0.1.0-cu130 .
#   Without Docker: make image (buildah; scripts/image.py)
#
# tests/test_deploy.py lints this file, replays its pip steps and starts its entry command;
# `make test-image` builds it and runs the real-ETL suite with every ETL pod a container of it.

# 3.11 is the Python requirements/server.txt and torch.txt were written for from uv.lock (requirements/lock.py); change
# both together.
ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=trixie
# Any Debian-based image with python${PYTHON_VERSION} and its venv module (`python -m venv`) will do;
# `make image` builds a stand-in from Debian's packages where this one cannot be pulled.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

# The runtime dependencies: this stage is the final image's lower layers, so a change to transformer/
# rebuilds only the small layers at the end (no multi-GB copy of the venv into another stage).
FROM ${BASE_IMAGE} AS deps
# PyTorch's CPU wheels: a ~190 MB download instead of PyPI's CUDA build, ~5.9 GB installed with its
# nvidia-*/cuda-*/triton wheels; the pod runs on storage nodes without GPUs. A CUDA index (whl/cu130, ...) gives the GPU variant.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /build
# Everything except torch/torchvision, exactly as locked: --no-deps because the file is the whole set,
# hashes so that a changed or substituted file fails the build.
COPY requirements/server.txt requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --require-hashes --only-binary=:all: -r requirements/server.txt
# torch/torchvision from PyTorch's index, after the lock: their other requirements are then already
# satisfied by pinned versions (a CUDA index adds only its nvidia-* wheels).
COPY requirements/torch.txt requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --only-binary=:all: --index-url "${TORCH_INDEX}" -r requirements/torch.txt

# The package as a wheel, built beside the final image so that its sources never enter it.
FROM deps AS package
COPY pyproject.toml README.md ./
COPY transformer/ transformer/
# The locked setuptools builds the wheel (no build isolation: nothing unpinned is downloaded).
RUN pip wheel --no-deps --no-build-isolation --no-cache-dir --wheel-dir /wheels .

FROM deps
ARG PYTHON_VERSION
ARG DEBIAN_RELEASE
ARG BASE_IMAGE
# Same as pyproject.toml's version and the k8s/ image tags (tests/test_deploy.py checks).
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ais-wds-transformer" \
      org.opencontainers.image.description="AIStore ETL: WebDataset shards -> torchvision v2 transforms -> .npy, streamed" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
WORKDIR /
# The wheel comes in by COPY, whose cache key is its content, so a changed package always rebuilds what is
# above it (buildah leaves a RUN's bind mount from another stage out of its cache key: the image kept the old
# package). Bytecode is compiled at install time. `pip check`: the requirements are all met by the lock.
COPY --from=package /wheels /wheels
RUN pip install --no-deps --no-index --no-cache-dir /wheels/*.whl \
    && pip check
# Group 0: AIS targets run as root and create objects 0640 root:root, so an FQN is readable through
# group 0 without running as root. The runtime spec has no securityContext.
RUN useradd --no-log-init --system --uid 10001 --gid 0 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin etl
# At run time the pod writes only to /tmp (TMPDIR): torch creates a temporary directory when it is
# imported, and output for callers that send a whole body before reading is parked there. With a
# read-only root filesystem, /tmp must be a writable volume (k8s/standalone/deployment.yaml).
# PATH (/opt/venv/bin first) comes from the deps stage.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:0
EXPOSE 8000
# Docker only (Kubernetes ignores HEALTHCHECK; AIS adds its own readiness probe on /health).
# python, not curl: the slim base has no curl. The pod listens on 8000, as AIS requires.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Exec form: wds-transform is PID 1 and gets SIGTERM itself (uvicorn drains in-flight shards).
# `serve` sets what AIS needs from uvicorn (transformer/serve.py): 0.0.0.0:8000, keep-alive 75 s, above the
# target's 6 s idle timeout; WebSocket messages up to 16 GiB; pings off. tests/test_deploy.py checks the
# first two against this very command. AIS's runtime.command, when set, replaces both lines; k8s/ does not.
ENTRYPOINT ["wds-transform"]
CMD ["serve"]
