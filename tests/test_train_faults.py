"""Hostile inputs and faults around training runs: two processes on one run directory, a run directory that
is a file, a full disk during a checkpoint, corrupt checkpoints outside training, SIGTERM during finetune,
a second Ctrl-C. Each ends in a one-line message and loses nothing."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    checkpoint_digests,
    dolly_rows,
    loaders_for,
    make_folder,
    spawn_trainer,
    tiny_config,
    tiny_dict,
    write_config,
    write_jsonl,
)

from enlace.cli import main
from enlace.errors import CheckpointError, EnlaceError
from enlace.train import checkpoint
from enlace.train.checkpoint import list_checkpoints, step_dirname
from enlace.train.lock import RunDirBusy, run_dir_lock
from enlace.train.metrics import read_jsonl
from enlace.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]), "OMP_NUM_THREADS": "1"}


def run(run_dir, overrides=None, stop_after=None):
    cfg = tiny_config(overrides)
    tr, va = loaders_for(cfg)
    return train(cfg, run_dir, loader=tr, val_loader=va, stop_after=stop_after, progress=False)


def wait_for(predicate, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise TimeoutError


# ---- two processes, one run directory ---------------------------------------------------------------------


def test_second_process_on_a_run_dir_is_refused_and_the_lock_dies_with_the_holder(
    tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    code = (
        "import sys, time; from pathlib import Path; from enlace.train.lock import run_dir_lock\n"
        "with run_dir_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], env=env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.chdir(ROOT)  # the repository's params.yaml; the refusal comes before any data is read
        assert main(["smoke", "--no-progress", "--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {holder.pid}" in err and str(run_dir) in err
        assert list(run_dir.iterdir()) == []  # the refused process wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_dir_lock(run_dir):  # SIGKILL left no stale lock
        with pytest.raises(RunDirBusy):  # ... and the lock excludes another holder (another descriptor)
            with run_dir_lock(tmp_path / "elsewhere" / ".." / "run"):
                pass


@pytest.mark.parametrize(
    "argv",
    [
        ["pretrain", "--no-progress", "--run-dir"],
        ["eval", "--out"],
        ["export", "--out"],
    ],
    ids=["pretrain --run-dir", "eval --out", "export --out"],
)
def test_output_folder_that_is_a_file_is_refused(argv, tmp_path, capsys, monkeypatch):
    f = tmp_path / "notadir"
    f.write_text("x")
    monkeypatch.chdir(ROOT)
    assert main([*argv, str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a directory" in err and f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("fresh", [False, True])
def test_read_only_run_dir_is_refused(tmp_path, fresh):
    run(tmp_path / "run", stop_after=2)
    before = checkpoint_digests(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    for d in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        d.chmod(0o555)
    try:
        cfg = tiny_config()
        from enlace.train.stages import pretrain

        with pytest.raises(EnlaceError, match="cannot write in the run directory"):
            pretrain(cfg, tmp_path / "run", progress=False, fresh=fresh)
    finally:
        for d in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
            d.chmod(0o755)
    assert checkpoint_digests(list_checkpoints(tmp_path / "run" / "checkpoints")[-1]) == before


# ---- full disk ---------------------------------------------------------------------------------------------


def test_full_disk_during_a_checkpoint_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    real = checkpoint.write_tensors

    def disk_full_at_step_4(path, tensors):
        if f".tmp-{step_dirname(4)}-" in str(path):
            Path(path).write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, tensors)

    monkeypatch.setattr(checkpoint, "write_tensors", disk_full_at_step_4)
    with pytest.raises(CheckpointError) as e:
        run(tmp_path / "run")
    msg = str(e.value)
    assert "\n" not in msg and "no space left on device" in msg and f"{step_dirname(2)}, is intact" in msg
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == [step_dirname(2)]  # no partial folder left
    monkeypatch.setattr(checkpoint, "write_tensors", real)
    assert run(tmp_path / "run").resumed_from == 2
    run(tmp_path / "straight")
    straight = list_checkpoints(tmp_path / "straight" / "checkpoints")[-1]
    assert checkpoint_digests(list_checkpoints(ck)[-1]) == checkpoint_digests(straight)


# ---- corrupt checkpoints outside training ---------------------------------------------------------------


def test_corrupt_checkpoint_advice_fits_the_command(tmp_path):
    from enlace.load import load_trained_model

    run(tmp_path, stop_after=4)  # checkpoints 2 and 4
    bad = tmp_path / "checkpoints" / step_dirname(4) / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as e:
        load_trained_model(tmp_path)  # eval and generate: no setting to point at
    assert "fallback_on_corrupt" not in str(e.value) and "delete the corrupted one" in str(e.value)
    with pytest.raises(CheckpointError, match="set train.checkpoint.fallback_on_corrupt"):
        run(tmp_path)  # training can fall back


# ---- signals -----------------------------------------------------------------------------------------------


def test_second_ctrl_c_says_the_step_was_not_saved(tmp_path):
    d = tiny_dict({"train.max_steps": 40, "train.checkpoint.every": 5, "train.schedule.decay_steps": 10})
    run_dir = tmp_path / "run"
    # Ctrl-C twice while step 10's checkpoint is being written.
    p = spawn_trainer(write_config(d, tmp_path / "cfg.json"), run_dir, faults=["--sigint-during-save", "10"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    line = err.strip()
    assert "\n" not in line and "interrupted twice" in line and "step 10 without saving it" in line
    assert [c.name for c in list_checkpoints(run_dir / "checkpoints")] == [step_dirname(5)]
    assert str(list_checkpoints(run_dir / "checkpoints")[-1]) in line


def test_sigterm_during_finetune_saves_and_says_so(tmp_path):
    base = make_folder(tmp_path / "base")
    data = write_jsonl(tmp_path / "train.jsonl", dolly_rows(12))
    out = tmp_path / "ft"
    code = (
        "import sys; from enlace.config.finetune import FinetuneConfig; "
        "from enlace.config.hardware import HardwareConfig; from enlace.finetune.train import finetune\n"
        f"cfg = FinetuneConfig(name='t', base_model={str(base)!r}, train_data={str(data)!r}, max_steps=400, "
        f"micro_batch_size=2, schedule={{'warmup_steps': 1}}, max_len=128, rank=4, targets=['q_proj'], "
        f"out={str(out)!r}, checkpoint={{'every': 1000}})\n"
        "r = finetune(cfg, HardwareConfig(name='cpu', device='cpu'), progress=False)\n"
        "sys.exit(r.exit_code)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 2, p)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stderr
    step = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert f"stopped by SIGTERM at step {step}; checkpoint saved" in stdout
    assert list_checkpoints(out / "checkpoints")[-1].name == step_dirname(step)
    assert not (out / "adapter").exists()  # a stopped run is not a finished adapter


def test_finetune_out_that_is_a_file_is_refused(tmp_path):
    from enlace.config.finetune import FinetuneConfig
    from enlace.config.hardware import HardwareConfig
    from enlace.finetune.train import finetune

    f = tmp_path / "file"
    f.write_text("x")
    cfg = FinetuneConfig(name="t", base_model=str(tmp_path), train_data=str(f), out=str(f))
    with pytest.raises(EnlaceError, match="not a directory"):
        finetune(cfg, HardwareConfig(name="cpu", device="cpu"), progress=False)
