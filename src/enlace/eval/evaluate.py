"""The eval stage: validation loss, perplexity, bits per byte, the prose yardstick, throughput, samples.

Bits per byte divides the cross-entropy (in bits) of the scored tokens by the exact UTF-8 bytes those tokens
stand for, so a byte-level model and a sentencepiece or BPE model of any vocabulary land on the same
scale. The prose yardstick (eval.prose, everyday Spanish never used in training) is one text every model
scores in full: the run, the byte-level smoke model and SmolLM2-135M-Instruct (on its own tokenizer).
A second text (eval.prose_new) is scored the same way as its own document (prose_new_*), and the two
together as prose_all_*: total bits over total bytes, so each byte of either text weighs the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import paths
from ..config import Config
from ..config.resolve import LAYERS, build_config
from ..errors import CheckpointError, EnlaceError
from ..generate import generate
from ..io import atomic_write_json
from ..load import load_model
from ..load.run import no_checkpoint
from ..model import Llama
from ..runtime import check_device, setup_runtime
from ..scoring.score import evaluate, precision, sliding_windows
from ..scoring.token_bytes import TokenBytes
from ..text import codec_for, continuation


@dataclass
class Scorer:
    """A model with what scoring text needs: its tokenizer as ids and the bytes each token stands for."""

    name: str
    model: torch.nn.Module
    encode: Callable[[str], list[int]]  # one document, after a one-token separator that is context only
    token_bytes: TokenBytes
    config: Config | None = None  # our runs: the config they were trained with (val split, batch size)
    meta: dict[str, Any] | None = None  # our runs: the checkpoint's meta.json


def load_scorer(model_dir: Path, hw: Any, device: torch.device, flag: str = "--model-dir") -> Scorer:
    """Any model enlace.load opens: our run folder (its latest checkpoint), a Hugging Face folder (e.g. the
    imported SmolLM2), a GGUF file."""
    loaded = load_model(model_dir, device=device, flag=flag)
    model = loaded.model
    if loaded.tokenizer is not None:
        tok = loaded.tokenizer
        # The document separator of its pretraining where the vocabulary has one, else bos or eos.
        sep = next(i for i in (tok.token_id("<|endoftext|>"), tok.bos_id, tok.eos_id, 0) if i is not None)
        return Scorer(
            str(model_dir),
            model,
            lambda t: [sep, *tok.encode(t, add_special_tokens=False)],
            TokenBytes.hugging_face(tok.folder / "tokenizer.json"),
        )
    meta, ckpt = loaded.meta, loaded.checkpoint
    saved = meta["config"]
    layers = {k: v for k, v in saved.items() if k in LAYERS and k != "hardware"}
    cfg = build_config({**layers, "hardware": hw})
    if cfg.train.loader == "bytes":
        # Documents are joined by blank lines in the byte stream: a text starts after a newline.
        encode = lambda t: [10, *t.encode("utf-8")]  # noqa: E731
        return Scorer(str(ckpt), model, encode, TokenBytes.raw_bytes(), cfg, meta)
    sp_file = paths.TOKENIZER / "tokenizer.model"
    # loaded.codec is this file's SentencePieceCodec: encode() starts with EOS, as documents do in the shards
    return Scorer(str(ckpt), model, loaded.codec.encode, TokenBytes.sentencepiece(sp_file), cfg, meta)


def validation_metrics(scorer: Scorer) -> dict[str, Any]:
    """val_* of one of our runs: the windows and batch size its trainer validated on, so the same weights
    give the value the trainer logged at the end."""
    from ..data.loaders import make_loader

    cfg = scorer.config
    windows = make_loader(cfg, "val").val_windows(cfg.train.eval_batches * cfg.train.micro_batch_size)
    t0 = time.perf_counter()
    r = evaluate(
        scorer.model,
        windows,
        batch_size=cfg.train.micro_batch_size,
        precision=lambda: precision(cfg.hardware),
    )
    seconds = time.perf_counter() - t0
    return {
        "val_loss": round(r["loss"], 6),
        "val_ppl": round(math.exp(r["loss"]), 4),
        "val_bpb": round(r["bpb"], 6),
        "val_tokens": r["tokens"],
        "val_bytes": r["bytes"],
        "eval_tokens_per_s": round(r["tokens"] / seconds, 1),
    }


def prose_metrics(
    scorer: Scorer, text: str, hw: Any, max_context: int, batch_size: int = 8, prefix: str = "prose"
) -> dict[str, Any]:
    """{prefix}_* on one long text: sliding windows of the model's context (at most max_context tokens),
    moved by half a window, so every scored token sees at least half a window before it. {prefix}_bits
    is unrounded, for sums over several texts (prose_all_metrics)."""
    context = min(scorer.model.cfg.seq_len, max_context)
    stride = max(1, context // 2)
    windows = sliding_windows(scorer.encode(text), context, stride, scorer.token_bytes)
    if windows.bytes != len(text.encode("utf-8")):
        raise EnlaceError(
            f"{scorer.name}: its tokens stand for {windows.bytes} bytes of a {len(text.encode())}-byte text; "
            "bits per byte would be off"
        )
    r = evaluate(scorer.model, windows, batch_size=batch_size, precision=lambda: precision(hw))
    return {
        f"{prefix}_loss": round(r["loss"], 6),
        f"{prefix}_bpb": round(r["bpb"], 6),
        f"{prefix}_bits": r["bpb"] * r["bytes"],
        f"{prefix}_tokens": r["tokens"],
        f"{prefix}_bytes": r["bytes"],
        f"{prefix}_context": context,
        f"{prefix}_stride": stride,
    }


def prose_all_metrics(parts: list[dict[str, Any]], prefixes: list[str]) -> dict[str, Any]:
    """prose_all_*: several texts' prose metrics as one yardstick, total bits over total bytes."""
    bits = sum(m[f"{p}_bits"] for m, p in zip(parts, prefixes, strict=True))
    n_bytes = sum(m[f"{p}_bytes"] for m, p in zip(parts, prefixes, strict=True))
    return {"prose_all_bpb": round(bits / n_bytes, 6), "prose_all_bytes": n_bytes}


@dataclass(frozen=True)
class Yardsticks:
    """The texts every model is scored on: eval.prose, and eval.prose_new unless it is off."""

    prose: str
    prose_new: str | None = None

    def metrics(self, scorer: Scorer, hw: Any, max_context: int) -> dict[str, Any]:
        """prose_* and, with a second text, prose_new_* and prose_all_*."""
        texts = {"prose": self.prose, "prose_new": self.prose_new}
        parts = {p: prose_metrics(scorer, t, hw, max_context, prefix=p) for p, t in texts.items() if t}
        out: dict[str, Any] = {}
        for p, m in parts.items():
            out.update({k: v for k, v in m.items() if k != f"{p}_bits"})  # unrounded: for the sum only
        if len(parts) > 1:
            out.update(prose_all_metrics(list(parts.values()), list(parts)))
        return out


def read_prose(path: Path, key: str = "eval.prose") -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EnlaceError(f"{path}: prose text not found ({key} in params.yaml)") from None
    except UnicodeDecodeError as e:
        raise EnlaceError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise EnlaceError(f"{path}: the prose text is empty")
    return text


def read_yardsticks(cfg: Config) -> Yardsticks:
    """eval.prose and eval.prose_new (when set), read and checked before any text is scored."""
    new = cfg.eval.prose_new
    return Yardsticks(
        read_prose(Path(cfg.eval.prose)), read_prose(Path(new), "eval.prose_new") if new else None
    )


def score_model_dir(
    model_dir: Path, cfg: Config, device: torch.device, prose: str | Yardsticks | None
) -> dict[str, Any]:
    """val_* (our runs) and prose_* (any model; prose_new_* and prose_all_* too when given Yardsticks with
    a second text) of one model folder: `enlace eval --model-dir DIR`."""
    scorer = load_scorer(model_dir, cfg.hardware, device)
    metrics: dict[str, Any] = {"model": scorer.name, "parameters": scorer.model.num_parameters()}
    if scorer.config is not None:
        metrics.update(validation_metrics(scorer))
    if prose is not None:
        texts = prose if isinstance(prose, Yardsticks) else Yardsticks(prose)
        metrics.update(texts.metrics(scorer, cfg.hardware, cfg.eval.prose_context))
    return metrics


# Models the eval stage scores next to the run, when present: the byte-level baseline and SmolLM2.
REFERENCES = {"smoke": paths.RUNS / "smoke", "smollm2": paths.SMOLLM2_DIR}
# What metrics.json keeps of each reference's prose scores (as {name}_{key}).
REFERENCE_PROSE_KEYS = ("prose_bpb", "prose_context", "prose_new_bpb", "prose_all_bpb")


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
    if not Path(run_dir).exists():
        raise no_checkpoint(run_dir)  # the run is not trained yet: say how to train it
    scorer = load_scorer(run_dir, cfg.hardware, device, flag="--run-dir")
    if scorer.meta is None:
        raise CheckpointError(f"{run_dir}: not one of our runs; score other models with --model-dir")
    model, ckpt, meta = scorer.model, Path(scorer.name), scorer.meta
    saved = meta["config"]
    for section in ("model", "data"):
        if saved.get(section) != cfg.to_dict()[section]:
            raise CheckpointError(
                f"{ckpt}: trained with a different {section} config than the one selected now; "
                f"select the run's config (see {ckpt}/meta.json) or retrain"
            )
    texts = read_yardsticks(cfg)
    metrics: dict[str, Any] = {
        "checkpoint": ckpt.name,
        "step": meta["step"],
        "parameters": model.num_parameters(),
        "config_hash": cfg.hash,  # eval's own config; the checkpoint's meta.json holds the run's
        "prose_file": str(cfg.eval.prose),
    }
    if texts.prose_new is not None:
        metrics["prose_new_file"] = str(cfg.eval.prose_new)
    metrics.update(validation_metrics(scorer))
    metrics.update(texts.metrics(scorer, cfg.hardware, cfg.eval.prose_context))
    samples, gen_tps = sample_prompts(model, cfg, device)
    metrics["generate_tokens_per_s"] = gen_tps
    for name, folder in REFERENCES.items():
        if (folder / "checkpoints").is_dir() or (folder / "config.json").exists():
            ref = score_model_dir(folder, cfg, device, texts)
            for key in ("val_bpb", "val_bytes", *REFERENCE_PROSE_KEYS):
                if key in ref:
                    metrics[f"{name}_{key}"] = ref[key]

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
