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


def test_base_images_pinned_and_match_lock() -> None:
    lock = dict(
        line.split("=", 1)
        for line in (ROOT / "docker/images.lock").read_text().splitlines()
        if line and not line.startswith("#")
    )
    st = stages()
    assert set(st) == set(TARGETS) == set(lock)
    for name, text in st.items():
        ref = re.match(r"FROM (\S+)", text).group(1)
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), ref
        assert ref == lock[name], f"Dockerfile target {name} uses {ref}, docker/images.lock says {lock[name]}"


def test_wheel_index_and_cuda_versions() -> None:
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    for name, text in stages().items():
        tag, cuda, _, _ = TARGETS[name]
        m = re.search(r"(https://download\.pytorch\.org/whl/(\w+)) \"torch==([^\"]+)\"", text)
        assert m, f"target {name} names no torch index and pin"
        assert m.group(2) == tag, f"{name} installs from {m.group(2)}, expected {tag}"
        assert m.group(3) == f"{req['torch']}+{tag}", (
            f"{name} pins torch {m.group(3)}; requirements.txt has {req['torch']}"
        )
        lock = ROOT / f"docker/requirements-{tag}.lock"
        assert f"torch=={req['torch']}+{tag}" in lock.read_text() and f"whl/{tag}" in lock.read_text()
        assert f"requirements-{tag}.lock" in text
        if cuda:
            base_cuda = re.match(r"FROM nvidia/cuda:(\d+\.\d+)", text).group(1)
            assert base_cuda == cuda, (name, base_cuda, tag)
            # The wheel the Dockerfile installs must have kernels for the card its hardware profile names.
            sm = tuple(profile(TARGETS[name][2])["min_compute_capability"])
            assert sm <= WHEEL_MAX_SM[m.group(2)], f"{name}: {m.group(2)} wheels have no kernels for sm {sm}"


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
