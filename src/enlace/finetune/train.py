"""`enlace finetune`: train a LoRA adapter, with atomic checkpoints and exact resume."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from ..config.finetune import FinetuneConfig
from ..config.hardware import HardwareConfig
from ..errors import CheckpointError
from ..hardware import autocast, setup_runtime
from ..io import atomic_write_text
from ..train.checkpoint import latest_checkpoint, load_optimizer_tensors, optimizer_tensors, save_checkpoint
from .data import batch_indices, collate, load_dataset
from .hf import load_hf_folder
from .lora import cast_frozen_base, inject_lora, lora_parameters, save_adapter
from .loss import assistant_loss_sum
from .tokenizer import HFTokenizer

# Settings a checkpoint must share with the run that resumes it (anything else would not be "exact").
RESUME_KEYS = (
    "base_model",
    "train_data",
    "format",
    "system_prompt",
    "steps",
    "micro_batch",
    "grad_accum",
    "lr",
    "warmup",
    "final_lr_frac",
    "weight_decay",
    "grad_clip",
    "max_len",
    "max_examples",
    "rank",
    "alpha",
    "dropout",
    "targets",
    "seed",
)


def lr_at(step: int, cfg: FinetuneConfig) -> float:
    """Linear warmup, then cosine decay to final_lr_frac * lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def prepare(cfg: FinetuneConfig, device: torch.device):
    """Base model with fresh adapters (seeded), tokenizer and training data."""
    tok = HFTokenizer(Path(cfg.base_model))
    model = load_hf_folder(Path(cfg.base_model), device=device)
    torch.manual_seed(cfg.seed)
    inject_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.dropout)
    data = load_dataset(
        tok, Path(cfg.train_data), cfg.format, cfg.max_len, cfg.max_examples or None, cfg.system_prompt
    )
    return model, tok, data


def _resume_meta(cfg: FinetuneConfig) -> dict:
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k in RESUME_KEYS}


def train_step(
    model, tok, data, cfg: FinetuneConfig, step: int, hw: HardwareConfig, device
) -> tuple[float, int]:
    """One optimizer step's forward and backward over grad_accum micro-batches; returns (mean loss, tokens)."""
    micro = [
        collate(
            [
                data.examples[i]
                for i in batch_indices(
                    len(data.examples), cfg.micro_batch, step * cfg.grad_accum + m, cfg.seed
                )
            ],
            tok.pad_id,
        )
        for m in range(cfg.grad_accum)
    ]
    # Normalise by the step's total label count, so each token weighs the same whatever micro-batch it is in.
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    loss_sum = 0.0
    for b in micro:
        with autocast(hw):
            s, _ = assistant_loss_sum(model, b["input_ids"].to(device), b["labels"].to(device))
        (s / max(total, 1)).backward()
        loss_sum += float(s.detach())
    return loss_sum / max(total, 1), total


def finetune(cfg: FinetuneConfig, hw: HardwareConfig, fresh: bool = False, progress: bool = True) -> dict:
    from tqdm import tqdm

    device = setup_runtime(hw)
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    model, tok, data = prepare(cfg, device)
    if hw.dtype == "bf16":
        cast_frozen_base(model)  # the frozen base in bf16 under bf16 autocast; adapters and AdamW stay fp32
    rep = data.report()
    print(
        f"data: {rep['examples']} examples ({rep['assistant_tokens']} assistant tokens); dropped "
        f"{rep['dropped_too_long']} longer than max_len={cfg.max_len}, {rep['dropped_no_answer']} without an answer",
        flush=True,
    )
    named = lora_parameters(model)
    names = [n for n, _ in named]
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    start = 0
    if fresh and ckpt_root.exists():
        # A stale higher-step checkpoint of an earlier run would otherwise win the next resume.
        shutil.rmtree(ckpt_root)
    found = None if fresh else latest_checkpoint(ckpt_root)
    if found is not None:
        path, tensors, meta = found
        if meta.get("config") != _resume_meta(cfg):
            diff = sorted(k for k in RESUME_KEYS if meta.get("config", {}).get(k) != _resume_meta(cfg).get(k))
            raise CheckpointError(
                f"{path}: written with different settings ({', '.join(diff)}); use --fresh to restart"
            )
        with torch.no_grad():
            for n, p in named:
                p.copy_(tensors["adapter"][n])
        load_optimizer_tensors(opt, names, tensors["optimizer"], meta["param_groups"])
        torch.set_rng_state(tensors["rng"]["torch"])
        start = int(meta["step"])
        print(f"resumed from {path} at step {start}", flush=True)
    metrics_path = out / "metrics.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    # Keep the log consistent with the checkpoint: lines after the resumed step are replayed anyway.
    kept = []
    if metrics_path.exists() and start > 0:
        kept = [
            ln
            for ln in metrics_path.read_text(encoding="utf-8").splitlines()
            if ln and json.loads(ln)["step"] <= start
        ]
    atomic_write_text(metrics_path, "".join(ln + "\n" for ln in kept))

    model.train()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="finetune")
    last = json.loads(kept[-1]) if kept else {}
    with open(metrics_path, "a", encoding="utf-8") as log:
        for step in bar:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, ntok = train_step(model, tok, data, cfg, step, hw, device)
            gnorm = torch.nn.utils.clip_grad_norm_(
                params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            last = {
                "step": step + 1,
                "loss": round(loss, 5),
                "lr": lr,
                "grad_norm": round(float(gnorm), 5),
                "tokens": ntok,
                "s_per_step": round(dt, 3),
            }
            log.write(json.dumps(last) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", s_step=f"{dt:.2f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                flat, groups = optimizer_tensors(opt, names)
                save_checkpoint(
                    ckpt_root,
                    step + 1,
                    {
                        "adapter": {n: p.detach() for n, p in named},
                        "optimizer": flat,
                        "rng": {"torch": torch.get_rng_state()},
                    },
                    {"config": _resume_meta(cfg), "param_groups": groups},
                    keep_last=cfg.keep_checkpoints,
                )
    save_adapter(model, out / "adapter", cfg.base_model)
    print(f"adapter written to {out / 'adapter'}", flush=True)
    return {"final": last, "data": rep}
