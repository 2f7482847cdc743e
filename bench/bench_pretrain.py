"""Pretraining step (forward, backward, clip, AdamW): ENLACE vs transformers' LlamaForCausalLM.

Same shapes, same random tokens, same optimizer settings, fp32 on CPU. Both sides run the same math:
for the comparison QK-norm and z-loss are off in ENLACE's model, since LlamaForCausalLM has neither.
FLOPs per step: 6 * N * B * T + 12 * L * d * B * T^2, N = matmul weights (the tied embedding counted once),
attention counted as if not causal. MFU is against the matmul peak measured in the same run.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from bench.common import alternate, line, matmul_peak_gflops, summary, write_result
from enlace.config import load_config
from enlace.config.hardware import HardwareConfig
from enlace.estimate import train_flops_per_token
from enlace.model import Llama
from enlace.train.optim import build_optimizer
from enlace.train.step import StepSettings, TrainState, make_scaler, train_step
from enlace.train.trainer import lm_forward

SHAPES = [
    # (model config, seq_len, micro-batch)
    ("cpu-small", 256, 16),
    ("tiny-50m", 512, 4),
    ("tiny-50m", 2048, 1),
]


def step_flops(cfg, batch: int, seq: int) -> float:
    return train_flops_per_token(cfg, seq) * batch * seq


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


def enlace_step(model, raw, optimizer, x, y):
    """The trainer's own step (enlace.train.step.train_step): fp32, one micro-batch, clip at 1."""
    cpu = torch.device("cpu")
    hw = HardwareConfig(name="bench", device="cpu")
    state = TrainState(raw, optimizer, make_scaler(cpu, hw), cpu)
    settings = StepSettings(accum=1, grad_clip=1.0, hardware=hw)
    batch = (x, y)
    forward = functools.partial(lm_forward, accum=1)
    lr = optimizer.param_groups[0]["lr"]
    return lambda: train_step(state, model, batch, lambda: batch, forward, lr, settings)


def make_step(model, optimizer, x, y, hf: bool):
    def step():
        optimizer.zero_grad(set_to_none=True)
        if hf:
            loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        else:
            loss = model(x, targets=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def bench_shape(
    name: str, seq: int, batch: int, rounds: int, compile_too: bool, peak: float, train_cfg
) -> dict:
    cfg = load_config("params.yaml", layers=("model",), select={"model": name}).model
    cfg = cfg.model_copy(update={"seq_len": seq, "qk_norm": False, "z_loss_weight": 0.0})
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    ours = Llama(cfg)
    peer = hf_model(cfg)
    peer.load_state_dict(ours.state_dict(), strict=False)  # same starting weights
    contenders = {
        "enlace": enlace_step(ours, ours, build_optimizer(ours, train_cfg.optimizer), x, y),
        "transformers": make_step(
            peer, torch.optim.AdamW(peer.parameters(), lr=train_cfg.optimizer.lr), x, y, hf=True
        ),
    }
    if compile_too:
        ours_c, peer_c = torch.compile(ours), torch.compile(peer)
        contenders["enlace-compiled"] = enlace_step(
            ours_c, ours, build_optimizer(ours, train_cfg.optimizer), x, y
        )
        contenders["transformers-compiled"] = make_step(
            peer_c, torch.optim.AdamW(peer.parameters(), lr=train_cfg.optimizer.lr), x, y, hf=True
        )
    times = alternate(contenders, rounds=rounds, warmup=2 if compile_too else 1)
    stats = {k: summary(v) for k, v in times.items()}
    flops = step_flops(cfg, batch, seq)
    for s in stats.values():
        s["tokens_per_s"] = batch * seq / s["median_s"]
        s["mfu"] = flops / s["median_s"] / (peak * 1e9)
    best = min(
        ("enlace", "enlace-compiled") if compile_too else ("enlace",), key=lambda k: stats[k]["median_s"]
    )
    label = f"pretrain {name} seq {seq} batch {batch}"
    print(line(f"{label} [eager]", stats["enlace"], stats["transformers"], "transformers"))
    if compile_too:
        print(
            line(
                f"{label} [{best} vs compiled]",
                stats[best],
                stats["transformers-compiled"],
                "transformers-compiled",
            )
        )
    print("  MFU: " + ", ".join(f"{k} {v['mfu']:.0%}" for k, v in stats.items()))
    return {
        "shape": {"model": name, "seq": seq, "batch": batch},
        "flops_per_step": flops,
        "stats": stats,
        "best": best,
    }


def main() -> int:
    rounds = int(os.environ.get("BENCH_ROUNDS", 3))
    compile_too = os.environ.get("BENCH_COMPILE", "1") != "0"
    shapes = SHAPES[: int(os.environ.get("BENCH_SHAPES", len(SHAPES)))]
    train_cfg = load_config("params.yaml", layers=("train",)).train
    peak = matmul_peak_gflops()
    print(f"matmul peak: {peak:.0f} GFLOP/s on {torch.get_num_threads()} threads")
    results = [bench_shape(n, s, b, rounds, compile_too, peak, train_cfg) for n, s, b in shapes]
    write_result("pretrain", {"peak_gflops": peak, "rounds": rounds, "results": results})
    worst_eager = min(
        r["stats"]["transformers"]["median_s"] / r["stats"][r["best"]]["median_s"] for r in results
    )
    summary_line = f"pretrain: worst ratio vs transformers eager {worst_eager:.2f}x"
    if compile_too:
        worst_c = min(
            r["stats"]["transformers-compiled"]["median_s"] / r["stats"][r["best"]]["median_s"]
            for r in results
        )
        summary_line += f", vs transformers compiled {worst_c:.2f}x"
    print(summary_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
