"""The smoke and pretrain stages end to end through the CLI, on a synthetic corpus and a shrunken model."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import synthetic_text

from enlace.cli import main
from enlace.train.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
PROSE = "Mañana iremos al mercado con la abuela; después comeremos todos juntos en el patio.\n" * 3
PROSE_NEW = "El erizo se enroscó bajo las hojas secas y durmió tranquilo hasta la primavera.\n" * 2
TINY = [
    "--set", "model.d_model=32", "--set", "model.n_layer=2", "--set", "model.seq_len=32",
    "--set", "model.ffn_multiple_of=16", "--set", "hardware.num_threads=1",
    "--set", "train.max_steps=40", "--set", "train.checkpoint.every=10",
    "--set", "train.schedule.warmup_steps=5", "--set", "train.schedule.decay_steps=10",
    "--set", "train.micro_batch_size=4", "--set", "train.global_batch_size=8",
    "--set", "train.optimizer.lr=0.01", "--set", "train.eval_batches=2",
]  # fmt: skip


@pytest.fixture
def project(tmp_path, monkeypatch):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    text = synthetic_text(120_000).decode()
    docs = [text[i : i + 1000] for i in range(0, len(text), 1000)]
    for split, part in (("train", docs[:-10]), ("val", docs[-10:])):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    prose = tmp_path / "assets" / "eval" / "prosa-es.txt"  # the prose yardstick eval.prose names
    prose.parent.mkdir(parents=True)
    prose.write_text(PROSE, encoding="utf-8")
    (prose.parent / "prosa-es-nueva.txt").write_text(PROSE_NEW, encoding="utf-8")  # eval.prose_new
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_smoke_stage(project, capsys):
    assert main(["smoke", "--no-progress", "--run-dir", "out/smoke", *TINY]) == 0
    out = capsys.readouterr().out
    assert "smoke: loss" in out and "in 40 steps, resume exact" in out
    m = json.loads((project / "out/smoke/metrics.json").read_text())
    assert m["resume_exact"] is True and m["steps"] == 40
    assert m["final_train_loss"] < 0.8 * m["start_loss"]
    assert m["val_bpb"] > 0 and m["tokens_per_s"] > 0
    assert (project / "out/smoke/loss.png").stat().st_size > 1000
    assert json.loads((project / "out/smoke/config.json").read_text())["config"]["model"]["name"] == "smoke"
    assert not list((project / "out/smoke").glob(".resume-check-*"))


def test_smoke_fails_when_loss_does_not_fall(project, capsys):
    args = ["smoke", "--no-progress", "--run-dir", "out/s", *TINY, "--set", "train.optimizer.lr=1e-7"]
    assert main(args) == 2
    assert "did not fall clearly" in capsys.readouterr().err


def test_pretrain_stage_with_byte_loader(project, capsys):
    # The pretrain stage on the smoke layers (no tokenizer needed); a second call resumes to nothing.
    args = ["pretrain", "--no-progress", "--run-dir", "out/p", "--model", "smoke", "--train", "smoke", *TINY]
    assert main(args) == 0
    m = json.loads((project / "out/p/metrics.json").read_text())
    assert m["steps"] == 40 and m["val_loss"] > 0
    assert {"loss.png", "config.json", "metrics.jsonl", "checkpoints"} <= {
        p.name for p in (project / "out/p").iterdir()
    }
    assert main(args) == 0
    capsys.readouterr()
    # A changed param trains a new run and keeps the old one aside.
    assert main([*args, "--set", "model.d_model=64"]) == 0
    out = capsys.readouterr().out
    assert "starting fresh" in out and "model.d_model: 32 -> 64" in out
    (old,) = (project / "out/p/previous").iterdir()
    assert old.name in out and [c.name for c in list_checkpoints(old / "checkpoints")][-1] == "step-00000040"
    assert (
        main([*args, "--fresh", "--set", "train.max_steps=20", "--set", "train.schedule.decay_steps=5"]) == 0
    )
    assert list_checkpoints(project / "out/p/checkpoints")[-1].name == "step-00000020"


def test_eval_and_generate_on_the_trained_run(project, capsys):
    args = ["--model", "smoke", "--train", "smoke", *TINY]
    assert main(["pretrain", "--no-progress", "--run-dir", "out/p", *args]) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", "out/p", "--out", "out/eval", *args]) == 0
    out = capsys.readouterr().out
    m = json.loads((project / "out/eval/metrics.json").read_text())
    # Byte-level model: one token per byte, so bits per byte is the loss in bits.
    assert m["step"] == 40 and abs(m["val_bpb"] - m["val_loss"] / 0.6931471805599453) < 1e-4
    assert m["generate_tokens_per_s"] > 0 and f"bits/byte {m['val_bpb']:.4f}" in out
    assert m["prose_bytes"] == len(PROSE.encode("utf-8")) and f"{m['prose_bpb']:.4f}" in out
    assert m["prose_new_bytes"] == len(PROSE_NEW.encode("utf-8")) and f"{m['prose_new_bpb']:.4f}" in out
    assert (
        m["prose_all_bytes"] == len((PROSE + PROSE_NEW).encode("utf-8"))
        and f"{m['prose_all_bpb']:.4f}" in out
    )
    samples = (project / "out/eval/samples.md").read_text()
    # Every prompt of params.yaml, its continuation, and the checkpoint that wrote it.
    prompts = yaml.safe_load((project / "params.yaml").read_text())["eval"]["prompts"]
    assert all(f"Prompt: «{p}»" in samples and f"**{p}**" in samples for p in prompts)
    assert "checkpoints/step-00000040` (step 40)" in samples.splitlines()[0]
    assert (project / "out/eval/loss.png").stat().st_size > 1000
    # Sampling is seeded: the same command prints the same text.
    cmd = ["generate", "--model", "out/p", "--seed", "3", "--max-new-tokens", "12", "El sol"]
    assert main(cmd) == 0
    first = capsys.readouterr().out
    assert main(cmd) == 0
    assert capsys.readouterr().out == first and first.startswith("El sol")


def test_eval_refuses_a_run_trained_with_another_model(project, capsys):
    args = ["--model", "smoke", "--train", "smoke", *TINY]
    assert main(["pretrain", "--no-progress", "--run-dir", "out/p", *args]) == 0
    assert main(["eval", "--run-dir", "out/p", "--out", "out/eval", *args, "--set", "model.n_layer=3"]) == 2
    assert "different model config" in capsys.readouterr().err
    assert main(["eval", "--run-dir", "out/none", "--out", "out/eval", *args]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
