"""Memory preflight: formulas, the 2060 verdict, and the estimate against measured CPU peaks.

Measuring: a child process runs real forward+backward+AdamW steps and reads its peak resident memory
(VmHWM, reset through /proc/self/clear_refs). glibc's malloc is told to serve every allocation over 64 KiB
by mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and VmHWM follows the
live tensor bytes; libraries are warmed up on a throwaway model first so their one-off buffers are in the
baseline. Repeated runs here agree within 0.1%; the estimate must match within TOLERANCE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enlace.config import load_config
from enlace.config.hardware import HardwareConfig
from enlace.config.model import ModelConfig
from enlace.errors import EnlaceError
from enlace.estimate import (
    GIB,
    activation_bytes,
    estimate_training_memory,
    kv_cache_bytes,
    largest_fitting_micro_batch,
    logits_loss_bytes,
    preflight,
    suggest_geometry,
)
from enlace.model import KVCache, Llama

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15  # the goal stated in the issue; measured agreement is far closer (see the report)

SMALL = ModelConfig(
    name="t",
    vocab_size=8192,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    d_model=128,
    seq_len=256,
    qk_norm=True,
    z_loss_weight=1e-4,
)
CPU = HardwareConfig(name="cpu", device="cpu", dtype="fp32", memory_gib=24.0)
CPU_BF16 = HardwareConfig(name="cpu-bf16", device="cpu", dtype="bf16", memory_gib=24.0)

CHILD = r"""
import json, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from enlace.config.model import ModelConfig
from enlace.model import Llama

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
cfg = ModelConfig(**spec["model"])
# "auto" is the model's own choice: plain-matmul attention at these lengths on CPU.
backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH, "auto": SDPBackend.MATH}[spec["attention"]]
dtype = {"fp32": None, "bf16": torch.bfloat16}[spec["dtype"]]

def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def step(model, opt, x):
    with sdpa_kernel([backend]), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x, x)  # held through backward, as the trainer does: the logits stay alive
    out.loss.backward()
    del out
    opt.step()
    # keep the gradients allocated, as between micro-batches of an accumulated step
    opt.zero_grad(set_to_none=False)

# warm up oneDNN, OpenMP and the autograd engine on a throwaway model: their buffers join the baseline
warm = Llama(ModelConfig(**{**spec["model"], "vocab_size": 256, "n_layer": 1}), spec["attention"])
step(warm, torch.optim.AdamW(warm.parameters()), torch.randint(0, 256, (1, 64)))
del warm

torch.manual_seed(0)
model = Llama(cfg, spec["attention"])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq_len"]))
base = rss("VmRSS")
reset_peak()
step(model, opt, x)
step(model, opt, x)
print(json.dumps({"increment": rss("VmHWM") - base}))
"""


def measure(model: ModelConfig, batch: int, seq_len: int, dtype: str, attention: str) -> int:
    """Peak resident bytes above the process's state after building the model (weights included there)."""
    spec = {
        "model": model.model_dump(),
        "batch": batch,
        "seq_len": seq_len,
        "dtype": dtype,
        "attention": attention,
    }
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["increment"]


def predicted_increment(model: ModelConfig, hw: HardwareConfig, batch: int, seq_len: int) -> int:
    """Everything the estimate counts except the weights, which the child's baseline already holds."""
    est = estimate_training_memory(model, hw, batch, seq_len)
    return est.peak - est.parts["weights (fp32)"]


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak memory"
)


@needs_proc
@pytest.mark.slow  # 20-45 s each on 2 busy cores (pytest --durations)
@pytest.mark.parametrize(
    "hw,attention",
    [(CPU, "flash"), (CPU_BF16, "flash"), (CPU, "math"), (CPU, "auto"), (CPU_BF16, "auto")],
    ids=["fp32-flash", "bf16-flash", "fp32-math", "fp32-matmul", "bf16-matmul"],
)
def test_estimate_matches_measured_cpu_peak(hw: HardwareConfig, attention: str) -> None:
    hw = hw.model_copy(update={"sdpa_backend": attention})
    results = {}
    for batch in (2, 4):
        measured = measure(SMALL, batch, 256, hw.dtype, attention)
        predicted = predicted_increment(SMALL, hw, batch, 256)
        results[batch] = (measured, predicted)
        assert abs(predicted - measured) <= TOLERANCE * measured, (batch, measured, predicted)
    # The increment between batch sizes cancels whatever baseline the process has.
    d_measured = results[4][0] - results[2][0]
    d_predicted = results[4][1] - results[2][1]
    assert abs(d_predicted - d_measured) <= TOLERANCE * d_measured, (d_measured, d_predicted)


def test_parts_follow_the_formulas() -> None:
    est = estimate_training_memory(SMALL, CPU, 4, 256)
    n = Llama(SMALL).num_parameters()
    assert est.parts["weights (fp32)"] == 4 * n
    assert est.parts["AdamW moments (2 x fp32)"] == 8 * n
    assert (
        est.parts["logits + loss"]
        == logits_loss_bytes(SMALL, "fp32", 4, 256)
        == (
            min(4 * 256, (1 << 24) // 8192) * 8192 * 4
            + 4 * 4 * 256 * SMALL.d_model
            + 8 * 8192 * SMALL.d_model
        )
    )
    # activations and logits grow linearly in the batch
    assert activation_bytes(SMALL, "fp32", "flash", 8, 256) == 2 * activation_bytes(
        SMALL, "fp32", "flash", 4, 256
    )
    # the math backend materialises B*H*T*T probabilities; fused kernels do not
    extra = activation_bytes(SMALL, "fp32", "math", 1, 256) - activation_bytes(SMALL, "fp32", "flash", 1, 256)
    assert extra >= 4 * SMALL.n_layer * SMALL.n_head * 256 * 256
    # half precision halves the matmul outputs but keeps the fp32 residual stream and loss
    assert activation_bytes(SMALL, "fp16", "flash", 4, 256) < activation_bytes(SMALL, "fp32", "flash", 4, 256)


def test_kv_cache_formula_matches_the_model_cache() -> None:
    import torch

    cache = KVCache.empty(SMALL, batch=3, max_len=100, device=torch.device("cpu"), dtype=torch.float16)
    real = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert kv_cache_bytes(SMALL, 3, 100, "fp16") == real == 2 * 2 * 3 * 2 * 100 * 32 * 2


def test_suggest_geometry_keeps_global_batch() -> None:
    assert suggest_geometry(3, 64, 1) == (2, 32)
    assert suggest_geometry(16, 64, 2) == (16, 2)
    assert suggest_geometry(5, 63, 2) is None


def _cfg(hardware: str, train: str, sets: list[str] | None = None):
    return load_config(
        ROOT / "params.yaml",
        layers=("hardware", "model", "train"),
        select={"hardware": hardware, "model": "tiny-50m", "train": train},
        overrides=sets or [],
    )


def test_preflight_rejects_tiny50m_on_2060_with_advice() -> None:
    cfg = _cfg("rtx2060", "tiny-50m-2060", ["train.micro_batch_size=8", "train.grad_accum_steps=8"])
    with pytest.raises(EnlaceError) as e:
        preflight(cfg)
    fitting = largest_fitting_micro_batch(cfg.model, cfg.hardware)
    msg = str(e.value)
    assert "rtx2060" in msg and f"largest micro_batch_size that fits is {fitting}" in msg
    mb, accum = suggest_geometry(fitting, 64, 1)
    assert f"train.micro_batch_size={mb}" in msg and f"train.grad_accum_steps={accum}" in msg
    # the advice itself passes
    ok = preflight(
        _cfg("rtx2060", "tiny-50m-2060", [f"train.micro_batch_size={mb}", f"train.grad_accum_steps={accum}"])
    )
    assert ok.fits and ok.peak < 6 * GIB


def test_estimate_command_prints_table_and_verdict(capsys) -> None:
    from enlace.cli import main

    def estimate(micro_batch: int) -> tuple[int, str]:
        args = ["--params", str(ROOT / "params.yaml"), "--hardware", "rtx2060", "--model", "tiny-50m"]
        rc = main(["estimate", *args, "--train", "tiny-50m-2060", "--micro-batch", str(micro_batch)])
        return rc, capsys.readouterr().out

    rc, out = estimate(1)
    assert rc == 0 and "logits + loss" in out and "verdict: fits" in out
    rc, out = estimate(16)
    assert rc == 1 and "does NOT fit" in out and "grad_accum_steps=" in out
