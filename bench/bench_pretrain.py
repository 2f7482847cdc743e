"""Pretraining step (forward, backward, clip, AdamW): ENLACE vs transformers' LlamaForCausalLM.

Same shapes, same random tokens, same optimizer settings, same precision on both sides: by default the
precision the default run trains in on this CPU (cpu-auto: bf16 autocast with fp32 master weights and AdamW
state where bf16 is native, else fp32), compiled too where that run compiles; BENCH_PRECISIONS=fp32,bf16 and
BENCH_COMPILE=1/0 choose. For the comparison QK-norm and z-loss are off in
ENLACE's model, since LlamaForCausalLM has neither. ENLACE's side runs the trainer's autocast and optimizer.
The process has the trainer's CPU allocator setting (enlace.runtime.keep_freed_memory): it applies to the
whole process, so the peer gets it too.

FLOPs per step: enlace.estimate.train_flops_per_token (6 N + 12 L d T per token, attention counted
non-causal). MFU (enlace.peak.mfu) is against the matmul peak of the same precision, measured robustly in the same run (best
of several shapes and repeats, before and after the steps); an MFU above 100% fails the benchmark.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from bench.common import (
    alternate,
    check_mfu,
    default_compile,
    default_precision,
    format_row,
    goal_row,
    line,
    matmul_peak_gflops,
    peak_update,
    summary,
    write_result,
)
from enlace.config import load_config
from enlace.config.hardware import HardwareConfig
from enlace.estimate import train_flops_per_token
from enlace.model import Llama
from enlace.peak import mfu
from enlace.runtime import autocast, keep_freed_memory
from enlace.train.optim import build_optimizer
from enlace.train.step import StepSettings, TrainState, make_scaler, train_step
from enlace.train.trainer import lm_forward

SHAPES = [
    # (model config, seq_len, micro-batch): the default run's shape and tiny-50m at seq 512
    ("cpu-small", 256, 16),
    ("tiny-50m", 512, 4),
    ("tiny-50m", 2048, 1),
]
GOALS = {"eager": 1.25, "compiled": 1.0, "mfu": 0.5}


def hw_for(precision: str) -> HardwareConfig:
    return HardwareConfig(name=f"bench-{precision}", device="cpu", dtype=precision)


def hf_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf_cfg)


def enlace_step(model, raw, optimizer, x, y, hw: HardwareConfig):
    """The trainer's own step (enlace.train.step.train_step) under `hw`'s autocast: one micro-batch, clip at 1."""
    cpu = torch.device("cpu")
    state = TrainState(raw, optimizer, make_scaler(cpu, hw), cpu)
    settings = StepSettings(accum=1, grad_clip=1.0, hardware=hw)
    batch = (x, y)
    forward = functools.partial(lm_forward, accum=1)
    lr = optimizer.param_groups[0]["lr"]
    return lambda: train_step(state, model, batch, lambda: batch, forward, lr, settings)


def make_step(model, optimizer, x, y, hf: bool, hw: HardwareConfig):
    def step():
        optimizer.zero_grad(set_to_none=True)
        # Both sides under the same autocast (none for fp32): the trainer's, from the hardware profile.
        with autocast(hw):
            if hf:
                loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
            else:
                loss = model(x, targets=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def bench_shape(name: str, seq: int, batch: int, precision: str, rounds: int, compile_too: bool, train_cfg):
    cfg = load_config("params.yaml", layers=("model",), select={"model": name}).model
    cfg = cfg.model_copy(update={"seq_len": seq, "qk_norm": False, "z_loss_weight": 0.0})
    hw = hw_for(precision)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    ours = Llama(cfg)
    peer = hf_model(cfg)
    peer.load_state_dict(ours.state_dict(), strict=False)  # same starting weights

    def peer_opt(model):
        return torch.optim.AdamW(model.parameters(), lr=train_cfg.optimizer.lr)

    contenders = {
        "enlace": enlace_step(ours, ours, build_optimizer(ours, train_cfg.optimizer), x, y, hw),
        "transformers": make_step(peer, peer_opt(peer), x, y, True, hw),
    }
    if compile_too:
        ours_c, peer_c = torch.compile(ours), torch.compile(peer)
        contenders["enlace-compiled"] = enlace_step(
            ours_c, ours, build_optimizer(ours, train_cfg.optimizer), x, y, hw
        )
        contenders["transformers-compiled"] = make_step(peer_c, peer_opt(peer), x, y, True, hw)
    times = alternate(contenders, rounds=rounds, warmup=2 if compile_too else 1)
    stats = {k: summary(v) for k, v in times.items()}
    flops_per_token = train_flops_per_token(cfg, seq)
    for s in stats.values():
        s["tokens_per_s"] = batch * seq / s["median_s"]
    label = f"{name} seq {seq} batch {batch} {precision}"
    print(
        line(f"pretrain {label} [eager]", stats["enlace"], stats["transformers"], "transformers"), flush=True
    )
    if compile_too:
        print(
            line(
                f"pretrain {label} [compiled]",
                stats["enlace-compiled"],
                stats["transformers-compiled"],
                "transformers-compiled",
            ),
            flush=True,
        )
    return {"shape": {"model": name, "seq": seq, "batch": batch}, "precision": precision,
            "flops_per_step": flops_per_token * batch * seq, "flops_per_token": flops_per_token,
            "stats": stats}  # fmt: skip


def main() -> int:
    rounds = int(os.environ.get("BENCH_ROUNDS", 3))
    keep_freed_memory()  # as setup_runtime does for a CPU run
    # Compiled contenders where the default run compiles on this CPU (the fp32 kind trains eager).
    compile_too = os.environ.get("BENCH_COMPILE", "1" if default_compile() else "0") != "0"
    shapes = SHAPES[: int(os.environ.get("BENCH_SHAPES", 2))]
    # Default: the precision the default run trains in on this CPU (cpu-auto's kind: bf16 or fp32).
    precisions = os.environ.get("BENCH_PRECISIONS", default_precision()).split(",")
    train_cfg = load_config("params.yaml", layers=("train",)).train
    peaks = {p: matmul_peak_gflops(p) for p in precisions}
    for p, pk in peaks.items():
        print(f"matmul peak {p}: {pk['gflops']:.0f} GFLOP/s on {torch.get_num_threads()} threads", flush=True)
    results = [
        bench_shape(n, s, b, p, rounds, compile_too, train_cfg) for p in precisions for n, s, b in shapes
    ]
    # Measure again after the steps: the peak is the best seen in this run, so a busy moment cannot lower it.
    for p in precisions:
        peaks[p] = peak_update(peaks[p], matmul_peak_gflops(p))
        print(f"matmul peak {p} (best of the run): {peaks[p]['gflops']:.0f} GFLOP/s", flush=True)
    rows = []
    for r in results:
        p, st = r["precision"], r["stats"]
        label = f"pretrain {r['shape']['model']} seq {r['shape']['seq']}"
        for k, s in st.items():
            mfu_k = mfu(s["tokens_per_s"], r["flops_per_token"], peaks[p]["gflops"])
            s["mfu"] = check_mfu(mfu_k, f"{label} {k}", peaks[p])
        print(f"  MFU {label} {p}: " + ", ".join(f"{k} {v['mfu']:.0%}" for k, v in st.items()), flush=True)
        best = min((k for k in st if k.startswith("enlace")), key=lambda k: st[k]["median_s"])
        r["best"] = best
        ours = f"{best.replace('-', ' ')} {p}"
        ratio = st["transformers"]["median_s"] / st[best]["median_s"]
        rows.append(goal_row(f"{label} step", ours, f"transformers eager {p}", ratio, ">=", GOALS["eager"]))
        if compile_too:
            ratio_c = st["transformers-compiled"]["median_s"] / st[best]["median_s"]
            rows.append(
                goal_row(
                    f"{label} step", ours, f"transformers compiled {p}", ratio_c, ">=", GOALS["compiled"]
                )
            )
        if p in ("bf16", "fp32"):
            rows.append(goal_row(f"{label} MFU vs {p} peak", ours, f"peak {peaks[p]['gflops']:.0f} GFLOP/s",
                                 st[best]["mfu"] * 100, ">=", GOALS["mfu"] * 100, "%"))  # fmt: skip
    by = {(r["precision"], r["shape"]["model"], r["shape"]["seq"]): r for r in results}
    for (p, model, seq), r in by.items():
        if p == "bf16" and ("fp32", model, seq) in by:  # what native bf16 buys over the fp32 reference
            speedup = by["fp32", model, seq]["stats"]["enlace"]["median_s"] / r["stats"]["enlace"]["median_s"]
            print(f"  enlace eager bf16 / fp32 step, {model} seq {seq}: {speedup:.2f}x", flush=True)
    write_result("pretrain", {"peaks": peaks, "rounds": rounds, "results": results, "rows": rows})
    for row in rows:
        print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
