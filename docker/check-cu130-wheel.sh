#!/usr/bin/env bash
# Check, without a GPU, the torch build the blackwell image relies on: PyPI's own torch wheel for Linux x86-64
# is the CUDA 13.0 build. Installs it, with the nvidia-*/cuda-* wheels it pulls (about 2.6 GB), into a venv in
# a container of a Debian 12 base image, then requires torch.version.cuda 13.0 and sm_120 among the compiled
# architectures (read from the library: torch.cuda.get_arch_list() answers [] when no GPU is present).
# Usage: docker/check-cu130-wheel.sh BASE_IMAGE [WHEEL_DIR]
#   BASE_IMAGE  an image with python3 and python3-venv, e.g. the enlace-test-base:bookworm-* that
#               `make docker-test` leaves (ENLACE_DOCKER_BASE=local)
#   WHEEL_DIR   where the wheels are downloaded to, or already are (default /tmp/enlace-cu130)
# Needs PyPI and an engine that `docker` reaches (DOCKER names the client).
set -euo pipefail
base="${1:?usage: $0 BASE_IMAGE [WHEEL_DIR]}"
wheels="${2:-/tmp/enlace-cu130}"
root="$(cd "$(dirname "$0")/.." && pwd)"
pin="$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$root/requirements.txt")"
docker="${DOCKER:-docker}"
mkdir -p "$wheels"
# pip runs in the container, so the wheels match the base's Python and platform; it trusts the base's
# system CA store (where the local test base carries the host's bundle), and keeps the download in WHEEL_DIR.
"$docker" run --rm -v "$wheels":/wheels -e PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$base" sh -ec "
    python3 -m venv /tmp/v
    /tmp/v/bin/pip download -q --disable-pip-version-check --only-binary=:all: -d /wheels torch==$pin
    du -sh /wheels
    /tmp/v/bin/pip install -q --disable-pip-version-check --no-index --find-links /wheels torch==$pin
    /tmp/v/bin/python - <<'PY'
import torch
flags = torch._C._cuda_getArchFlags().split()
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'archs', ' '.join(flags))
assert torch.version.cuda.startswith('13.0'), torch.version.cuda
assert 'sm_120' in flags, flags
print('cu130 wheel: CUDA', torch.version.cuda, 'with sm_120 kernels')
PY"
