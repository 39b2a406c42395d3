# One image, three roles: the API, a compiler worker and a runtime agent differ by command.
# KILN_EXTRAS picks what it installs: "api,s3" for the control plane, "worker" for a compiler
# worker (it reaches the store only through the API: no `s3`), "agent" for an agent.
#
# Two targets: `cpu` (the default, last below) on python:3.11-slim, and `gpu`, a compiler
# worker (or agent) for NVIDIA GPUs on a CUDA base with onnxruntime-gpu:
#   docker build --target gpu --build-arg KILN_EXTRAS=worker,gpu -t kiln-gpu .

# ---------------------------------------------------------------- gpu
# CUDA 12 with cuDNN 9: what onnxruntime-gpu's default wheels are built against.
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
FROM ${CUDA_IMAGE} AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive
# Ubuntu 22.04 ships Python 3.10; Kiln targets 3.11 (deadsnakes' build for this release).
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && apt-get purge -y --auto-remove software-properties-common gpg-agent \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/kiln
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY artifact_store artifact_store
COPY runtime_agent runtime_agent
COPY services services
COPY compiler_worker compiler_worker
COPY kiln kiln
ARG KILN_EXTRAS=worker,gpu
# onnxruntime-gpu provides the same `onnxruntime` module as the CPU wheel the extras pull, so
# the CPU wheel goes and the GPU wheel of the same version takes its place (the version is
# part of an engine's fingerprint key). ONNXRUNTIME_GPU_SPEC overrides it.
ARG ONNXRUNTIME_GPU_SPEC=
# TensorRT for the `tensorrt` backend, e.g. tensorrt-cu12==10.7.0; empty: none.
ARG TENSORRT_SPEC=
RUN pip install --upgrade pip \
 && pip install ".[${KILN_EXTRAS}]" \
 && ort="$(python -c 'import importlib.metadata as m; print(m.version("onnxruntime"))')" \
 && pip uninstall -y onnxruntime \
 && pip install "${ONNXRUNTIME_GPU_SPEC:-onnxruntime-gpu==${ort}}" \
 && if [ -n "${TENSORRT_SPEC}" ]; then pip install "${TENSORRT_SPEC}"; fi
RUN useradd --create-home --uid 10001 kiln
USER kiln
ENV KILN_HOME=/home/kiln/state
CMD ["kiln", "worker", "--concurrency", "1"]

# ---------------------------------------------------------------- cpu (default)
FROM python:3.11-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kiln
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY artifact_store artifact_store
COPY runtime_agent runtime_agent
COPY services services
COPY compiler_worker compiler_worker
COPY kiln kiln
ARG KILN_EXTRAS=all
RUN pip install ".[${KILN_EXTRAS}]"
RUN useradd --create-home --uid 10001 kiln
USER kiln
ENV KILN_HOME=/home/kiln/state
EXPOSE 8000
CMD ["kiln", "api", "--host", "0.0.0.0"]
