#!/bin/sh
# Build the image's Python environment: every package from the target's lock file, checked against its
# sha256 hashes, then torch from the PyTorch wheel index of this target's CUDA (exact version with its
# local tag). Usage: install.sh LOCKFILE TORCH_INDEX_URL TORCH_PIN
set -eu
lock="$1" index="$2" torch_pin="$3"
python3 -m venv /opt/venv
# The lock holds the full transitive closure (including torch's pure-Python dependencies), so --no-deps
# loses nothing and --require-hashes refuses any file whose hash is not in it.
/opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r "$lock"
# torch comes last: its pure-Python dependencies are already satisfied from the lock, so this adds only
# torch and what it alone needs from its index (CUDA libraries, triton), pinned by version, not hashed
# (the PyTorch index is not part of the lock).
/opt/venv/bin/pip install --no-cache-dir --index-url "$index" "$torch_pin"
/opt/venv/bin/pip check
# The package itself is mounted at /work at run time (PYTHONPATH=/work/src); DVC stages call `enlace`.
printf '#!/bin/sh\nexec /opt/venv/bin/python -m enlace.cli "$@"\n' > /opt/venv/bin/enlace
chmod 755 /opt/venv/bin/enlace
# Containers run as the host user, who has no home in the image: HOME points here (git, dvc, matplotlib).
mkdir -p /tmp/home && chmod 1777 /tmp/home
