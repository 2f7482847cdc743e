#!/bin/sh
# Build the image's Python environment: every package from the target's lock file, checked against its
# sha256 hashes, then torch, pinned by exact version with its local tag, from the PyTorch wheel index of this
# target's CUDA, or from a folder of wheels under docker/ (TORCH_WHEELS: the local test build).
# Usage: install.sh LOCKFILE TORCH_PIN TORCH_INDEX_URL [TORCH_WHEELS]
# The Dockerfile mounts docker/ at /tmp/env for this step only, and an optional extra CA bundle (a BuildKit
# secret) at /run/secrets/ca_bundle: nothing of either stays in the image.
set -eu
lock="$1" torch_pin="$2" index="$3" wheels="${4:-}"
python3 -m venv /opt/venv
pip="/opt/venv/bin/pip --no-cache-dir --disable-pip-version-check"
# Behind a TLS-intercepting proxy: pip trusts its own bundle plus the proxy's CA, for this build only.
if [ -s /run/secrets/ca_bundle ]; then
    cat "$(/opt/venv/bin/python -c 'import pip._vendor.certifi as c; print(c.where())')" \
        /run/secrets/ca_bundle > /tmp/ca-bundle.pem
    export PIP_CERT=/tmp/ca-bundle.pem
    echo "install.sh: trusting the extra CA bundle given as the ca_bundle secret (build only)"
fi
# The lock holds the full transitive closure (including torch's pure-Python dependencies), so --no-deps
# loses nothing and --require-hashes refuses any file whose hash is not in it.
$pip install --require-hashes --no-deps -r "$lock"
# torch comes last: its pure-Python dependencies are already satisfied from the lock, so this adds only
# torch and what it alone needs from its index (CUDA libraries, triton), pinned by version, not hashed
# (the PyTorch index is not part of the lock).
if [ -n "$wheels" ]; then
    [ -d "/tmp/env/${wheels#docker/}" ] || { echo "install.sh: TORCH_WHEELS=$wheels: no such folder under docker/" >&2; exit 1; }
    $pip install --no-index --find-links "/tmp/env/${wheels#docker/}" "$torch_pin"
else
    $pip install --index-url "$index" "$torch_pin"
fi
$pip check
rm -f /tmp/ca-bundle.pem
# The package itself is mounted at /work at run time (PYTHONPATH=/work/src); DVC stages call `enlace`.
printf '#!/bin/sh\nexec /opt/venv/bin/python -m enlace.cli "$@"\n' > /opt/venv/bin/enlace
chmod 755 /opt/venv/bin/enlace
# Containers run as the host user, who has no home in the image: HOME points here (git, dvc, matplotlib).
mkdir -p /tmp/home && chmod 1777 /tmp/home
