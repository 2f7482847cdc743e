#!/bin/sh
# Build the image's Python environment: torch from the PyTorch wheel index of this target's CUDA
# (exact version with its local tag), then everything else from the target's lock file.
# Usage: install.sh LOCKFILE TORCH_INDEX_URL TORCH_PIN
set -eu
lock="$1" index="$2" torch_pin="$3"
python3 -m venv /opt/venv
# torch brings its CUDA libraries (nvidia-* wheels) and triton from the same index; those are not hashed
# here (download.pytorch.org was unreachable where the locks were written).
/opt/venv/bin/pip install --no-cache-dir --index-url "$index" "$torch_pin"
# The lock pins every other package; --require-hashes once `make docker-lock` has added hashes.
if grep -q -- '--hash=' "$lock"; then
  /opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r "$lock"
else
  /opt/venv/bin/pip install --no-cache-dir -r "$lock"
fi
/opt/venv/bin/pip check
# The package itself is mounted at /work at run time (PYTHONPATH=/work/src); DVC stages call `enlace`.
printf '#!/bin/sh\nexec /opt/venv/bin/python -m enlace.cli "$@"\n' > /opt/venv/bin/enlace
chmod 755 /opt/venv/bin/enlace
# Containers run as the host user, who has no home in the image: HOME points here (git, dvc, matplotlib).
mkdir -p /tmp/home && chmod 1777 /tmp/home
