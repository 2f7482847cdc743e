"""Where a default pretraining step spends its time on this CPU, and how close it gets to the matmul peak.

`python -m bench.profile_pretrain [PRECISION] [BATCH]` (defaults: the precision cpu-auto resolves to here, the
default run's micro-batch): the cpu-small model at seq 256 in the trainer's own step (enlace.train.step), timed
whole and by part (attention forward+backward over all layers, the fused output head, AdamW), then one step under
torch.profiler (self time per op, the matmul share), then compiled (compile time and the compiled step).
Medians of alternating rounds; prints the CPU, its ISA and the matmul peaks of fp32 and of the precision.
To approximate an AVX2-only CPU on an AVX-512 one, run it under ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (docs/cpu-kinds.md).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.bench_pretrain import enlace_step
from bench.common import alternate, cpu_description, matmul_peak_gflops, timed
from enlace.config import load_config
from enlace.config.hardware import HardwareConfig
from enlace.estimate import matmul_weights, train_flops_per_token
from enlace.model import Llama, fused_lm_loss, rope_cos_sin
from enlace.peak import mfu
from enlace.runtime import autocast, keep_freed_memory, resolve_cpu_dtype
from enlace.train.optim import build_optimizer

ROUNDS = 7


def median_s(fn, rounds: int = ROUNDS, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(rounds))


def main(argv: list[str]) -> int:
    precision = argv[0] if argv else resolve_cpu_dtype()
    cfgs = load_config("params.yaml")
    mcfg, tcfg = cfgs.model, cfgs.train
    batch = int(argv[1]) if len(argv) > 1 else tcfg.micro_batch_size
    seq = mcfg.seq_len
    keep_freed_memory()  # as the trainer does
    hw = HardwareConfig(name=f"profile-{precision}", device="cpu", dtype=precision)
    print(f"cpu: {cpu_description()}; threads {torch.get_num_threads()}; {precision}", flush=True)
    peaks = {p: matmul_peak_gflops(p)["gflops"] for p in dict.fromkeys(("fp32", precision))}
    print("matmul peak: " + ", ".join(f"{p} {g:.0f} GFLOP/s" for p, g in peaks.items()), flush=True)

    torch.manual_seed(0)
    x = torch.randint(0, mcfg.vocab_size, (batch, seq + 1))
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    model = Llama(mcfg)
    opt = build_optimizer(model, tcfg.optimizer)
    step = enlace_step(model, model, opt, x, y, hw)
    tokens = batch * seq
    flops_per_token = train_flops_per_token(mcfg, seq)
    flops = flops_per_token * tokens
    t_step = median_s(step)

    # The parts, each forward + backward as in the step.
    h = torch.randn(batch, seq, mcfg.d_model, requires_grad=True)
    w = model.lm_head.weight

    def head():
        with autocast(hw):
            loss, _, _ = fused_lm_loss(h, w, y, mcfg.z_loss_weight)
        loss.backward()

    pos = torch.arange(seq)
    cos, sin = rope_cos_sin(mcfg.head_dim, pos, mcfg.rope_theta)
    xa = torch.randn(batch, seq, mcfg.d_model, requires_grad=True)

    def attention():
        with autocast(hw):
            out = sum(layer.self_attn(xa, cos, sin).float().sum() for layer in model.model.layers)
        out.backward()

    t_head, t_attn, t_opt = median_s(head), median_s(attention), median_s(opt.step)
    head_flops = 6 * mcfg.vocab_size * mcfg.d_model * tokens
    print(f"step {batch}x{seq} {precision} eager: {t_step:.3f} s, {tokens / t_step:.0f} tokens/s, "
          f"{flops / t_step / 1e9:.0f} GFLOP/s = {mfu(tokens / t_step, flops_per_token, peaks[precision]):.0%} of the "
          f"{precision} peak ({flops / 1e9:.1f} GFLOP per step, {matmul_weights(mcfg) / 1e6:.2f} M matmul weights)")  # fmt: skip
    print(f"  output head (fused, fwd+bwd): {t_head:.3f} s ({t_head / t_step:.0%}; "
          f"{head_flops / t_head / 1e9:.0f} GFLOP/s)")  # fmt: skip
    print(
        f"  attention, all layers (q/k/v/o projections included, fwd+bwd): {t_attn:.3f} s ({t_attn / t_step:.0%})"
    )
    print(f"  AdamW step: {t_opt:.3f} s ({t_opt / t_step:.0%})")
    print(f"  the rest (MLPs, norms, embedding, clip): {t_step - t_head - t_attn - t_opt:.3f} s", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm_ops = (
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::_weight_int8pack_mm",
        "mkldnn::_linear_pointwise",
    )
    mm = sum(e.self_cpu_time_total for e in events if e.key in mm_ops)
    print(f"profiler (3 steps, self time): matmul ops {mm / total:.0%} of the step; top ops:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.key:<40} {e.self_cpu_time_total / total:6.1%}  calls {e.count}")
    print(f"  matmul ops run at {flops / (mm / 3 / 1e6) / 1e9:.0f} GFLOP/s when busy", flush=True)

    compiled = torch.compile(model)
    cstep = enlace_step(compiled, model, opt, x, y, hw)
    t0 = time.perf_counter()
    cstep()
    t_compile = time.perf_counter() - t0
    # Eager and compiled alternating, so that a neighbour's load hits both alike.
    times = alternate({"eager": step, "compiled": cstep}, rounds=ROUNDS)
    t_e, t_c = (statistics.median(times[k]) for k in ("eager", "compiled"))
    print(f"compiled: first step {t_compile:.1f} s (compiling); then {t_c:.3f} s per step against "
          f"{t_e:.3f} s eager in the same rounds ({t_e / t_c:.2f}x eager)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
