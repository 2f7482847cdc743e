"""Through DVC itself: edit a param, `dvc repro`, and the weights are those of a fresh run of the new config.

The pretrain stage persists its checkpoints (so a killed run resumes); the run identity makes the rerun
start fresh when the params changed instead of reusing the finished run.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import checkpoint_digests, synthetic_text

from enlace.train.checkpoint import list_checkpoints

pytestmark = [
    pytest.mark.slow,
    pytest.mark.dvc,
    pytest.mark.skipif(shutil.which("dvc") is None, reason="dvc is not installed"),
]
ROOT = Path(__file__).resolve().parents[1]
MODEL = {
    "name": "tiny", "vocab_size": 256, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "seq_len": 32,
    "ffn_multiple_of": 16, "qk_norm": True, "z_loss_weight": 1.0e-4,
}  # fmt: skip
TRAIN = {
    "name": "tiny", "loader": "bytes", "max_steps": 12, "micro_batch_size": 4, "grad_accum_steps": 1,
    "global_batch_size": 4, "optimizer": {"lr": 0.01}, "schedule": {"warmup_steps": 2, "decay_steps": 4},
    "checkpoint": {"every": 4, "keep_last": 2}, "log_every": 1, "eval_batches": 2,
}  # fmt: skip
STAGE = {
    "cmd": "enlace pretrain --no-progress --model tiny --train tiny --set hardware.num_threads=1",
    "deps": ["data/corpus"],
    "params": [{"configs/model/tiny.yaml": None}, {"configs/train/tiny.yaml": None}],
    "outs": [
        {"runs/pretrain/checkpoints": {"persist": True}},
        {"runs/pretrain/metrics.jsonl": {"persist": True, "cache": False}},
    ],
}


def sh(cwd: Path, *cmd: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_param_edit_then_dvc_repro_equals_a_fresh_run(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "configs/model/tiny.yaml").write_text(yaml.safe_dump(MODEL))
    (tmp_path / "configs/train/tiny.yaml").write_text(yaml.safe_dump(TRAIN))
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    text = synthetic_text(40_000).decode()
    docs = [text[i : i + 1000] for i in range(0, len(text), 1000)]
    for split, part in (("train", docs[:-5]), ("val", docs[-5:])):
        (corpus / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"pretrain": STAGE}}))
    sh(tmp_path, "git", "init", "-q")
    sh(tmp_path, "dvc", "init", "-q")
    sh(tmp_path, "dvc", "repro", "-q", "pretrain")

    edited = {**TRAIN, "schedule": {"warmup_steps": 3, "decay_steps": 4}}
    (tmp_path / "configs/train/tiny.yaml").write_text(yaml.safe_dump(edited))
    out = sh(tmp_path, "dvc", "repro", "pretrain")
    assert "starting fresh" in out and "train.schedule.warmup_steps: 2 -> 3" in out

    sh(tmp_path, sys.executable, "-m", "enlace.cli", "pretrain", "--no-progress", "--model", "tiny", "--train",
       "tiny", "--set", "hardware.num_threads=1", "--run-dir", "fresh")  # fmt: skip
    repro = list_checkpoints(tmp_path / "runs/pretrain/checkpoints")[-1]
    fresh = list_checkpoints(tmp_path / "fresh/checkpoints")[-1]
    assert repro.name == fresh.name == "step-00000012"
    assert checkpoint_digests(repro) == checkpoint_digests(fresh)
