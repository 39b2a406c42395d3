# One image, three roles: the API, a compiler worker and a runtime agent differ by command.
# KILN_EXTRAS picks what it installs: "api,s3" for the control plane, "worker" for a compiler
# worker (it reaches the store only through the API: no `s3`), "agent" for an agent.
FROM python:3.11-slim AS base
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
