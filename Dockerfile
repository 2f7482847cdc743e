# ENLACE images, one pinned target per GPU generation:
#   cpu        CPU-only torch                               docker build --target cpu -t enlace:cpu .
#   turing     RTX 20xx (sm_75): CUDA 12.6 wheels            docker build --target turing -t enlace:turing .
#   blackwell  RTX 50xx (sm_120): CUDA 13.0 wheels           docker build --target blackwell -t enlace:blackwell .
# Why two CUDA targets: cu126 wheels have no sm_120 kernels ("no kernel image" on a 5090), and cu130 needs
# driver >= 580, which Turing machines often lack. The wheels bring their own CUDA libraries, so the small
# `base` CUDA images suffice. Base images are pinned by tag and digest, equal to docker/images.lock.
#
# The image holds the environment only. The repository is mounted at run time (-v "$PWD":/work -w /work),
# so .git, the DVC cache and checkpoints stay on the host; containers run as the host user (--user; without it
# an unprivileged user of the image, never root).
#
# Needs BuildKit (Docker 23+ uses it by default; DOCKER_BUILDKIT=1 on 20.10): the install step reads docker/
# through a bind mount and an optional CA bundle through a secret, so neither lands in a layer. No `syntax`
# line: the built-in Dockerfile frontend suffices, and fetching another one needs Docker Hub.
# Build arguments (docs/containers.md); their defaults are the pinned references, so a plain build needs none:
#   CPU_BASE / TURING_BASE / BLACKWELL_BASE  the base image (make docker-test swaps in a local Debian 12 base)
#   TORCH_INDEX    the PyTorch wheel index torch comes from
#   TORCH_WHEELS   instead, a folder of wheels under docker/ (git-ignored), installed with --no-index
# Secret: --secret id=ca_bundle,src=FILE  extra CA certificates (PEM) that pip trusts during the build, for
#   networks behind a TLS-intercepting proxy; never copied into the image.
ARG CPU_BASE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
ARG TURING_BASE=nvidia/cuda:12.6.3-base-ubuntu24.04@sha256:c87e78933f4c16e3272123bf2f75537306596d0fbaa395a29696a22786e5ee0e
ARG BLACKWELL_BASE=nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:f8ef28f579ea42a44b415d2c5d46f788e6a9b395c6c83f2929416e1fc192c143

FROM ${CPU_BASE} AS cpu
# The package lists stay: the default corpus (configs/data/es-debian.yaml) is fetched with `apt-get download`,
# which the host user can run, unlike the `apt-get update` that empty lists would need.
RUN apt-get update && apt-get install -y --no-install-recommends git tini groff-base \
    && apt-get clean
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=
RUN --mount=type=bind,source=docker,target=/tmp/env --mount=type=secret,id=ca_bundle \
    sh /tmp/env/install.sh /tmp/env/requirements-cpu.lock "torch==2.13.0+cpu" "$TORCH_INDEX" "$TORCH_WHEELS"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=cpu
WORKDIR /work
# Not root by default: a plain `docker run` runs as this unprivileged user. The make targets and
# docker/test.sh pass --user with the host's ids instead, so files written to the mounted repository stay
# the host user's.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp/home --shell /bin/bash enlace
USER 10001:10001
# tini -g forwards signals to the whole process group: stopping the container stops dvc *and* the trainer.
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]

FROM ${TURING_BASE} AS turing
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv git tini groff-base \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG TORCH_WHEELS=
RUN --mount=type=bind,source=docker,target=/tmp/env --mount=type=secret,id=ca_bundle \
    sh /tmp/env/install.sh /tmp/env/requirements-cu126.lock "torch==2.13.0+cu126" "$TORCH_INDEX" "$TORCH_WHEELS"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=turing
WORKDIR /work
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp/home --shell /bin/bash enlace
USER 10001:10001
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]

FROM ${BLACKWELL_BASE} AS blackwell
# The rtx5090 profile sets compile: true. torch.compile's Triton backend builds a small C launcher per kernel
# at run time, with the system C compiler against Python.h: gcc and python3.12-dev are runtime needs here.
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
    gcc libc6-dev git tini groff-base \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_WHEELS=
RUN --mount=type=bind,source=docker,target=/tmp/env --mount=type=secret,id=ca_bundle \
    sh /tmp/env/install.sh /tmp/env/requirements-cu130.lock "torch==2.13.0+cu130" "$TORCH_INDEX" "$TORCH_WHEELS"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=blackwell
WORKDIR /work
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp/home --shell /bin/bash enlace
USER 10001:10001
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]
