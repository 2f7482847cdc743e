"""Checkpoints and resume, in process: exact continuation, determinism, corruption, NaN, GradScaler."""

import math

import pytest
import torch
from helpers import checkpoint_digests, loaders_for, logged_losses, nan_at_steps, tiny_config
from safetensors.torch import load_file

from enlace.errors import CheckpointError
from enlace.io import sha256_file
from enlace.train import checkpoint
from enlace.train.checkpoint import latest_checkpoint, list_checkpoints, step_dirname
from enlace.train.trainer import NonFiniteError, train


def run(tmp, overrides=None, stop_after=None):
    cfg = tiny_config(overrides)
    tr, va = loaders_for(cfg)
    return train(cfg, tmp, loader=tr, val_loader=va, stop_after=stop_after, progress=False)


def final(run_dir):
    return list_checkpoints(run_dir / "checkpoints")[-1]


def assert_same_checkpoint(a, b):
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{name}:{k} differs"
    assert checkpoint_digests(a) == checkpoint_digests(b)


@pytest.mark.parametrize("micro,accum", [(4, 2), (8, 1)])
def test_resume_is_bit_exact(tmp_path, micro, accum):
    o = {"train.micro_batch_size": micro, "train.grad_accum_steps": accum}
    straight = run(tmp_path / "a", o)
    half = run(tmp_path / "b", o, stop_after=4)
    assert half.step == 4 and half.interrupted is None
    assert final(tmp_path / "b").name == step_dirname(4)
    resumed = run(tmp_path / "b", o)
    assert resumed.resumed_from == 4 and resumed.step == straight.step == 8
    assert_same_checkpoint(final(tmp_path / "a"), final(tmp_path / "b"))
    # The loss curve too: the resumed log was cut back to step 4 and continued without duplicates.
    assert logged_losses(tmp_path / "a") == logged_losses(tmp_path / "b")
    assert [s for s, _ in logged_losses(tmp_path / "b")] == list(range(1, 9))
    assert resumed.val == straight.val


def test_same_config_twice_gives_identical_files(tmp_path):
    run(tmp_path / "a")
    run(tmp_path / "b")
    ca, cb = (
        list_checkpoints(tmp_path / "a" / "checkpoints"),
        list_checkpoints(tmp_path / "b" / "checkpoints"),
    )
    assert [p.name for p in ca] == [p.name for p in cb] == [step_dirname(s) for s in (5, 6, 8)]
    for a, b in zip(ca, cb, strict=True):
        assert checkpoint_digests(a) == checkpoint_digests(b)


def test_a_tensor_file_has_the_same_bytes_from_any_process(tmp_path):
    """safetensors orders a file's metadata by a Rust HashMap, seeded per process: io.write_safetensors sorts
    it, so the same tensors and metadata give the same bytes (and checksum) in every process."""
    import subprocess
    import sys

    script = (
        "import sys, torch; from enlace.io import write_safetensors; "
        "write_safetensors(sys.argv[1], {'w': torch.arange(6.0)}, {k: k * 3 for k in 'fedcba'})"
    )
    files = [tmp_path / f"{i}.safetensors" for i in range(4)]
    for f in files:
        subprocess.run([sys.executable, "-c", script, str(f)], check=True)
    assert len({sha256_file(f) for f in files}) == 1
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == {k: k * 3 for k in "abcdef"} and torch.equal(
            f.get_tensor("w"), torch.arange(6.0)
        )


def test_tensor_file_is_safetensors_and_hashed_while_written(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "WRITE_CHUNK", 1000)  # many chunks: odd sizes, tensors split across them
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(37, 29, generator=g),
        "w.bf16": torch.randn(13, 7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3.0),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(8, 6, generator=g).t(),  # not contiguous
    }
    digest = checkpoint.write_tensors(tmp_path / "a.safetensors", tensors)
    assert digest == sha256_file(tmp_path / "a.safetensors")
    back = load_file(str(tmp_path / "a.safetensors"))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert checkpoint.write_tensors(tmp_path / "b.safetensors", tensors) == digest  # same tensors, same bytes


def test_finished_run_resumes_to_nothing(tmp_path):
    run(tmp_path, {"train.max_steps": 6})
    again = run(tmp_path, {"train.max_steps": 6})
    assert again.step == 6 and again.resumed_from == 6


def test_truncated_checkpoint_is_rejected_and_fallback_works(tmp_path):
    run(tmp_path, {"train.max_steps": 8}, stop_after=6)  # kept: 4, 5 (the last before the decay), 6
    bad = tmp_path / "checkpoints" / step_dirname(6) / "optimizer.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        run(tmp_path)
    assert str(bad) in str(e.value) and "checksum" in str(e.value)
    assert step_dirname(5) in str(e.value)  # names the older complete checkpoint
    r = run(tmp_path, {"train.checkpoint.fallback_on_corrupt": True})
    assert r.resumed_from == 5 and r.step == 8


def test_altered_meta_is_rejected(tmp_path):
    run(tmp_path, stop_after=2)
    meta = tmp_path / "checkpoints" / step_dirname(2) / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(CheckpointError, match="meta.json: checksum mismatch"):
        run(tmp_path)


def test_nan_step_is_skipped(tmp_path, monkeypatch):
    nan_at_steps(monkeypatch, {3}, accum=2)
    r = run(tmp_path)
    assert r.step == 8 and r.skipped == 1 and math.isfinite(r.end_loss)
    losses = dict(logged_losses(tmp_path))
    assert math.isnan(losses[4]) and math.isfinite(losses[5])


def test_too_many_nonfinite_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    nan_at_steps(monkeypatch, {4, 5, 6, 7}, accum=2)
    with pytest.raises(NonFiniteError, match="3 non-finite .* in a row") as e:
        run(tmp_path, {"train.max_nonfinite_in_row": 3})
    assert e.value.exit_code == 2
    # Skipped steps apply no update, so the checkpoint at 6 (inside the streak) holds good weights.
    assert step_dirname(6) in str(e.value)
    path, tensors, meta = latest_checkpoint(tmp_path / "checkpoints")
    assert path.name == step_dirname(6) and meta["counters"]["nonfinite_in_row"] == 2
    assert all(torch.isfinite(t).all() for t in tensors["model"].values())


def test_fp16_gradscaler_path_resumes_exactly(tmp_path):
    """fp16 autocast + an enabled GradScaler on CPU: the scaler's state is checkpointed and resumed."""
    o = {"hardware.dtype": "fp16", "hardware.loss_scaler": True, "train.max_steps": 6}
    straight = run(tmp_path / "a", o)
    assert straight.step == 6 and math.isfinite(straight.end_loss)
    _, _, meta = latest_checkpoint(tmp_path / "a" / "checkpoints")
    assert meta["scaler"]["scale"] > 0  # an enabled scaler saved its state
    run(tmp_path / "b", o, stop_after=3)
    run(tmp_path / "b", o)
    assert_same_checkpoint(final(tmp_path / "a"), final(tmp_path / "b"))
