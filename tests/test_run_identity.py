"""Run identity: a rerun never continues weights trained under other params, data or code.

For each class of change the rerun in the old run directory must end with the files of a fresh run of the
new config; cadence settings do not change the identity; a longer max_steps continues from the checkpoint
before the decay and ends bit-identical to a straight run.
"""

import pytest
import torch
from helpers import checkpoint_digests, loaders_for, logged_losses, synthetic_text, tiny_config

from enlace.runtime import numerics
from enlace.train import trainer
from enlace.train.checkpoint import list_checkpoints, step_dirname
from enlace.train.identity import changed_keys
from enlace.train.trainer import train


def run(run_dir, overrides=None, text=None, stop_after=None):
    cfg = tiny_config(overrides)
    tr, va = loaders_for(cfg, text=text)
    return train(cfg, run_dir, loader=tr, val_loader=va, stop_after=stop_after, progress=False)


def final_digests(run_dir):
    return checkpoint_digests(list_checkpoints(run_dir / "checkpoints")[-1])


CHANGES = {
    "model": ({"model.d_model": 64}, None, "model.d_model: 32 -> 64"),
    "optimizer": ({"train.optimizer.lr": 1e-3}, None, "train.optimizer.lr: 0.003 -> 0.001"),
    "schedule": ({"train.schedule.warmup_steps": 3}, None, "train.schedule.warmup_steps: 2 -> 3"),
    "batch": ({"train.micro_batch_size": 8, "train.grad_accum_steps": 1}, None, "train.micro_batch_size"),
    "data": ({}, synthetic_text(seed=1), "data.fingerprint"),
    "code": ({}, None, "code: "),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_run_equals_a_fresh_run(tmp_path, monkeypatch, capsys, change):
    overrides, text, named = CHANGES[change]
    run(tmp_path / "run", stop_after=6)
    if change == "code":  # as if src/enlace/model.py had been edited
        real = trainer.code_fingerprint
        monkeypatch.setattr(trainer, "code_fingerprint", lambda modules: "edited-" + real(modules))
    capsys.readouterr()
    rerun = run(tmp_path / "run", overrides, text)
    out = capsys.readouterr().out
    assert rerun.resumed_from is None and "starting fresh" in out and named in out
    (old,) = (tmp_path / "run" / "previous").iterdir()
    assert old.name in out and list_checkpoints(old / "checkpoints")[-1].name == step_dirname(6)
    run(tmp_path / "fresh", overrides, text)
    assert final_digests(tmp_path / "run") == final_digests(tmp_path / "fresh")
    assert logged_losses(tmp_path / "run") == logged_losses(tmp_path / "fresh")


def test_cadence_settings_keep_the_identity(tmp_path):
    run(tmp_path, stop_after=4)
    again = run(
        tmp_path, {"train.log_every": 3, "train.checkpoint.every": 3, "train.checkpoint.keep_last": 1}
    )
    assert again.resumed_from == 4 and not (tmp_path / "previous").exists()


def test_longer_run_continues_from_before_the_decay(tmp_path, capsys):
    # max 8, decay 3: the decay starts at step 5, whose checkpoint is kept (pinned) even with keep_last 1.
    short = {"train.checkpoint.keep_last": 1}
    run(tmp_path / "run", short)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [
        step_dirname(s) for s in (5, 8)
    ]
    capsys.readouterr()
    longer = {**short, "train.max_steps": 12}
    r = run(tmp_path / "run", longer)
    assert r.resumed_from == 5 and r.step == 12
    assert "train.max_steps: 8 -> 12" in capsys.readouterr().out
    run(tmp_path / "straight", longer)
    assert final_digests(tmp_path / "run") == final_digests(tmp_path / "straight")
    assert logged_losses(tmp_path / "run") == logged_losses(tmp_path / "straight")
    # The annealed steps 6..8 of the shorter run are kept aside, not reused.
    (old,) = (tmp_path / "run" / "previous").iterdir()
    assert [p.name for p in list_checkpoints(old / "checkpoints")] == [step_dirname(8)]


def test_shorter_run_without_an_early_checkpoint_starts_fresh(tmp_path):
    run(tmp_path / "run", {"train.checkpoint.every": 4})  # checkpoints 4, 5 (pinned), 8
    r = run(
        tmp_path / "run", {"train.checkpoint.every": 4, "train.max_steps": 4, "train.schedule.decay_steps": 2}
    )
    assert r.resumed_from is None  # decay of the shorter run starts at 2: no checkpoint that early
    run(
        tmp_path / "fresh",
        {"train.checkpoint.every": 4, "train.max_steps": 4, "train.schedule.decay_steps": 2},
    )
    assert final_digests(tmp_path / "run") == final_digests(tmp_path / "fresh")


def test_delete_instead_of_move(tmp_path, capsys):
    run(tmp_path, stop_after=2)
    r = run(tmp_path, {"model.d_model": 64, "train.checkpoint.on_identity_change": "delete"}, stop_after=2)
    assert r.resumed_from is None and not (tmp_path / "previous").exists()
    assert "deleted" in capsys.readouterr().out


def test_a_changed_source_list_is_named_not_dumped():
    # The message is one line a user reads: data sources by name, long values cut short.
    old = {"data.sources": [{"name": "bible", "version": "1"}, {"name": "docs"}], "data.note": "a" * 500}
    new = {"data.sources": [{"name": "bible", "version": "2"}, {"name": "games"}], "data.note": "b"}
    note, sources = changed_keys(old, new)  # in key order
    assert sources == "data.sources: added games; removed docs; changed bible"
    assert note.startswith("data.note: 'aaa") and note.endswith("-> 'b'") and len(note) < 100


@pytest.mark.parametrize("trainer_module", ["enlace.train.trainer", "enlace.finetune.train"])
def test_model_code_is_part_of_every_run_identity(trainer_module):
    """The model's forward is computed in every step: editing it (its attention, say) must start a new run
    in pretraining and in LoRA fine-tuning alike, not resume weights trained by the old code."""
    import importlib

    step_code = {m.__name__ for m in importlib.import_module(trainer_module).STEP_CODE}
    assert {"enlace.model", "enlace.train.step", "enlace.train.schedule"} <= step_code


def test_a_run_does_not_resume_under_other_numerics(tmp_path, capsys):
    # The thread count stands for any change of kernels (another CPU, another PyTorch): each sums in its own
    # order, so a checkpoint resumed under them would not end where either machine's straight run ends.
    threads = torch.get_num_threads()
    two = {"hardware.num_threads": 2}
    try:
        run(tmp_path / "run", stop_after=6)  # the tests' profile: 1 thread
        capsys.readouterr()
        rerun = run(tmp_path / "run", two)
        out = capsys.readouterr().out
        assert rerun.resumed_from is None and "starting fresh" in out
        assert "hardware.numerics: " in out and "1 threads" in out and "2 threads" in out
        run(tmp_path / "fresh", two)
    finally:
        torch.set_num_threads(threads)
    assert final_digests(tmp_path / "run") == final_digests(tmp_path / "fresh")


def test_numerics_names_what_decides_the_bits():
    flags = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "sse2"})
    text = numerics("cpu", flags)
    assert f"torch {torch.__version__}" in text and "avx512_bf16 amx_bf16" in text
    assert f"{torch.get_num_threads()} threads" in text and "sse2" not in text
    assert numerics("cpu", frozenset({"avx2"})) != numerics("cpu", flags)
