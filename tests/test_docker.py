"""The container setup agrees with itself: base images, lock files, requirements.txt and the Make targets."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
# target -> (wheel tag, CUDA version of the base image or None, hardware profile, make target)
TARGETS = {
    "cpu": ("cpu", None, "cpu", "docker-cpu"),
    "turing": ("cu126", "12.6", "rtx2060", "docker-2060"),
    "blackwell": ("cu130", "13.0", "rtx5090", "docker-5090"),
}
# Newest SM each wheel flavour has kernels for (PyTorch's release matrix): cu126 stops at sm_90.
WHEEL_MAX_SM = {"cu126": (9, 0), "cu130": (12, 0)}


def profile(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs/hardware" / f"{name}.yaml").read_text())


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def stages() -> dict[str, str]:
    """Dockerfile stage name -> its text."""
    parts = re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)
    return {re.search(r" AS (\S+)", p).group(1): p for p in parts if p.startswith("FROM ")}


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM (the base images): name -> default."""
    preamble = DOCKERFILE.split("\nFROM ", 1)[0]
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", preamble, flags=re.M))


def base_ref(stage: str) -> str:
    """The pinned base a stage builds on: the default of the build argument its FROM names."""
    arg = re.match(r"FROM \$\{(\w+)\} AS ", stages()[stage])
    assert arg, f"target {stage}: FROM must name a build argument (make docker-test swaps in a local base)"
    return global_args()[arg.group(1)]


def lock_python(tag: str) -> str:
    """The Python version a lock file was compiled for, from its header and from the Makefile's LOCKS."""
    header = re.search(r"Python (3\.\d+), linux", (ROOT / f"docker/requirements-{tag}.lock").read_text())
    locks = dict(e.split(":") for e in re.search(r"^LOCKS := (.*)$", MAKEFILE, flags=re.M).group(1).split())
    assert header and header.group(1) == locks[tag], (tag, header, locks)
    return locks[tag]


def test_base_images_pinned_and_match_lock() -> None:
    lock = dict(
        line.split("=", 1)
        for line in (ROOT / "docker/images.lock").read_text().splitlines()
        if line and not line.startswith("#")
    )
    st = stages()
    assert set(st) == set(TARGETS) == set(lock)
    for name in st:
        ref = base_ref(name)
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), ref
        assert ref == lock[name], f"Dockerfile target {name} uses {ref}, docker/images.lock says {lock[name]}"


def test_one_python_per_image_and_lock() -> None:
    """A lock installs only on the Python it was compiled for (3.12-only wheels such as contourpy 1.4)."""
    for name, text in stages().items():
        tag = TARGETS[name][0]
        if name == "cpu":
            # python:3.11-slim-bookworm, and docker/test.sh's local base: Debian 12 (bookworm) ships 3.11.
            python = re.match(r"python:(3\.\d+)-slim-bookworm@", base_ref(name))
            assert python and python.group(1) == lock_python(tag) == "3.11"
            assert "bookworm - " in (ROOT / "docker/test.sh").read_text()
        else:
            assert "ubuntu24.04" in base_ref(name) and "python3.12-venv" in apt_packages(text)
            assert lock_python(tag) == "3.12", name


def test_wheel_index_and_cuda_versions() -> None:
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    for name, text in stages().items():
        tag, cuda, _, _ = TARGETS[name]
        index = re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/(\w+)$", text, flags=re.M)
        pin = re.search(r'install\.sh \S+ "torch==([^"]+)" "\$TORCH_INDEX" "\$TORCH_WHEELS"', text)
        assert index and pin, f"target {name} names no torch index and pin"
        assert index.group(1) == tag, f"{name} installs from {index.group(1)}, expected {tag}"
        assert pin.group(1) == f"{req['torch']}+{tag}", (
            f"{name} pins torch {pin.group(1)}; requirements.txt has {req['torch']}"
        )
        lock = ROOT / f"docker/requirements-{tag}.lock"
        assert f"torch=={req['torch']}+{tag}" in lock.read_text() and f"whl/{tag}" in lock.read_text()
        assert f"requirements-{tag}.lock" in text
        if cuda:
            base_cuda = re.match(r"nvidia/cuda:(\d+\.\d+)", base_ref(name)).group(1)
            assert base_cuda == cuda, (name, base_cuda, tag)
            # The wheel the Dockerfile installs must have kernels for the card its hardware profile names.
            sm = tuple(profile(TARGETS[name][2])["min_compute_capability"])
            assert sm <= WHEEL_MAX_SM[tag], f"{name}: {tag} wheels have no kernels for sm {sm}"


def test_build_inputs_stay_out_of_the_image() -> None:
    """docker/ comes in through a bind mount and the extra CA bundle through a secret: no layer holds either,
    and no certificate is written into the Dockerfile. No `syntax` line: BuildKit would fetch that frontend
    from Docker Hub."""
    assert "BEGIN CERTIFICATE" not in DOCKERFILE and not re.search(r"^COPY|^ADD", DOCKERFILE, flags=re.M)
    assert not re.search(r"^# *syntax *=", DOCKERFILE, flags=re.M)
    for name, text in stages().items():
        run = re.search(r"^RUN --mount=type=bind,source=docker,target=/tmp/env (.*)$", text, flags=re.M)
        assert run and "--mount=type=secret,id=ca_bundle" in run.group(1), name
        assert re.search(r"^ARG TORCH_WHEELS=$", text, flags=re.M), name
    install = (ROOT / "docker/install.sh").read_text()
    assert "/run/secrets/ca_bundle" in install and "PIP_CERT" in install
    # Wheels put under docker/ for a build reach the context (.dockerignore) but never git.
    assert {"!docker/install.sh", "!docker/requirements-*.lock", "!docker/wheels/"} <= set(
        (ROOT / ".dockerignore").read_text().splitlines()
    )
    assert "/docker/wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_docker_test_corpus_is_part_of_the_default() -> None:
    """docker/test.sh's corpus is a real data config: one source of the default corpus, pinned the same."""
    from enlace.config.data import DataConfig

    test = DataConfig.model_validate(yaml.safe_load((ROOT / "docker/test-data.yaml").read_text()))
    default = DataConfig.model_validate(yaml.safe_load((ROOT / "configs/data/es-debian.yaml").read_text()))
    assert test.name == "docker-test" and len(test.sources) == 1
    source = test.sources[0]
    assert source.kind == "deb" and source.sha256
    assert any(source.model_dump() == s.model_dump() | {"weight": source.weight} for s in default.sources)


def test_locks_agree_with_requirements() -> None:
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    for tag in ("cpu", "cu126", "cu130"):
        lock = pins((ROOT / f"docker/requirements-{tag}.lock").read_text().splitlines())
        assert "torch" not in lock, "torch comes from its CUDA index, not the lock"
        for name, version in req.items():
            if name != "torch":
                assert lock.get(name) == version, (
                    f"requirements-{tag}.lock: {name} {lock.get(name)} != {version}"
                )


def test_locks_are_complete_and_hashed() -> None:
    """install.sh installs each lock with --require-hashes --no-deps: every entry needs a hash, and torch's
    own pure-Python dependencies must be in it (torch, installed after, then finds them satisfied)."""
    install = (ROOT / "docker/install.sh").read_text()
    assert "--require-hashes --no-deps" in install and "if grep" not in install
    torch_deps = {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-")
        for r in importlib.metadata.requires("torch") or []
        if "extra ==" not in r
    }
    for tag in ("cpu", "cu126", "cu130"):
        text = (ROOT / f"docker/requirements-{tag}.lock").read_text()
        entries: list[list[str]] = []  # one package: its pin line and the indented lines under it
        for line in text.splitlines():
            if re.match(r"[A-Za-z0-9]", line):
                entries.append([line])
            elif line.startswith(" ") and entries:
                entries[-1].append(line)
        locked = pins(text.splitlines())
        assert len(locked) > 50 and len(entries) == len(locked), tag
        for entry in entries:
            assert any("--hash=sha256:" in x for x in entry), (
                f"requirements-{tag}.lock: no hash for {entry[0]}"
            )
        missing = {d for d in torch_deps if not d.startswith(("nvidia-", "cuda-", "triton"))} - set(locked)
        assert not missing, f"requirements-{tag}.lock lacks torch's dependencies {missing}"
        assert not any(n.startswith(("nvidia-", "cuda-", "triton")) for n in locked), tag


def apt_packages(stage_text: str) -> set[str]:
    """Package names the stage's `apt-get install` lines name (comments excluded)."""
    commands = re.sub(r"\\\n", " ", "\n".join(ln for ln in stage_text.splitlines() if not ln.startswith("#")))
    return {
        word
        for m in re.finditer(r"apt-get install ([^&\n]*)", commands)
        for word in m.group(1).split()
        if not word.startswith("-")
    }


def test_compiling_profiles_get_a_compiler() -> None:
    # torch.compile (Triton) builds C launchers at run time: a C compiler and Python headers must be there.
    compiling = [name for name in stages() if profile(TARGETS[name][2]).get("compile")]
    assert compiling, "no profile compiles: this test checks nothing"
    for name in compiling:
        packages = apt_packages(stages()[name])
        assert {"gcc", "libc6-dev"} <= packages and any(
            p.endswith("-dev") and "python" in p for p in packages
        ), (
            name,
            packages,
        )


def test_runtime_setup() -> None:
    for name, text in stages().items():
        assert 'ENTRYPOINT ["tini", "-g", "--"]' in text, name
        assert "DVC_NO_ANALYTICS=1" in text and "HOME=" in text, name


def test_images_do_not_run_as_root() -> None:
    # A plain `docker run` without --user gets an unprivileged user, never root.
    for name, text in stages().items():
        users = re.findall(r"^USER (\S+)$", text, flags=re.M)
        assert users, f"target {name}: no USER line (it would run as root)"
        assert users[-1].split(":")[0] not in ("root", "0"), (name, users)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_make_targets_expand(target: str) -> None:
    _, _, profile, make_target = TARGETS[target]
    out = subprocess.run(
        ["make", "-n", make_target], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert f"docker build --target {target} -t enlace:{target} ." in out
    assert "dvc repro" in out and "--user $(id -u):$(id -g)" in out and '-v "' in out
    assert f"hardware:\\).*/\\1 {profile}/" in out  # the profile every stage reads
    assert ("--gpus all" in out) == (target != "cpu")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_docker_test_expands() -> None:
    # --no-print-directory: under `make test` the child make would announce its directory (MAKELEVEL).
    cmd = ["make", "-n", "--no-print-directory", "docker-test"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "bash docker/test.sh"
    assert "make docker-test" in (ROOT / ".ci/run").read_text()


def test_docker_test_script_fails_with_one_line() -> None:
    """docker/test.sh parses, and a bad setting stops it before it touches an engine, with one error line."""
    script = ROOT / "docker/test.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    res = subprocess.run(
        ["bash", str(script)],
        env={"PATH": "/usr/bin:/bin", "ENLACE_DOCKER_BASE": "registry"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert res.stderr == ("docker-test: error: ENLACE_DOCKER_BASE=registry: expected auto, pinned or local\n")
