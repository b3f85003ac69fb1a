# hisparse-serve image: one image for the Ray head, the prefill and decode workers, and the gateway.
#
#   docker build -t hisparse-serve:0.1.0-cpu --build-arg VARIANT=cpu .
#   docker build -t hisparse-serve:0.1.0-gpu --build-arg VARIANT=gpu .
#
# VARIANT=cpu installs torch from the PyTorch CPU index (no CUDA libraries, a much smaller image);
# VARIANT=gpu installs the CUDA build of torch from PyPI, which carries its CUDA runtime as wheels,
# so the base image needs no CUDA toolkit: the node's NVIDIA driver is mounted in by the NVIDIA
# container toolkit. TORCH_INDEX_URL overrides the index (e.g. https://download.pytorch.org/whl/cu128).
#
# Run alone (embedded Ray, built-in model): docker run --shm-size=2g -p 8000:8000 hisparse-serve:0.1.0-cpu

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
# Keep equal to the chart's rayVersion value (RayCluster spec.rayVersion).
ARG RAY_VERSION=2.60.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# wget: older KubeRay versions probe Ray pods with `wget ... /api/local_raylet_healthz`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# torch first and pinned, so `pip install .` (which asks for torch>=2.4) keeps this build.
RUN set -eux; \
    case "$VARIANT" in \
      cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      gpu) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *) echo "VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --index-url "$index" "torch==${TORCH_VERSION}"

# The project itself (non-editable), Ray with the dashboard agent (KubeRay's health checks) and
# Ray Serve (the RayService option), and Triton for the GPU kernels.
COPY . /tmp/hisparse-src
RUN set -eux; \
    extras=""; \
    if [ "$VARIANT" = gpu ]; then extras="[triton]"; fi; \
    pip install "/tmp/hisparse-src${extras}" "ray[default,serve]==${RAY_VERSION}"; \
    rm -rf /tmp/hisparse-src; \
    hisparse --help >/dev/null; \
    python -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"

# Non-root user (uid/gid 1000, as the chart's podSecurityContext expects). Python and the console
# scripts live under /usr/local/bin, which stays on PATH in the login shells KubeRay starts
# (`bash -lc`), unlike a virtualenv's bin directory.
RUN groupadd --gid 1000 hisparse \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/hisparse --shell /bin/bash hisparse
USER 1000:1000
ENV HOME=/home/hisparse
WORKDIR /home/hisparse

EXPOSE 8000
CMD ["hisparse", "serve", "--host", "0.0.0.0", "--port", "8000"]
