# syntax=docker/dockerfile:1
# ENLACE images, one pinned target per GPU generation:
#   cpu        CPU-only torch                               docker build --target cpu -t enlace:cpu .
#   turing     RTX 20xx (sm_75): CUDA 12.6 wheels            docker build --target turing -t enlace:turing .
#   blackwell  RTX 50xx (sm_120): CUDA 13.0 wheels           docker build --target blackwell -t enlace:blackwell .
# Why two CUDA targets: cu126 wheels have no sm_120 kernels ("no kernel image" on a 5090), and cu130 needs
# driver >= 580, which Turing machines often lack. The wheels bring their own CUDA libraries, so the small
# `base` CUDA images suffice. Base images are pinned by tag and digest, equal to docker/images.lock.
#
# The image holds the environment only. The repository is mounted at run time (-v "$PWD":/work -w /work),
# so .git, the DVC cache and checkpoints stay on the host; containers run as the host user.

FROM python:3.12-slim-bookworm@sha256:34386ef0cb081344d7ec1c103ba398e6e9f64e9ab3a1509accc92a4e24a07258 AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends git tini groff-base \
    && rm -rf /var/lib/apt/lists/*
COPY docker/install.sh docker/requirements-cpu.lock /tmp/env/
RUN sh /tmp/env/install.sh /tmp/env/requirements-cpu.lock https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=cpu
WORKDIR /work
# tini -g forwards signals to the whole process group: stopping the container stops dvc *and* the trainer.
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]

FROM nvidia/cuda:12.6.3-base-ubuntu24.04@sha256:c87e78933f4c16e3272123bf2f75537306596d0fbaa395a29696a22786e5ee0e AS turing
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv git tini groff-base \
    && rm -rf /var/lib/apt/lists/*
COPY docker/install.sh docker/requirements-cu126.lock /tmp/env/
RUN sh /tmp/env/install.sh /tmp/env/requirements-cu126.lock https://download.pytorch.org/whl/cu126 "torch==2.13.0+cu126"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=turing
WORKDIR /work
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]

FROM nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:f8ef28f579ea42a44b415d2c5d46f788e6a9b395c6c83f2929416e1fc192c143 AS blackwell
# The rtx5090 profile sets compile: true. torch.compile's Triton backend builds a small C launcher per kernel
# at run time, with the system C compiler against Python.h: gcc and python3.12-dev are runtime needs here.
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
    gcc libc6-dev git tini groff-base \
    && rm -rf /var/lib/apt/lists/*
COPY docker/install.sh docker/requirements-cu130.lock /tmp/env/
RUN sh /tmp/env/install.sh /tmp/env/requirements-cu130.lock https://download.pytorch.org/whl/cu130 "torch==2.13.0+cu130"
ENV PATH=/opt/venv/bin:$PATH DVC_NO_ANALYTICS=1 PYTHONUNBUFFERED=1 HOME=/tmp/home \
    PYTHONPATH=/work/src ENLACE_IMAGE=blackwell
WORKDIR /work
ENTRYPOINT ["tini", "-g", "--"]
CMD ["bash"]
