"""Checkpoints and resume, in process: exact continuation, determinism, refusals, corruption, NaN."""

import math

import pytest
import torch
from safetensors.torch import load_file

from enlace.errors import CheckpointError
from enlace.train.checkpoint import latest_checkpoint, list_checkpoints, step_dirname
from enlace.train.testing import checkpoint_digests, loaders_for, logged_losses, tiny_config
from enlace.train.trainer import NAN_STEPS_ENV, NonFiniteError, check_resume, train


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
    assert resumed.val_loss == straight.val_loss


def test_same_config_twice_gives_identical_files(tmp_path):
    run(tmp_path / "a")
    run(tmp_path / "b")
    ca, cb = (
        list_checkpoints(tmp_path / "a" / "checkpoints"),
        list_checkpoints(tmp_path / "b" / "checkpoints"),
    )
    assert [p.name for p in ca] == [p.name for p in cb] == [step_dirname(s) for s in (4, 6, 8)]
    for a, b in zip(ca, cb, strict=True):
        assert checkpoint_digests(a) == checkpoint_digests(b)


def test_finished_run_resumes_to_nothing_and_extends(tmp_path):
    run(tmp_path, {"train.max_steps": 6})
    again = run(tmp_path, {"train.max_steps": 6})
    assert again.step == 6 and again.resumed_from == 6
    longer = run(tmp_path, {"train.max_steps": 8})
    assert longer.step == 8 and longer.resumed_from == 6
    with pytest.raises(CheckpointError, match="past train.max_steps"):
        run(tmp_path, {"train.max_steps": 6})


def test_changed_model_config_is_refused(tmp_path):
    run(tmp_path, stop_after=2)
    with pytest.raises(CheckpointError, match=r"model\.d_model: 32 -> 64"):
        run(tmp_path, {"model.d_model": 64})
    with pytest.raises(CheckpointError, match=r"train\.optimizer\.lr"):
        run(tmp_path, {"train.optimizer.lr": 1e-3})
    with pytest.raises(CheckpointError, match=r"train\.seed"):
        run(tmp_path, {"train.seed": 7})


def test_other_world_size_is_refused(tmp_path):
    run(tmp_path, stop_after=2)
    path, _, meta = latest_checkpoint(tmp_path / "checkpoints")
    cfg = tiny_config()
    with pytest.raises(CheckpointError, match="world size 1 and this run has world size 2"):
        check_resume(cfg, meta, meta["data_fingerprint"], 2, path)


def test_truncated_checkpoint_is_rejected_and_fallback_works(tmp_path):
    run(tmp_path, {"train.max_steps": 8}, stop_after=6)  # checkpoints at 4 and 6
    bad = tmp_path / "checkpoints" / step_dirname(6) / "optimizer.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        run(tmp_path)
    assert str(bad) in str(e.value) and "checksum" in str(e.value)
    assert step_dirname(4) in str(e.value)  # names the older complete checkpoint
    r = run(tmp_path, {"train.checkpoint.fallback_on_corrupt": True})
    assert r.resumed_from == 4 and r.step == 8


def test_altered_meta_is_rejected(tmp_path):
    run(tmp_path, stop_after=2)
    meta = tmp_path / "checkpoints" / step_dirname(2) / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(CheckpointError, match="meta.json: checksum mismatch"):
        run(tmp_path)


def test_nan_step_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(NAN_STEPS_ENV, "3")
    r = run(tmp_path)
    assert r.step == 8 and r.skipped == 1 and math.isfinite(r.end_loss)
    losses = dict(logged_losses(tmp_path))
    assert math.isnan(losses[4]) and math.isfinite(losses[5])


def test_too_many_nonfinite_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(NAN_STEPS_ENV, "4,5,6,7")
    with pytest.raises(NonFiniteError, match="3 non-finite .* in a row") as e:
        run(tmp_path, {"train.max_nonfinite_in_row": 3})
    assert e.value.exit_code == 2
    # Skipped steps apply no update, so the checkpoint at 6 (inside the streak) holds good weights.
    assert step_dirname(6) in str(e.value)
    path, tensors, meta = latest_checkpoint(tmp_path / "checkpoints")
    assert path.name == step_dirname(6) and meta["counters"]["nonfinite_in_row"] == 2
    assert all(torch.isfinite(t).all() for t in tensors["model"].values())
