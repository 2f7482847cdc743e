"""The GPU check's CPU-side logic: FLOPs/MFU formulas, the training and resume loops, the skip path."""

from __future__ import annotations

import pytest
import torch

from enlace.config.model import ModelConfig
from enlace.estimate import matmul_weights, train_flops_per_token
from enlace.gpu_check import main, resume_check, train_check
from enlace.model import Llama
from enlace.peak import mfu

TINY = ModelConfig(
    name="t",
    vocab_size=256,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    d_model=64,
    seq_len=64,
    qk_norm=True,
    z_loss_weight=1e-4,
)


def test_flops_formula() -> None:
    model = Llama(TINY)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)  # tied embedding once
    assert matmul_weights(TINY) == matmul
    assert train_flops_per_token(TINY, 64) == 6 * matmul + 12 * 2 * 64 * 64
    # Untied, the input embedding is a lookup: the same FLOPs as tied.
    untied = TINY.model_copy(update={"tie_embeddings": False})
    head = sum(p.numel() for n, p in Llama(untied).named_parameters() if p.dim() == 2 and "embed" not in n)
    assert matmul_weights(untied) == head == matmul
    # 1000 tokens/s of a 1 GFLOP-per-token model on a 10 TFLOP/s (10,000 GFLOP/s) device is 10% MFU
    assert mfu(1000.0, 1e9, 1e4) == pytest.approx(0.1)


def test_train_loop_memorises_on_cpu() -> None:
    r = train_check(TINY, torch.device("cpu"), "fp32", "math", steps=12, batch=2, seq_len=32)
    assert r["ok"] and r["finite"] and r["falling"], r["losses"]
    assert r["tokens_per_s"] > 0


def test_resume_is_bit_exact_on_cpu() -> None:
    r = resume_check(TINY, torch.device("cpu"), "fp32", None, k=3, batch=2, seq_len=32)
    assert r["ok"], r


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_skips_cleanly_without_gpu(tmp_path, capsys) -> None:
    out = tmp_path / "gpu.json"
    assert main(["--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().out and not out.exists()
