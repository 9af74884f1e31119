# h3-spark's hot service (`h3-spark serve`) in a container. docs/container.md has the build and run
# commands, the token, the volumes and what was checked; compose.yaml runs it with a GPU reserved.
#
# PyTorch's Linux wheels on PyPI carry their own CUDA libraries (the nvidia-* and cuda-toolkit wheels), so
# the host only lends its driver, through the NVIDIA container toolkit. The CUDA base is still the default:
# its NVIDIA_REQUIRE_CUDA makes the toolkit refuse, at start, a host driver too old for CUDA 13.0 (torch
# 2.13.0's line on PyPI) instead of torch failing later. A plain Debian or Ubuntu base with Python >= 3.10
# serves too: scripts/container_smoke.sh builds on a local Debian 12 base on a machine without a GPU.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# The pair the project tests (README); their PyPI wheels for Linux are the CUDA 13.0 builds.
ARG TORCH_SPEC="torch==2.13.0 torchvision==0.28.0"
# Extra pip options for the torch step alone, e.g. --find-links to a folder of CPU wheels for a smoke
# build that should not pull ~3 GB of CUDA wheels.
ARG TORCH_PIP_ARGS=""
ARG H3_EXTRAS="serve,gpu"
ARG H3_UID=10001

# python3-dev and gcc: Triton compiles a small C launcher against Python.h the first time a kernel runs.
# Versions are the base release's own (this file builds on Ubuntu and Debian alike).
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# A venv keeps pip away from the distribution's own Python packages (Ubuntu 24.04 refuses a system-wide
# pip install).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# torch first and in its own layer: it is most of the image and changes less often than the project.
# The pins are in TORCH_SPEC, where hadolint cannot see them.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} ${TORCH_SPEC}

# .dockerignore keeps the context to the package's sources, pyproject.toml, README.md and config/ (the
# serving defaults, config/h3_spark_serving.env, stay in the image at /opt/h3-spark/config).
COPY . /opt/h3-spark
RUN pip install --no-cache-dir "/opt/h3-spark[${H3_EXTRAS}]" \
 && rm -rf /opt/h3-spark/build /opt/h3-spark/*.egg-info

# /cache holds Triton's compiled kernels; mode 1777 so that `--user` with any uid can write there, and a
# named volume mounted on it starts with that mode.
RUN groupadd --system --gid ${H3_UID} h3 \
 && useradd --system --uid ${H3_UID} --gid h3 --create-home --home-dir /home/h3 h3 \
 && mkdir -p /models /in /out /cache \
 && chown h3:h3 /in /out \
 && chmod 1777 /cache
# HF_HUB_OFFLINE: the weights come from /models only; a missing file should fail at once, not after a
# network timeout.
ENV XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    HF_HUB_OFFLINE=1

# Numeric, so that a runtime that insists on a non-root user can check it without reading /etc/passwd.
USER ${H3_UID}:${H3_UID}
WORKDIR /home/h3
EXPOSE 8000

# Listening on 0.0.0.0 needs a token: give it with `--api-key-file /run/secrets/h3_api_key` (compose.yaml
# does) or H3_API_KEY; without one the service refuses to start and says so. The health check sends the same
# token, read from that file or from H3_API_KEY, to /live, which answers 200 while the models load.
ENTRYPOINT ["h3-spark", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--models", "/models", "--input-dir", "/in", "--output-dir", "/out"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; f = '/run/secrets/h3_api_key'; k = (open(f).readline() if os.path.exists(f) else os.environ.get('H3_API_KEY', '')).strip(); u.urlopen(u.Request('http://127.0.0.1:8000/live', headers={'Authorization': 'Bearer ' + k} if k else {}), timeout=4)"]
