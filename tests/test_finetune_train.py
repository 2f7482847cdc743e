"""Training: exact resume, held-out loss goes down, CLI flags map onto the config, chat streams replies."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import dolly_rows, make_folder, write_jsonl
from safetensors.torch import load_file

from enlace.config.extra import GenerationConfig
from enlace.config.finetune import FinetuneConfig
from enlace.config.hardware import HardwareConfig
from enlace.finetune.chat import chat_repl
from enlace.finetune.evaluate import finetune_eval
from enlace.finetune.train import finetune
from enlace.load import load_model

ROOT = Path(__file__).resolve().parents[1]
HW = HardwareConfig(name="cpu", device="cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    folder = make_folder(d / "base")
    train = write_jsonl(d / "train.jsonl", dolly_rows(12))
    val = write_jsonl(d / "val.jsonl", dolly_rows(15)[12:])
    return folder, train, val


def cfg_for(setup, out, **kw) -> FinetuneConfig:
    folder, train, val = setup
    base = dict(
        name="t", base_model=str(folder), train_data=str(train), val_data=str(val), max_steps=4,
        micro_batch_size=2, grad_accum_steps=2, optimizer={"lr": 5e-3}, schedule={"warmup_steps": 1},
        max_len=128, rank=4, alpha=8, dropout=0.1, targets=["q_proj", "v_proj"], out=str(out),
        checkpoint={"every": 2}, eval_prompts=["¿Qué hacemos hoy?"], generation=GenerationConfig(max_new_tokens=6),
    )  # fmt: skip
    return FinetuneConfig(**{**base, **kw})


@pytest.mark.parametrize("neftune", [0.0, 5.0])
def test_resume_is_exact(setup, tmp_path, neftune):
    """With NEFTune too: its noise is drawn from the seed and the micro-batch number, not from a stream that a
    resume would restart."""
    a = cfg_for(setup, tmp_path / "a", neftune_alpha=neftune)
    finetune(a, HW, progress=False)
    b = cfg_for(setup, tmp_path / "b", neftune_alpha=neftune)
    finetune(b, HW, progress=False)
    # Lose everything after step 2, as a run killed between checkpoints would, then resume.
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")
    shutil.rmtree(tmp_path / "b" / "adapter")
    result = finetune(b, HW, progress=False)
    assert result.last["step"] == 4
    wa = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(wa[k].abs().sum() > 0 for k in wa if "lora_B" in k)
    ma, mb = (json.loads((tmp_path / x / "adapter" / "manifest.json").read_text()) for x in "ab")
    # The same bytes too: io.write_safetensors orders the metadata that safetensors writes in hash-map order.
    assert ma["files"] == mb["files"] and ma["kind"] == "lora-adapter"
    assert ma["provenance"]["config_hash"] and ma["provenance"]["base_fingerprint"]
    la = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    lb = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    strip = [{k: v for k, v in json.loads(x).items() if k != "s_per_step"} for x in la]
    assert strip == [{k: v for k, v in json.loads(x).items() if k != "s_per_step"} for x in lb]
    if neftune:  # the noise reached the training: another adapter than the noiseless run's
        finetune(cfg_for(setup, tmp_path / "c"), HW, progress=False)
        assert not same(wa, adapter(tmp_path / "c"))


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_changed_settings_or_more_steps_give_the_fresh_run(setup, tmp_path, capsys):
    finetune(cfg_for(setup, tmp_path / "b"), HW, progress=False)
    # Another rank: a new run (the old one is kept aside), equal to a fresh run of the new settings.
    r = finetune(cfg_for(setup, tmp_path / "b", rank=8), HW, progress=False)
    out = capsys.readouterr().out
    assert "starting fresh" in out and "finetune.rank: 4 -> 8" in out and "resumed from" not in out
    assert r.last["step"] == 4 and len(list((tmp_path / "b" / "previous").iterdir())) == 1
    finetune(cfg_for(setup, tmp_path / "fresh8", rank=8), HW, progress=False)
    assert same(adapter(tmp_path / "b"), adapter(tmp_path / "fresh8"))
    # More steps: resumes from the checkpoint before the cosine decay (after warmup), ends like a straight run.
    r = finetune(cfg_for(setup, tmp_path / "b", rank=8, max_steps=6), HW, progress=False)
    assert "resumed from" in capsys.readouterr().out and r.last["step"] == 6
    finetune(cfg_for(setup, tmp_path / "fresh6", rank=8, max_steps=6), HW, progress=False)
    assert same(adapter(tmp_path / "b"), adapter(tmp_path / "fresh6"))


def test_training_lowers_heldout_loss_and_eval_writes_answers(setup, tmp_path):
    questions = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question": "¿Qué cenamos?", "keywords": ["tortilla", "patatas", "ensalada"], "topic": "cocina"},
            {"question": "¿Y mañana?", "keywords": ["parque", "colegio"]},
        ],
    )
    cfg = cfg_for(
        setup,
        tmp_path / "run",
        max_steps=25,
        optimizer={"lr": 1e-2},
        dropout=0.0,
        targets=["q_proj", "v_proj", "o_proj", "up_proj"],
        questions=str(questions),
    )
    finetune(cfg, HW, progress=False)
    r = finetune_eval(cfg, HW)
    assert r["loss_after"] < r["loss_before"] - 0.3, (r["loss_before"], r["loss_after"])
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["loss_after"] == r["loss_after"] and len(saved["answers"]) == 1
    assert set(saved["answers"][0]) == {"prompt", "base", "finetuned"}
    # The answer checks and the loss goal, for the base model and the adapter.
    assert {"looping", "distinct_2", "spanish", "loss_reduction", "goals_met"} <= set(saved)
    assert set(saved["checks"]) == {"base", "finetuned"} and 0 <= saved["checks"]["base"]["looping"] <= 1
    assert saved["loss_reduction"] == pytest.approx(1 - r["loss_after"] / r["loss_before"], abs=1e-3)
    # Unseen questions: an answer and a verdict per question, for both models, and the rates.
    assert [q["question"] for q in saved["questions"]] == ["¿Qué cenamos?", "¿Y mañana?"]
    for q in saved["questions"]:
        for who in ("verdict", "base_verdict"):
            assert {"spanish", "on_topic", "loops", "keywords_found", "ok"} == set(q[who])
        assert isinstance(q["finetuned"], str) and isinstance(q["base"], str)
        # Whether the answer ended by itself: a cut one used the whole budget, an ended one stopped earlier or
        # on its last token.
        for tokens, ended in ((q["tokens"], q["ended"]), (q["base_tokens"], q["base_ended"])):
            assert 1 <= tokens <= cfg.generation.max_new_tokens and isinstance(ended, bool)
            assert ended or tokens == cfg.generation.max_new_tokens
    assert set(saved["judge"]) == {"base", "finetuned"} and saved["judge"]["finetuned"]["questions"] == 2
    assert saved["new_questions_ok_rate"] == saved["judge"]["finetuned"]["ok_rate"]
    ended = [q["ended"] for q in saved["questions"]]
    assert saved["new_questions_ended_rate"] == sum(ended) / len(ended)


def test_cli_flags_map_onto_finetune_config():
    from enlace.cli import build_parser
    from enlace.finetune.commands import load_finetune_cfg

    args = build_parser().parse_args(
        ["finetune", "--params", str(ROOT / "params.yaml"), "--steps", "7", "--lr", "0.002", "--rank", "4",
         "--alpha", "8", "--targets", "q,v", "--max-len", "200", "--examples", "20", "--batch", "2",
         "--out", "runs/x", "--model", "models/m", "--data", "d/train.jsonl", "--set", "finetune.seed=5"]
    )  # fmt: skip
    f = load_finetune_cfg(args).finetune
    assert (f.max_steps, f.optimizer.lr, f.rank, f.alpha, f.max_len, f.max_examples, f.micro_batch_size) == (
        7,
        0.002,
        4,
        8,
        200,
        20,
        2,
    )
    assert f.targets == ["q_proj", "v_proj"] and f.out == "runs/x" and f.base_model == "models/m"
    assert f.train_data == "d/train.jsonl" and f.seed == 5 and f.name == "smollm2-es"


def test_chat_streams_replies_until_exit(setup):
    folder, _, _ = setup
    loaded = load_model(folder)
    out = io.StringIO()
    msgs = chat_repl(
        loaded, io.StringIO("hola\n\n¿qué tal?\n/exit\nignored\n"), out, max_new_tokens=5,
        temperature=0.0, repetition_penalty=1.0, no_repeat_ngram=0,  # plain greedy: one line per reply
    )  # fmt: skip
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    lines = out.getvalue().split("\n")
    assert lines[0].strip() == msgs[1]["content"] and lines[1].strip() == msgs[3]["content"]


# ---- the loop's safeties, for fine-tuning (pretraining's are in test_train_resume/faults/signals) --------


def checkpoint_files(out: Path) -> dict[str, dict[str, str]]:
    from helpers import checkpoint_digests

    return {
        p.name: {k: v for k, v in checkpoint_digests(p).items() if k.endswith(".safetensors")}
        for p in sorted((out / "checkpoints").iterdir())
    }


def test_stopped_run_resumes_bit_exact(setup, tmp_path):
    """Stopped at step 3 (between checkpoints, as an interrupted run saves), then resumed: every checkpoint
    and the adapter are the bytes of a straight run."""
    finetune(cfg_for(setup, tmp_path / "a"), HW, progress=False)
    half = finetune(cfg_for(setup, tmp_path / "b"), HW, progress=False, stop_after=3)
    assert half.last["step"] == 3 and not (tmp_path / "b" / "adapter").exists()
    finetune(cfg_for(setup, tmp_path / "b"), HW, progress=False)
    a, b = checkpoint_files(tmp_path / "a"), checkpoint_files(tmp_path / "b")
    assert a["step-00000004"] == b["step-00000004"]
    assert same(adapter(tmp_path / "a"), adapter(tmp_path / "b"))


def test_nonfinite_steps_are_skipped_then_the_run_stops(setup, tmp_path, monkeypatch):
    from enlace.finetune import train as ft_train
    from enlace.train.loop import NonFiniteError

    real, calls = ft_train.sft_forward, {"n": 0}

    def nan_on(steps):
        def forward(model, batch, neftune_alpha=0.0):
            loss, parts = real(model, batch, neftune_alpha)
            step = calls["n"] // 2  # grad_accum_steps 2
            calls["n"] += 1
            return (loss * float("nan") if step in steps else loss), parts

        return forward

    monkeypatch.setattr(ft_train, "sft_forward", nan_on({1}))
    r = finetune(cfg_for(setup, tmp_path / "skip"), HW, progress=False)
    losses = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert r.last["step"] == 4 and r.last["skipped"] == 1 and losses[1]["loss"] != losses[1]["loss"]
    assert all(torch.isfinite(t).all() for t in adapter(tmp_path / "skip").values())

    calls["n"] = 0
    monkeypatch.setattr(ft_train, "sft_forward", nan_on({1, 2, 3}))
    cfg = cfg_for(setup, tmp_path / "stop", max_nonfinite_in_row=2)
    with pytest.raises(
        NonFiniteError, match="2 non-finite .* in a row .*finetune.max_nonfinite_in_row=2"
    ) as e:
        finetune(cfg, HW, progress=False)
    assert e.value.exit_code == 2 and "step-00000002" in str(e.value)
    assert not (tmp_path / "stop" / "adapter").exists()


def test_busy_run_folder_is_refused_before_anything_is_written(setup, tmp_path):
    import fcntl
    import os

    from enlace.train.lock import RunDirBusy, lock_path

    out = tmp_path / "busy"
    fd = os.open(lock_path(out), os.O_RDWR | os.O_CREAT, 0o644)  # another holder (another descriptor)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunDirBusy, match="another enlace process"):
            finetune(cfg_for(setup, out), HW, progress=False)
        assert not out.exists() or list(out.iterdir()) == []
    finally:
        os.close(fd)
    r = finetune(cfg_for(setup, out), HW, progress=False)  # the holder gone, the run goes ahead
    assert r.last["step"] == 4 and (out / "adapter").exists()


def test_neftune_noise_is_bounded_seeded_and_gone_after_the_forward(setup):
    """NEFTune (finetune.neftune_alpha): uniform noise within alpha / sqrt(T d) on the embeddings, the same for
    the same (seed, micro-batch), another for the next one, and none once the forward is done."""
    import math

    from enlace.finetune.train import neftune

    model = load_model(setup[0]).model
    ids = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    clean = model.embed(ids)

    def embedded(alpha: float, draw: tuple[int, int]) -> torch.Tensor:
        with neftune(model, alpha, draw, ids):
            return model.embed(ids)

    noisy = embedded(5.0, (0, 3))
    change = (noisy - clean).abs()
    assert 0 < change.max() <= 5.0 / math.sqrt(7 * model.cfg.d_model) + 1e-6
    assert (
        change.mean() > 5.0 / math.sqrt(7 * model.cfg.d_model) / 4
    )  # spread over the range, not a few entries
    assert torch.equal(embedded(5.0, (0, 3)), noisy) and not torch.equal(embedded(5.0, (0, 4)), noisy)
    assert torch.equal(embedded(0.0, (0, 3)), clean) and model.embed_noise is None
    assert torch.equal(model.embed(ids), clean)
