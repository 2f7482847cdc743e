"""A training process killed (SIGKILL) mid-run or mid-checkpoint, or stopped (SIGTERM), resumes exactly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoint_digests,
    config_from_dict,
    loaders_for,
    logged_losses,
    spawn_trainer,
    tiny_dict,
    write_config,
)

from enlace.train.checkpoint import (
    clean_partial,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    step_dirname,
)
from enlace.train.metrics import read_jsonl
from enlace.train.trainer import train

STEPS = {"train.max_steps": 40, "train.checkpoint.every": 5, "train.schedule.decay_steps": 10}


# Muon + AdamW (two optimizers stepped as one): its momentum buffers must resume like AdamW's moments.
MUON = {**STEPS, "train.optimizer.name": "muon"}


def uninterrupted(tmp_path_factory, overrides):
    d = tmp_path_factory.mktemp("ref")
    cfg = config_from_dict(tiny_dict(overrides))
    tr, va = loaders_for(cfg)
    train(cfg, d, loader=tr, val_loader=va, progress=False)
    return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in process."""
    return uninterrupted(tmp_path_factory, STEPS)


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    return uninterrupted(tmp_path_factory, MUON)


def wait_for_step(proc, run_dir, step, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
        if logged and logged[-1] >= step:
            return logged[-1]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise TimeoutError


def finish(cfg_json, run_dir):
    p = spawn_trainer(cfg_json, run_dir)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out


def assert_matches(reference, run_dir):
    a, b = list_checkpoints(reference / "checkpoints")[-1], list_checkpoints(run_dir / "checkpoints")[-1]
    assert a.name == b.name == step_dirname(40)
    assert checkpoint_digests(a) == checkpoint_digests(b)
    assert logged_losses(reference) == logged_losses(run_dir)


@pytest.mark.slow  # over 20 s each on 2 busy cores (pytest --durations)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_sigkill_during_training(tmp_path, request, optimizer):
    reference = request.getfixturevalue({"adamw": "reference", "muon": "muon_reference"}[optimizer])
    cfg_json = write_config(tiny_dict({"adamw": STEPS, "muon": MUON}[optimizer]), tmp_path / "cfg.json")
    run_dir = tmp_path / "run"
    p = spawn_trainer(cfg_json, run_dir)
    wait_for_step(p, run_dir, 12)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    done = list_checkpoints(run_dir / "checkpoints")
    assert done and done[-1].name < step_dirname(40)
    finish(cfg_json, run_dir)
    assert_matches(reference, run_dir)


def test_sigkill_during_checkpoint_write(tmp_path, reference):
    cfg_json = write_config(tiny_dict(STEPS), tmp_path / "cfg.json")
    run_dir = tmp_path / "run"
    p = spawn_trainer(cfg_json, run_dir, faults=["--kill-during-save", "15"])
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    ck = run_dir / "checkpoints"
    assert [c.name for c in list_checkpoints(ck)][-1] == step_dirname(10)
    assert any(x.name.startswith(".tmp-step-00000015") for x in ck.iterdir())  # the half-written one
    finish(cfg_json, run_dir)
    assert not any(x.name.startswith(".tmp-") for x in ck.iterdir())
    assert_matches(reference, run_dir)


def test_sigterm_saves_and_exits(tmp_path, reference):
    cfg_json = write_config(tiny_dict(STEPS), tmp_path / "cfg.json")
    run_dir = tmp_path / "run"
    p = spawn_trainer(cfg_json, run_dir)
    wait_for_step(p, run_dir, 8)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err  # documented: 143, the run is not finished
    assert '"interrupted": "SIGTERM"' in out and "; checkpoint saved to " in out
    last = list_checkpoints(run_dir / "checkpoints")[-1]
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert last.name == step_dirname(logged[-1]) and logged[-1] < 40  # saved at the step it stopped
    finish(cfg_json, run_dir)
    assert_matches(reference, run_dir)


def test_sigkill_while_a_resave_swaps_folders(tmp_path):
    """keep_last 1 and a re-save of the same step, killed after the old copy was moved aside and before the
    new one was renamed in: the old copy is put back, so a checkpoint survives."""
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 3, {"model": {"w": torch.ones(2)}}, {"version": "old"}, keep_last=1)
    code = (
        "import sys, torch; from pathlib import Path; import helpers; helpers.kill_at_swap(3); "
        "from enlace.train.checkpoint import save_checkpoint; "
        f"save_checkpoint(Path({str(root)!r}), 3, {{'model': {{'w': torch.zeros(2)}}}}, {{'version': 'new'}}, keep_last=1)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not (root / step_dirname(3)).exists() and (root / f".old-{step_dirname(3)}").is_dir()
    clean_partial(root)  # what every run does before it looks for a checkpoint
    path, tensors, meta = latest_checkpoint(root)
    assert path.name == step_dirname(3) and meta["version"] == "old"
    assert torch.equal(tensors["model"]["w"], torch.ones(2))
    assert sorted(x.name for x in root.iterdir()) == [step_dirname(3)]
