"""The eval stage: validation loss, perplexity, bits per byte, throughput and sampled continuations.

Bits per byte divides the validation cross-entropy (in bits) by the UTF-8 bytes the tokens stand for, so a
byte-level model and a sentencepiece model of any vocabulary land on the same scale.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import Config, ModelConfig
from ..errors import CheckpointError
from ..generate import generate
from ..io import atomic_write_json
from ..model import Llama
from ..runtime import autocast, check_device, sdpa_backend, setup_runtime
from ..text import codec_for, continuation


def load_trained_model(
    run_dir: Path, device: torch.device | str = "cpu"
) -> tuple[Llama, dict[str, Any], Path]:
    """The newest complete checkpoint of a run, as an eval-mode model built from the config it saved."""
    from ..train.checkpoint import latest_checkpoint
    from ..train.step import load_model_tensors

    root = Path(run_dir) / "checkpoints"
    found = latest_checkpoint(root, device=device)
    if found is None:
        raise CheckpointError(
            f"{root}: no complete checkpoint; run `enlace pretrain` (or `dvc repro pretrain`) first"
        )
    path, tensors, meta = found
    model = Llama(ModelConfig.model_validate(meta["config"]["model"]))
    load_model_tensors(model, tensors["model"])
    return model.to(device).eval(), meta, path


@torch.no_grad()
def validation_metrics(model: Llama, cfg: Config, batches: int, device: torch.device) -> dict[str, float]:
    from ..data.loaders import make_loader

    loader = make_loader(cfg, "val")
    nats, tokens, seconds = 0.0, 0, 0.0
    for x, y in loader.val_batches(batches):
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        with autocast(cfg.hardware), sdpa_backend(cfg.hardware):
            out = model(x, targets=y)
        seconds += time.perf_counter() - t0
        nats += out.ce.item() * y.numel()
        tokens += y.numel()
    if tokens == 0:
        raise CheckpointError("the validation split yielded no batches; is data/ built?")
    loss = nats / tokens
    return {
        "val_loss": round(loss, 6),
        "val_ppl": round(math.exp(loss), 4),
        "val_bpb": round(loss / math.log(2) / loader.bytes_per_token, 6),
        "val_tokens": tokens,
        "eval_tokens_per_s": round(tokens / seconds, 1),
    }


def sample_prompts(model: Llama, cfg: Config, device: torch.device) -> tuple[list[dict[str, str]], float]:
    """Continue each fixed prompt; returns the samples and generation tokens/s (KV cache)."""
    codec = codec_for(cfg.train.loader, paths.TOKENIZER)
    g = cfg.eval.generation
    samples, new_tokens, seconds = [], 0, 0.0
    for i, prompt in enumerate(cfg.eval.prompts):
        t0 = time.perf_counter()
        prompt_ids = codec.encode(prompt)
        ids = list(
            generate(
                model,
                prompt_ids,
                g.max_new_tokens,
                temperature=g.temperature,
                top_k=g.top_k,
                top_p=g.top_p,
                repetition_penalty=g.repetition_penalty,
                no_repeat_ngram=g.no_repeat_ngram,
                seed=g.seed + i,
                eos_ids=codec.eos_ids,
                device=device,
            )
        )
        seconds += time.perf_counter() - t0
        new_tokens += len(ids)
        samples.append({"prompt": prompt, "continuation": continuation(codec, prompt_ids, ids)})
    return samples, round(new_tokens / max(seconds, 1e-9), 1)


def run_eval(
    cfg: Config, run_dir: Path = paths.RUNS / "pretrain", out_dir: Path = paths.RUNS / "eval"
) -> dict[str, Any]:
    check_device(cfg.hardware, cfg.files.get("hardware", "hardware"))
    device = setup_runtime(cfg.hardware)
    model, meta, ckpt = load_trained_model(run_dir, device)
    saved = meta["config"]
    for section in ("model", "data"):
        if saved.get(section) != cfg.to_dict()[section]:
            raise CheckpointError(
                f"{ckpt}: trained with a different {section} config than the one selected now; "
                f"select the run's config (see {ckpt}/meta.json) or retrain"
            )
    metrics: dict[str, Any] = {
        "checkpoint": ckpt.name,
        "step": meta["step"],
        "parameters": model.num_parameters(),
        "config_hash": cfg.hash,  # eval's own config; the checkpoint's meta.json holds the run's
    }
    metrics.update(validation_metrics(model, cfg, cfg.eval.batches, device))
    samples, gen_tps = sample_prompts(model, cfg, device)
    metrics["generate_tokens_per_s"] = gen_tps
    smoke = paths.RUNS / "smoke" / "metrics.json"
    if smoke.exists():
        # The byte-level smoke model on the same val text: the baseline bits per byte must beat.
        metrics["smoke_val_bpb"] = json.loads(smoke.read_text()).get("val_bpb")

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "metrics.json", metrics)
    g = cfg.eval.generation
    lines = [
        f"# Samples from `{ckpt}` (step {meta['step']})",
        "",
        f"Each prompt (params.yaml `eval.prompts`) continued by that checkpoint: temperature {g.temperature}, "
        f"top-k {g.top_k}, top-p {g.top_p}, repetition penalty {g.repetition_penalty}, no-repeat "
        f"{g.no_repeat_ngram}-gram, seed {g.seed} + prompt index, at most {g.max_new_tokens} new tokens.",
        "",
    ]
    for i, s in enumerate(samples, 1):
        lines += [f"## {i}. Prompt: «{s['prompt']}»", "", f"**{s['prompt']}**{s['continuation']}", ""]
    (out_dir / "samples.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot_run(run_dir, out_dir / "loss.png", metrics)
    return {"metrics": metrics, "samples": samples}


def _plot_run(run_dir: Path, png: Path, metrics: dict[str, Any]) -> None:
    from ..train.metrics import plot_loss, read_jsonl

    log = Path(run_dir) / "metrics.jsonl"
    if log.exists():
        plot_loss(
            read_jsonl(log),
            png,
            title=f"pretrain: val loss {metrics['val_loss']:.3f}, {metrics['val_bpb']:.3f} bits/byte",
        )
