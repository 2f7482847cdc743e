"""Checks that span fields or layers. Each names the file that set the offending field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:  # for annotations only
    from .layers import Config

DTYPE_MAX_VOCAB = {"uint16": 65536, "uint32": 2**32}


def _fail(cfg: Config, key: str, message: str) -> ConfigError:
    return ConfigError(cfg.provenance.get(key, cfg.files.get(key.split(".")[0], "config")), key, message)


def check_model(cfg: Config) -> None:
    m = cfg.layers["model"]
    if m.attn_head_dim is None and m.d_model % m.n_head:
        raise _fail(cfg, "model.n_head", f"d_model {m.d_model} is not divisible by n_head {m.n_head}")
    if m.n_head % m.n_kv_head:
        raise _fail(
            cfg,
            "model.n_kv_head",
            f"n_head {m.n_head} is not divisible by n_kv_head {m.n_kv_head} (GQA groups)",
        )
    if m.head_dim % 2:
        raise _fail(
            cfg,
            "model.n_head",
            f"head_dim d_model/n_head = {m.head_dim} is odd; RoPE rotates pairs and needs it even",
        )


def check_train(cfg: Config) -> None:
    t = cfg.layers["train"]
    s = t.schedule
    if s.decay_steps is not None and s.warmup_steps + s.decay_steps > t.max_steps:
        raise _fail(
            cfg,
            "train.schedule.decay_steps",
            f"warmup_steps ({s.warmup_steps}) + decay_steps ({s.decay_steps}) = {s.warmup_steps + s.decay_steps} "
            f"exceeds max_steps ({t.max_steps})",
        )


def check_hardware(cfg: Config) -> None:
    h = cfg.layers["hardware"]
    if h.dtype == "fp16" and not h.loss_scaler:
        raise _fail(
            cfg,
            "hardware.loss_scaler",
            "dtype fp16 needs a loss scaler (loss_scaler: true); fp16 gradients underflow without one",
        )
    if h.dtype == "fp16" and h.device == "cpu":
        raise _fail(cfg, "hardware.dtype", "fp16 training is for CUDA devices; use fp32 or bf16 on cpu")
    if h.dtype == "bf16" and h.device == "cuda":
        cc = h.min_compute_capability
        if cc is None or tuple(cc) < (8, 0):
            raise _fail(
                cfg,
                "hardware.dtype",
                f"bf16 needs compute capability >= 8.0 (Ampere or newer); this profile allows {cc}. Use fp16 with a loss scaler",
            )
    if h.loss_scaler and h.dtype != "fp16":
        raise _fail(cfg, "hardware.loss_scaler", f"a loss scaler is only for fp16, not {h.dtype}")
    if h.sdpa_backend == "flash" and h.device == "cuda" and (h.min_compute_capability or (0, 0)) < (8, 0):
        raise _fail(
            cfg,
            "hardware.sdpa_backend",
            "the flash SDPA backend needs compute capability >= 8.0; use 'efficient'",
        )


def check_data_vs_model(cfg: Config) -> None:
    m, t, d = cfg.layers["model"], cfg.layers["train"], cfg.layers["data"]
    if t.loader == "bytes":
        if m.vocab_size != 256:
            raise _fail(
                cfg,
                "model.vocab_size",
                f"the byte loader yields 256 symbols, but vocab_size is {m.vocab_size}",
            )
        return
    dtype = d.shard_dtype
    if d.tokenizer.vocab_size > DTYPE_MAX_VOCAB[dtype]:
        raise _fail(
            cfg,
            "data.shard.dtype",
            f"vocab_size {d.tokenizer.vocab_size} does not fit {dtype} token ids (at most {DTYPE_MAX_VOCAB[dtype]}); use uint32 or auto",
        )
    if d.tokenizer.vocab_size != m.vocab_size:
        raise _fail(
            cfg,
            "data.tokenizer.vocab_size",
            f"tokenizer vocab {d.tokenizer.vocab_size} differs from model vocab_size {m.vocab_size}; they must be equal",
        )


def cross_layer_checks(cfg: Config) -> None:
    names = set(cfg.layers)
    if "model" in names:
        check_model(cfg)
    if "train" in names:
        check_train(cfg)
    if "hardware" in names:
        check_hardware(cfg)
    if {"model", "train", "data"} <= names:
        check_data_vs_model(cfg)
