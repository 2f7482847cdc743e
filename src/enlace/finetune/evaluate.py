"""`enlace finetune-eval`: held-out assistant-only loss without and with the adapter, and sample answers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config.finetune import FinetuneConfig
from ..config.hardware import HardwareConfig
from ..errors import EnlaceError
from ..io import atomic_write_json
from ..runtime import setup_runtime
from .data import Dataset, collate, load_dataset
from .hf import load_hf_folder
from .lora import load_adapter, set_merged
from .loss import assistant_loss_sum
from .tokenizer import HFTokenizer


@torch.no_grad()
def heldout_loss(model, data: Dataset, pad_id: int, batch: int = 4) -> float:
    """Mean cross-entropy per assistant token (every token weighs the same)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data.examples), batch):
        b = collate(data.examples[i : i + batch], pad_id)
        s, n = assistant_loss_sum(model, b["input_ids"], b["labels"])
        total, count = total + float(s), count + n
    return total / max(count, 1)


def answer(model, tok: HFTokenizer, prompt: str, cfg: FinetuneConfig) -> str:
    from ..generate import generate

    msgs = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    g = cfg.generation
    ids = list(
        generate(
            model,
            tok.apply_chat_template(msgs, add_generation_prompt=True),
            g.max_new_tokens,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            seed=g.seed,
            eos_ids=tok.eos_ids,
        )
    )
    return tok.decode(ids, skip_special_tokens=True).strip()


def finetune_eval(cfg: FinetuneConfig, hw: HardwareConfig, adapter: Path | None = None) -> dict:
    setup_runtime(hw)
    adapter = Path(adapter or Path(cfg.out) / "adapter")
    if not (adapter / "adapter_config.json").exists():
        raise EnlaceError(f"{adapter}: no adapter; run `enlace finetune` first")
    tok = HFTokenizer(Path(cfg.base_model))
    model = load_hf_folder(Path(cfg.base_model))
    val = load_dataset(tok, Path(cfg.val_data), cfg.format, cfg.max_len, None, cfg.system_prompt)
    before = heldout_loss(model, val, tok.pad_id)
    answers_before = [answer(model, tok, p, cfg) for p in cfg.eval_prompts]
    load_adapter(model, adapter, cfg.base_model)
    after = heldout_loss(model, val, tok.pad_id)
    set_merged(model, True)  # same outputs, one matmul per projection while generating
    answers_after = [answer(model, tok, p, cfg) for p in cfg.eval_prompts]
    result = {
        "base_model": cfg.base_model,
        "adapter": str(adapter),
        "val_data": cfg.val_data,
        "val": val.report(),
        "loss_before": round(before, 5),
        "loss_after": round(after, 5),
        "ppl_before": round(math.exp(before), 3),
        "ppl_after": round(math.exp(after), 3),
        "improvement": round(before - after, 5),
        "answers": [
            {"prompt": p, "base": a, "finetuned": b}
            for p, a, b in zip(cfg.eval_prompts, answers_before, answers_after, strict=True)
        ],
    }
    atomic_write_json(Path(cfg.out) / "eval.json", result)
    return result
