"""The container setup agrees with itself: base images, lock files, requirements.txt and the Make targets."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
GPU_SM = {"turing": (7, 5), "blackwell": (12, 0)}


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
            assert base_cuda == cuda == f"{tag[2:-1]}.{tag[-1]}", (name, base_cuda, tag)
            assert GPU_SM[name] <= WHEEL_MAX_SM[tag], f"{tag} wheels have no kernels for sm_{GPU_SM[name]}"
    # the trap the two targets exist for: a cu126 image on a 5090
    assert not GPU_SM["blackwell"] <= WHEEL_MAX_SM["cu126"]


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
