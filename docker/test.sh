#!/usr/bin/env bash
# make docker-test: build the `cpu` image and run ENLACE in it, as the host user, on a copy of this
# repository mounted at /work:
#   1. a Docker engine: the one that answers, else Debian's docker.io started here (stopped again at the end)
#   2. the base: the pinned python:3.11-slim-bookworm, or, where its registry cannot be reached, a local
#      Debian 12 base made with mmdebstrap from Debian's archive (cached by tag: a second run reuses it)
#   3. torch: from the PyTorch index, or, where that cannot be reached, from a folder of wheels
#   4. `enlace config check`, then `dvc repro smoke` (fetch + smoke, 150 steps) on a one-package corpus
#      (docker/test-data.yaml)
#   5. a short pretrain, stopped with `docker stop` mid-run and resumed in a new container, must end with the
#      checkpoint sha256s of an uninterrupted run of the same config
# Every phase prints its time; a failure prints one line starting with "docker-test: error:".
# Environment: ENLACE_DOCKER_BASE=auto|pinned|local (auto: pinned when its registry answers),
#   ENLACE_TORCH_WHEELS=DIR (a folder holding torch's cp311 wheel; default: pip's find-links, else /opt/wheels),
#   ENLACE_CA_BUNDLE=FILE (extra CA certificates for the build; default: $SSL_CERT_FILE when set),
#   ENLACE_DOCKER_ROOT=DIR (data-root of an engine started here; default /var/lib/enlace-docker),
#   KEEP=1 (keep the scratch copy).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
T0=$(date +%s)
PHASE=""
PHASE_T0=$T0
phase() {  # phase NAME: close the current phase with its duration, open the next
    local now; now=$(date +%s)
    [ -z "$PHASE" ] || printf 'docker-test: %s: %ss\n' "$PHASE" "$((now - PHASE_T0))"
    PHASE="$1"
    PHASE_T0=$now
    [ -z "$1" ] || printf 'docker-test: [%4ss] %s\n' "$((now - T0))" "$1"
}
die() { printf 'docker-test: error: %s\n' "$*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }

BASE_MODE="${ENLACE_DOCKER_BASE:-auto}"
case "$BASE_MODE" in auto | pinned | local) ;; *) die "ENLACE_DOCKER_BASE=$BASE_MODE: expected auto, pinned or local" ;; esac
DATA_ROOT="${ENLACE_DOCKER_ROOT:-/var/lib/enlace-docker}"
TORCH_PIN="$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$ROOT/requirements.txt")"
[ -n "$TORCH_PIN" ] || die "requirements.txt pins no torch version"
PINNED_BASE="$(sed -n 's/^cpu=//p' "$ROOT/docker/images.lock")"
[ -n "$PINNED_BASE" ] || die "docker/images.lock has no cpu= line"
IMAGE=enlace:cpu-test
NAME="enlace-docker-test-$$"
STARTED_ENGINE=""
SCRATCH=""

cleanup() {
    local rc=$?
    if [ -n "${DOCKER:-}" ]; then "$DOCKER" rm -f "$NAME" >/dev/null 2>&1 || true; fi
    if [ -n "$SCRATCH" ] && [ -z "${KEEP:-}" ]; then rm -rf "$SCRATCH"; fi
    if [ -n "$STARTED_ENGINE" ]; then
        kill "$(cat "$STARTED_ENGINE")" 2>/dev/null || true
        for _ in $(seq 1 50); do [ -e "$STARTED_ENGINE" ] || break; sleep 0.2; done
        printf 'docker-test: stopped the Docker engine this test started\n'
    fi
    [ -n "$SCRATCH" ] && [ -n "${KEEP:-}" ] && printf 'docker-test: scratch copy kept in %s\n' "$SCRATCH"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. the engine --------------------------------------------------------------------------------------------
phase "engine"
# The build needs BuildKit (bind mount, secret). A client with buildx uses it; a client older than 23 has it
# built in (DOCKER_BUILDKIT=1); a newer client without buildx has neither (it falls back to the legacy builder).
pick_client() {
    local c major
    for c in $(type -ap docker) /usr/bin/docker; do
        [ -x "$c" ] || continue
        if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return; fi
        major="$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)"
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$c"; return; fi
    done
}
engine_state() {  # prints ok, permission or none
    local out
    # docker 20.10 prints a server error in its output, not on stderr: read both.
    if out="$("${DOCKER:-docker}" info 2>&1)"; then echo ok; return; fi
    case "$out" in *"permission denied"*) echo permission ;; *) echo none ;; esac
}
DOCKER="$(pick_client || true)"
state=none
if [ -n "$DOCKER" ] || command -v docker >/dev/null; then state="$(engine_state)"; fi
if [ "$state" = permission ]; then
    die "permission denied on the Docker socket (${DOCKER_HOST:-/var/run/docker.sock}): add $(id -un) to the docker group (then log in again) or run as root"
fi
if [ "$state" = none ]; then
    if ! command -v dockerd >/dev/null || [ ! -x /usr/bin/docker ]; then
        [ "$(id -u)" = 0 ] || command -v sudo >/dev/null || die "no Docker engine answers, and installing one (Debian's docker.io) needs root"
        printf 'docker-test: installing Debian docker.io\n'
        { as_root apt-get install -y -q --no-install-recommends docker.io >/dev/null 2>&1 ||
            { as_root apt-get update -q >/dev/null && as_root apt-get install -y -q --no-install-recommends docker.io >/dev/null; }; } ||
            die "no Docker engine answers, and apt-get install docker.io failed"
    fi
    [ "$(id -u)" = 0 ] || die "no Docker engine answers, and starting one (dockerd) needs root"
    DOCKER="$(pick_client || true)"
    [ -n "$DOCKER" ] || die "no docker client with BuildKit (buildx, or Docker 20.10-22's built-in) found"
    # Its own socket, data-root, pidfile and log: nothing of a system engine is touched, and the data-root
    # persists, so a second run finds the cached base image and build layers.
    sock=/run/enlace-docker.sock
    export DOCKER_HOST="unix://$sock"
    if [ "$(engine_state)" != ok ]; then
        mkdir -p "$DATA_ROOT"
        dockerd --data-root "$DATA_ROOT" --pidfile /run/enlace-dockerd.pid --exec-root /run/enlace-docker \
            -H "$DOCKER_HOST" >"$DATA_ROOT.log" 2>&1 &
        STARTED_ENGINE=/run/enlace-dockerd.pid
        for _ in $(seq 1 150); do [ "$(engine_state)" = ok ] && break; sleep 0.2; done
        [ "$(engine_state)" = ok ] || die "dockerd did not answer within 30 s; its log: $DATA_ROOT.log"
        printf 'docker-test: started dockerd (data-root %s, log %s.log)\n' "$DATA_ROOT" "$DATA_ROOT"
    fi
fi
[ -n "$DOCKER" ] || die "no docker client with BuildKit found (install docker-buildx, or use Debian's docker.io)"
"$DOCKER" buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=1
printf 'docker-test: client %s, engine %s\n' "$DOCKER" "$("$DOCKER" version --format '{{.Server.Version}}')"

# --- 2. the base image ----------------------------------------------------------------------------------------
phase "base image"
registry_answers() {  # the registry of the pinned image answers over HTTPS (any HTTP status will do)
    local host="registry-1.docker.io" first="${PINNED_BASE%%/*}"
    case "$first" in *.*) host="$first" ;; esac
    python3 - "$host" <<'PY'
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"https://{sys.argv[1]}/v2/", timeout=10)
except urllib.error.HTTPError:
    pass  # 401 from a registry: it answers
except Exception:
    sys.exit(1)
PY
}
if [ "$BASE_MODE" = auto ]; then
    if registry_answers; then BASE_MODE=pinned; else
        BASE_MODE=local
        printf 'docker-test: the registry of %s cannot be reached: building on a local Debian 12 base\n' "${PINNED_BASE%@*}"
    fi
fi
if [ "$BASE_MODE" = pinned ]; then
    if ! "$DOCKER" image inspect "$PINNED_BASE" >/dev/null 2>&1; then
        out="$(timeout 600 "$DOCKER" pull -q "$PINNED_BASE" 2>&1)" ||
            die "cannot pull the pinned base $PINNED_BASE: $(printf '%s' "$out" | tail -1) (run make docker-pin where the registry answers, or ENLACE_DOCKER_BASE=local)"
    fi
    BASE="$PINNED_BASE"
else
    # A Debian 12 base from Debian's archive: the mirror and suites the pinned python:3.11-slim-bookworm uses,
    # Debian's Python 3.11 (the lock's), and the host's CA bundle (this test base only: it lets tools in the
    # container that read the system store through a TLS-intercepting proxy). Tagged by what goes in.
    mirror="$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -1 | tr -d ' ' || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    mirror="${mirror%/}"
    host_ca="${ENLACE_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
    [ -s "$host_ca" ] || host_ca=/dev/null
    packages="ca-certificates,python3,python3-venv"
    key="$( { echo "bookworm $mirror $packages"; cat "$host_ca"; } | sha256sum | cut -c1-12)"
    BASE="enlace-test-base:bookworm-$key"
    if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
        printf 'docker-test: reusing %s\n' "$BASE"
    else
        [ "$(id -u)" = 0 ] || die "building the local base (mmdebstrap) needs root; or set ENLACE_DOCKER_BASE=pinned"
        if ! command -v mmdebstrap >/dev/null; then
            { as_root apt-get install -y -q --no-install-recommends mmdebstrap >/dev/null 2>&1 ||
                { as_root apt-get update -q >/dev/null && as_root apt-get install -y -q --no-install-recommends mmdebstrap >/dev/null; }; } ||
                die "apt-get install mmdebstrap failed"
        fi
        printf 'docker-test: mmdebstrap bookworm from %s\n' "$mirror"
        log="$(mktemp)"
        nice -n 10 mmdebstrap --variant=minbase --include="$packages" \
            --customize-hook="upload $host_ca /usr/local/share/ca-certificates/enlace-host-bundle.crt" \
            --customize-hook='chroot "$1" update-ca-certificates' \
            bookworm - "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
            "deb ${mirror}-security bookworm-security main" 2>"$log" |
            "$DOCKER" import -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$BASE" >/dev/null ||
            die "mmdebstrap | docker import failed: $(tail -1 "$log")"
        rm -f "$log"
    fi
fi

# --- 3. the repository copy, torch, the build -----------------------------------------------------------------
phase "build"
# A copy of the work tree (tracked and untracked, not ignored files): the runs write data/, runs/, .dvc/cache
# and dvc.lock there, never in this checkout.
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/enlace-docker-test.XXXXXX")"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SCRATCH"
build_args=(--target cpu -t "$IMAGE" --build-arg "CPU_BASE=$BASE")
torch_index_answers() {
    python3 -c 'import urllib.request; urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)' 2>/dev/null
}
if [ "$BASE_MODE" = local ] || ! torch_index_answers; then
    wheel_dir="${ENLACE_TORCH_WHEELS:-${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || echo /opt/wheels)}}"
    wheel="$(ls "$wheel_dir"/torch-"$TORCH_PIN"+cpu-cp311-cp311-*linux*x86_64.whl 2>/dev/null | head -1 || true)"
    [ -n "$wheel" ] || die "the PyTorch index cannot be reached and $wheel_dir holds no torch-$TORCH_PIN+cpu cp311 wheel (set ENLACE_TORCH_WHEELS)"
    mkdir -p "$SCRATCH/docker/wheels"
    ln "$wheel" "$SCRATCH/docker/wheels/" 2>/dev/null || cp "$wheel" "$SCRATCH/docker/wheels/"
    build_args+=(--build-arg TORCH_WHEELS=docker/wheels)
    printf 'docker-test: torch from %s\n' "$wheel"
fi
ca="${ENLACE_CA_BUNDLE:-${SSL_CERT_FILE:-}}"
if [ -n "$ca" ] && [ -s "$ca" ]; then build_args+=(--secret "id=ca_bundle,src=$ca"); fi
log="$SCRATCH/build.log"
nice -n 10 "$DOCKER" build "${build_args[@]}" --progress=plain "$SCRATCH" >"$log" 2>&1 || {
    tail -20 "$log" >&2
    die "docker build --target cpu failed (last lines above)"
}
printf 'docker-test: built %s on %s (%s)\n' "$IMAGE" "$BASE" "$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"

# --- 4. config check and the smoke stage, in the container -----------------------------------------------------
# The scratch copy selects the test corpus and the bit-exact fp32 CPU profile (no compile: seconds of
# training, not minutes), the way `make docker-cpu` selects a card's layers: params.yaml's config block. The
# smoke stage runs SMOKE_STEPS steps instead of its 300 (its checks are the same: the loss must fall below
# 0.8x its start, and resuming from the next-to-last checkpoint must give the final weights bit for bit).
SMOKE_STEPS=150
cp "$ROOT/docker/test-data.yaml" "$SCRATCH/configs/data/docker-test.yaml"
sed -i -e '/^config:/,/^[a-z]/{s/^\(  hardware:\).*/\1 cpu/;s/^\(  data:\).*/\1 docker-test/}' \
    -e "/^smoke:/,/^[a-z]/{/^  set:/a\\    train.max_steps: $SMOKE_STEPS" -e '}' "$SCRATCH/params.yaml"
(cd "$SCRATCH" && git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm scratch)
docker_env=(-e OMP_WAIT_POLICY=PASSIVE)
run=("$DOCKER" run --rm -v "$SCRATCH":/work -w /work --user "$(id -u):$(id -g)" "${docker_env[@]}")
phase "enlace config check"
"${run[@]}" "$IMAGE" enlace config check || die "enlace config check failed in the container"
phase "dvc repro smoke (fetch + smoke)"
# The stage's full output (datatrove's and the progress bar's) goes to a log; its summary lines come here.
"${run[@]}" "$IMAGE" nice -n 10 dvc repro smoke >"$SCRATCH/smoke.log" 2>&1 || {
    tr '\r' '\n' <"$SCRATCH/smoke.log" | tail -15 >&2
    die "dvc repro smoke failed in the container"
}
tr '\r' '\n' <"$SCRATCH/smoke.log" | grep -E "^(Running stage|corpus:|smoke:)" | sed 's/^/docker-test:   /' || true
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); assert m["resume_exact"] is True and m["steps"] == int(sys.argv[2]), m' \
    "$SCRATCH/runs/smoke/metrics.json" "$SMOKE_STEPS" || die "the smoke stage did not report an exact resume after $SMOKE_STEPS steps"

# --- 5. pretrain: uninterrupted, and stopped with docker stop then resumed in a new container ------------------
STEPS=40
pretrain=(nice -n 10 enlace pretrain --model smoke --train smoke --no-progress --set train.max_steps=$STEPS
    --set train.schedule.warmup_steps=5 --set train.schedule.decay_steps=20 --set train.checkpoint.every=10
    --set train.log_every=5)
phase "pretrain, uninterrupted ($STEPS steps of the smoke model)"
"${run[@]}" "$IMAGE" "${pretrain[@]}" --run-dir runs/docker-test/straight >"$SCRATCH/straight.log" 2>&1 || {
    tail -5 "$SCRATCH/straight.log" >&2
    die "the uninterrupted pretrain failed in the container"
}
phase "pretrain, stopped with docker stop after its first checkpoint"
resumed="$SCRATCH/runs/docker-test/resumed"
"$DOCKER" run -d --name "$NAME" -v "$SCRATCH":/work -w /work --user "$(id -u):$(id -g)" "${docker_env[@]}" \
    "$IMAGE" "${pretrain[@]}" --run-dir runs/docker-test/resumed >/dev/null
for _ in $(seq 1 1200); do
    compgen -G "$resumed/checkpoints/step-*/COMPLETE" >/dev/null && break
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$NAME")" = true ] || break
    sleep 0.5
done
compgen -G "$resumed/checkpoints/step-*/COMPLETE" >/dev/null || die "no checkpoint appeared before the stop"
"$DOCKER" stop -t 60 "$NAME" >/dev/null
code="$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$NAME")"
"$DOCKER" logs "$NAME" >"$SCRATCH/stopped.log" 2>&1
"$DOCKER" rm "$NAME" >/dev/null
last="$(basename "$(ls -d "$resumed"/checkpoints/step-* | sort | tail -1)")"
last=$((10#${last#step-}))
# 143: the trainer took SIGTERM, finished its step and saved a checkpoint (enlace pretrain --help).
[ "$code" = 143 ] || die "the stopped container exited $code, not 143 (SIGTERM handled, checkpoint saved); log: $SCRATCH/stopped.log"
[ "$last" -lt "$STEPS" ] || die "the run had finished before docker stop: nothing to resume"
printf 'docker-test: stopped at step %s of %s (exit %s: SIGTERM, checkpoint saved)\n' "$last" "$STEPS" "$code"
cp "$resumed/metrics.jsonl" "$SCRATCH/stopped.jsonl"
phase "pretrain, resumed in a new container"
"${run[@]}" "$IMAGE" "${pretrain[@]}" --run-dir runs/docker-test/resumed >"$SCRATCH/resumed.log" 2>&1 || {
    tail -5 "$SCRATCH/resumed.log" >&2
    die "the resumed pretrain failed in the container"
}
# A resume keeps the log's records up to its checkpoint byte for byte (each holds that interval's measured
# tokens/s); a run that started over would have rewritten them: the final weights alone cannot tell.
python3 - "$SCRATCH/stopped.jsonl" "$resumed/metrics.jsonl" "$last" <<'PY' || die "the second container did not resume from step $last: it rewrote the log before it"
import json, sys
def upto(path, step):
    return [ln for ln in open(path) if ln.strip() and json.loads(ln)["step"] <= step]
before, after = upto(sys.argv[1], int(sys.argv[3])), upto(sys.argv[2], int(sys.argv[3]))
sys.exit(0 if before and before == after else 1)
PY
phase "compare checkpoints"
final="step-$(printf '%08d' "$STEPS")"
sums() { (cd "$SCRATCH/runs/docker-test/$1/checkpoints/$final" && sha256sum ./*.safetensors) || die "$1 has no $final"; }
a="$(sums straight)"
b="$(sums resumed)"
printf '%s\n' "$a" | sed 's/^/docker-test:   /'
[ "$a" = "$b" ] || { printf '%s\n' "$b" >&2; die "the resumed run's $final differs from the uninterrupted run's"; }
printf 'docker-test: the resumed run equals the uninterrupted one at %s (sha256 of every tensor file)\n' "$final"
phase ""
printf 'docker-test: passed in %ss\n' "$(($(date +%s) - T0))"
