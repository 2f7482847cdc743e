"""`enlace finetune`: train a LoRA adapter on the shared training core (enlace.train.step).

Same guarantees as pretraining: one checkpoint layout (adapter weights as the "model" group, AdamW, scaler,
counters, every RNG), GradScaler under fp16, non-finite steps skipped, SIGTERM/SIGINT save and stop, a run
identity (settings, data, base model, code) that decides what may be resumed.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import model as model_module
from ..config.finetune import FinetuneConfig
from ..config.hardware import HardwareConfig
from ..errors import EnlaceError
from ..hf import folder as hf_module
from ..hf.folder import load_hf_folder
from ..hf.tokenizer import HFTokenizer
from ..io import sha256_file
from ..runtime import setup_runtime
from ..train import schedule as schedule_module
from ..train import step as step_module
from ..train.checkpoint import clean_partial, latest_checkpoint, list_checkpoints, save_checkpoint
from ..train.identity import RunIdentity, code_fingerprint, reconcile, weight_keys
from ..train.lock import run_dir_lock
from ..train.metrics import MetricsLog, read_jsonl
from ..train.schedule import wsd_lr
from ..train.signals import SecondInterrupt, StopFlag, abandoned
from ..train.step import StepSettings, TrainState, make_scaler, train_step
from . import data as data_module
from . import lora as lora_module
from . import loss as loss_module
from .data import batch_indices, collate, load_dataset
from .lora import cast_frozen_base, inject_lora, lora_parameters, save_adapter
from .loss import assistant_loss_sum

# Settings that provably do not change the adapter: where it goes, how often it is saved, what is done
# with it afterwards (held-out data, prompts, decoding).
CADENCE_KEYS = (
    "finetune.name",
    "finetune.out",
    "finetune.val_data",
    "finetune.checkpoint_every",
    "finetune.keep_checkpoints",
    "finetune.on_identity_change",
    "finetune.max_nonfinite_in_row",
    "finetune.eval_prompts",
    "finetune.questions",
    "finetune.judge_base",
    "finetune.generation",
)
# The model's own forward is part of every step: a change there (attention, say) must not resume old adapters.
STEP_CODE = (model_module, step_module, schedule_module, data_module, hf_module, lora_module, loss_module)
RUN_FILES = ("metrics.jsonl", "adapter", "eval.json")


class FinetuneDiverged(EnlaceError):
    """Too many non-finite losses or gradients in a row."""


@dataclass
class FinetuneResult:
    final: dict[str, Any]  # the last metrics record
    data: dict[str, Any]  # the dataset report
    interrupted: str | None = None

    @property
    def exit_code(self) -> int:
        return {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}.get(self.interrupted or "", 0)


def finetune_lr(cfg: FinetuneConfig, step: int) -> float:
    """Linear warmup, then a cosine decay to final_lr_frac * lr at the last step: WSD without a plateau."""
    return wsd_lr(
        step,
        max_steps=cfg.steps,
        peak_lr=cfg.lr,
        warmup_steps=cfg.warmup,
        decay_steps=max(cfg.steps - cfg.warmup, 0),
        decay_shape="cosine",
        final_lr_frac=cfg.final_lr_frac,
    )


def decay_start(keys: dict[str, Any]) -> int:
    """The cosine decay starts right after warmup: steps up to there do not depend on the step count."""
    return min(keys["finetune.warmup"], keys["finetune.steps"])


def base_fingerprint(folder: Path) -> str:
    """The base model's weights and config, by content (a copied folder is the same base)."""
    parts = [f"{p.name}:{sha256_file(p)}" for p in sorted(Path(folder).glob("*.safetensors"))]
    cfg = Path(folder) / "config.json"
    parts.append(sha256_file(cfg) if cfg.exists() else "-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def run_identity(cfg: FinetuneConfig, hw: HardwareConfig) -> RunIdentity:
    keys = weight_keys({"finetune": cfg.model_dump(mode="json")}, CADENCE_KEYS)
    keys.update(
        {
            "data.fingerprint": sha256_file(Path(cfg.train_data))[:16],
            "base.fingerprint": base_fingerprint(Path(cfg.base_model)),
            "hardware.dtype": hw.dtype,
            "hardware.loss_scaler": hw.loss_scaler,
            "code": code_fingerprint(STEP_CODE),
        }
    )
    return RunIdentity(keys, steps_key="finetune.steps")


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


def micro_batches(
    data: Any, pad_id: int, cfg: FinetuneConfig, start_step: int, device: torch.device
) -> Iterator:
    """Each step's micro-batches, tagged with the step's label count: every token weighs the same whatever
    micro-batch it is in."""
    step = start_step
    while True:
        batches = [
            collate(
                [
                    data.examples[i]
                    for i in batch_indices(
                        len(data.examples), cfg.micro_batch, step * cfg.grad_accum + m, cfg.seed
                    )
                ],
                pad_id,
            )
            for m in range(cfg.grad_accum)
        ]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            yield {"input_ids": b["input_ids"].to(device), "labels": b["labels"].to(device), "total": total}
        step += 1


def sft_forward(model: torch.nn.Module, batch: dict[str, Any]):
    s, n = assistant_loss_sum(model, batch["input_ids"], batch["labels"])
    return s / max(batch["total"], 1), {"tokens": s.new_tensor(float(n))}


def save(state: TrainState, cfg: FinetuneConfig, ident: RunIdentity) -> Path:
    tensors, meta = state.state_dict()
    meta.update({"identity": ident.hash, "identity_keys": ident.keys, "config": cfg.model_dump(mode="json")})
    pinned = [decay_start(ident.keys)]
    return save_checkpoint(
        Path(cfg.out) / "checkpoints", state.step, tensors, meta, cfg.keep_checkpoints, pinned
    )


def finetune(
    cfg: FinetuneConfig, hw: HardwareConfig, fresh: bool = False, progress: bool = True
) -> FinetuneResult:
    """Train (or resume) the adapter run in cfg.out; one process per run folder."""
    with run_dir_lock(Path(cfg.out)):
        return _finetune(cfg, hw, fresh, progress)


def _finetune(cfg: FinetuneConfig, hw: HardwareConfig, fresh: bool, progress: bool) -> FinetuneResult:
    from tqdm import tqdm

    device = setup_runtime(hw)
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    model, tok, data = prepare(cfg, device)  # checks the base folder and the data file, naming them
    if hw.dtype == "bf16":
        cast_frozen_base(model)  # the frozen base in bf16 under bf16 autocast; adapters and AdamW stay fp32
    ident = run_identity(cfg, hw)
    rep = data.report()
    print(
        f"data: {rep['examples']} examples ({rep['assistant_tokens']} assistant tokens); dropped "
        f"{rep['dropped_too_long']} longer than max_len={cfg.max_len}, {rep['dropped_no_answer']} without an answer",
        flush=True,
    )
    named = lora_parameters(model)
    groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    state = TrainState(model, opt, make_scaler(device, hw), device, trainable_only=True)

    out.mkdir(parents=True, exist_ok=True)
    if fresh and ckpt_root.exists():
        shutil.rmtree(ckpt_root)  # --fresh: a stale checkpoint would otherwise win the next resume
    clean_partial(ckpt_root)
    why = reconcile(out, "checkpoints", ident, decay_start, RUN_FILES, cfg.on_identity_change)
    if why:
        print(why, flush=True)
    log = MetricsLog(out / "metrics.jsonl")
    found = latest_checkpoint(ckpt_root)
    last: dict[str, Any] = {}
    if found is not None:
        path, tensors, meta = found
        state.load_state_dict(tensors, meta)
        log.truncate_after(state.step)
        last = ([r for r in read_jsonl(log.path) if "loss" in r] or [{}])[-1]
        print(f"resumed from {path} at step {state.step}", flush=True)
    else:
        log.reset()

    model.train()
    settings = StepSettings(cfg.grad_accum, cfg.grad_clip, hw)
    next_batch = functools.partial(next, micro_batches(data, tok.pad_id, cfg, state.step, device))
    batch = next_batch()
    interrupted = None
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="finetune")
    try:
        with StopFlag() as stop:
            while state.step < cfg.steps:
                t0 = time.perf_counter()
                lr = finetune_lr(cfg, state.step)
                res, batch = train_step(state, model, batch, next_batch, sft_forward, lr, settings)
                ntok = int(round(res.parts["tokens"]))
                state.tokens += ntok
                if state.nonfinite_in_row >= cfg.max_nonfinite_in_row:
                    done = list_checkpoints(ckpt_root)
                    raise FinetuneDiverged(
                        f"{state.nonfinite_in_row} non-finite losses/gradients in a row (up to step {state.step}, "
                        f"finetune.max_nonfinite_in_row={cfg.max_nonfinite_in_row}); the last good checkpoint is "
                        f"{done[-1] if done else 'none'}. Lower finetune.lr or check the data"
                    )
                dt = time.perf_counter() - t0
                last = {
                    "step": state.step,
                    "loss": round(res.loss, 5),
                    "lr": res.lr,
                    "grad_norm": round(res.grad_norm, 5),
                    "tokens": ntok,
                    "s_per_step": round(dt, 3),
                    "skipped": state.skipped,
                }
                log.append(last)
                bar.update(1)
                bar.set_postfix(loss=f"{res.loss:.3f}", lr=f"{res.lr:.2e}", s_step=f"{dt:.2f}")
                due = state.step % cfg.checkpoint_every == 0 or state.step in (
                    cfg.steps,
                    decay_start(ident.keys),
                )
                if due or stop.signal:
                    path = save(state, cfg, ident)
                if stop.signal:
                    interrupted = stop.signal
                    print(
                        f"finetune: stopped by {stop.signal} at step {state.step}; checkpoint saved to {path}. "
                        "Rerun the same command to continue",
                        flush=True,
                    )
                    break
    except SecondInterrupt:
        raise abandoned(state.step, list_checkpoints(ckpt_root)) from None
    bar.close()
    if interrupted is None:
        save_adapter(model, out / "adapter", cfg.base_model)
        print(f"adapter written to {out / 'adapter'}", flush=True)
    return FinetuneResult(final=last, data=rep, interrupted=interrupted)
