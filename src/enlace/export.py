"""`enlace export`: a training run (or a base folder plus a LoRA adapter, merged) as a Hugging Face folder.

The folder holds config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json (with a ChatML template when the vocabulary has our chat markers). QK-norm on means
Qwen3ForCausalLM (transformers' Llama has no per-head q/k RMSNorm), off means LlamaForCausalLM. The folder
is written aside and reloaded before it replaces the old one, so a reader never sees a partial export.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import paths
from .config.resolve import stable_hash
from .errors import EnlaceError
from .hf import sp_convert
from .hf.arch import for_config
from .hf.folder import WEIGHTS, save_hf_folder, write_model_manifest
from .hf.gguf_import import LICENCE_FILES
from .hf.tokenizer import FILES as TOKENIZER_READS
from .io import atomic_dir, atomic_write_json, sha256_file
from .load import check_model_folder, load_model, load_trained_model
from .manifest import recorded_provenance, verify_manifest
from .model import Llama

DEFAULT_OUT = paths.RUNS / "export" / "hf"
# Our shards put </s> after every document, so a text the model continues starts right after one: the
# exported tokenizer adds it in front, as `enlace generate` does, and calls it the BOS token.
DOC_SEPARATOR = "</s>"
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ExportError(EnlaceError):
    """The run cannot be exported as asked."""


@dataclass
class TokenizerBundle:
    """A `tokenizers.Tokenizer` and what config.json / tokenizer_config.json say about its tokens."""

    tok: Any
    config: dict[str, Any]
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    pad_id: int | None = None
    note: str = ""
    # Copied beside tokenizer.json: our tokenizer.model, whose pieces and scores the GGUF export needs.
    extra_files: list[Path] = field(default_factory=list)


def architecture(model_cfg) -> str:
    arch = for_config(model_cfg)
    return f"{arch.hf_architecture} ({arch.summary})"


def byte_bundle(seq_len: int) -> TokenizerBundle:
    tok = sp_convert.byte_tokenizer()
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": seq_len,
    }
    return TokenizerBundle(tok, cfg, note="byte-level: id i is byte i, no special tokens")


def sentencepiece_bundle(tokenizer_dir: Path, seq_len: int, val_texts: list[str]) -> TokenizerBundle:
    """tokenizer.json from `enlace tokenize` when it wrote one (checked there on the val split), else
    converted and checked now."""
    from tokenizers import Tokenizer, processors

    model_file = Path(tokenizer_dir) / "tokenizer.model"
    if not model_file.exists():
        raise ExportError(f"{model_file}: not found; run `enlace tokenize` (the run's tokenizer) first")
    verify_manifest(Path(tokenizer_dir), ["tokenizer.model", "tokenizer.json"])
    saved = Path(tokenizer_dir) / "tokenizer.json"
    if saved.exists():
        tok = Tokenizer.from_file(str(saved))
        checked = sp_convert.verify(model_file, tok, [])  # edge cases again: cheap, catches a stale file
        note = f"tokenizer.json from {tokenizer_dir} (checked at tokenize time)"
    else:
        tok = sp_convert.build(model_file)
        checked = sp_convert.verify(model_file, tok, val_texts)
        note = f"converted now, ids equal sentencepiece on {checked['texts']} texts"
    vocab = tok.get_vocab(with_added_tokens=True)
    sep = vocab[DOC_SEPARATOR]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{DOC_SEPARATOR} $A",
        pair=f"{DOC_SEPARATOR} $A {DOC_SEPARATOR} $B",
        special_tokens=[(DOC_SEPARATOR, sep)],
    )
    chat = all(m in vocab for m in sp_convert.CHAT_MARKERS)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": DOC_SEPARATOR,
        "eos_token": DOC_SEPARATOR,
        "unk_token": "<unk>",
        "pad_token": "<pad>" if "<pad>" in vocab else DOC_SEPARATOR,
        "clean_up_tokenization_spaces": False,
        "model_max_length": seq_len,
    }
    eos = [sep]
    if chat:
        cfg["chat_template"] = CHATML
        eos.append(vocab["<|im_end|>"])  # a chat answer ends with <|im_end|>
    return TokenizerBundle(tok, cfg, sep, eos, vocab.get(cfg["pad_token"]), note)


def check_run_tokenizer(meta: dict[str, Any], tokenizer_dir: Path, shards: Path) -> None:
    """Refuse a tokenizer that provably is not the one the run's shards were made with."""
    manifest = Path(shards) / "manifest.json"
    model_file = Path(tokenizer_dir) / "tokenizer.model"
    if not manifest.exists() or not model_file.exists():
        return
    if sha256_file(manifest) != meta.get("data_fingerprint"):
        return  # the shards changed since the run: nothing to compare against
    recorded = json.loads(manifest.read_text(encoding="utf-8")).get("tokenizer_sha256")
    if recorded and recorded != sha256_file(model_file):
        raise ExportError(
            f"{model_file}: not the tokenizer the run's shards were encoded with ({manifest} records "
            f"sha256 {recorded[:12]}...); restore it or retrain"
        )


def write_folder(
    model: Llama, bundle: TokenizerBundle, out: Path, provenance: dict[str, Any] | None = None
) -> Path:
    """Write the folder aside (manifest.json last, with `provenance`), reload it and compare logits, then
    swap it in."""
    cfg = model.cfg
    with atomic_dir(Path(out)) as tmp:
        save_hf_folder(model, tmp, None, bundle.bos_id, bundle.eos_ids or None, bundle.pad_id, manifest=False)
        bundle.tok.save(str(tmp / "tokenizer.json"))
        atomic_write_json(tmp / "tokenizer_config.json", bundle.config)
        for f in bundle.extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        if bundle.tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
            raise ExportError(
                f"tokenizer has {bundle.tok.get_vocab_size(with_added_tokens=True)} tokens, the model "
                f"{cfg.vocab_size}; not the run's tokenizer"
            )
        write_model_manifest(tmp, "hf-model", provenance)
        reloaded = load_model(tmp, flag="export").model  # as every command will open it (manifest checked)
        ids = torch.arange(min(cfg.seq_len, 16)).unsqueeze(0) % cfg.vocab_size
        with torch.no_grad():
            same = torch.equal(reloaded(ids).logits, model.eval()(ids).logits)
        if not same:
            raise ExportError(f"{tmp / WEIGHTS}: reloaded logits differ from the run's; export aborted")
    return Path(out)


def run_bundle(
    meta: dict[str, Any],
    seq_len: int,
    tokenizer_dir: Path = paths.TOKENIZER,
    corpus: Path = paths.CORPUS,
    shards: Path = paths.SHARDS,
) -> TokenizerBundle:
    """The tokenizer a pretraining run (its checkpoint's `meta`) is exported with."""
    if meta["config"]["train"]["loader"] == "bytes":
        return byte_bundle(seq_len)
    check_run_tokenizer(meta, tokenizer_dir, shards)
    val = Path(corpus) / "val.jsonl"
    texts = [json.loads(line)["text"] for line in val.open(encoding="utf-8")] if val.exists() else []
    bundle = sentencepiece_bundle(tokenizer_dir, seq_len, texts)
    bundle.extra_files.append(Path(tokenizer_dir) / "tokenizer.model")
    return bundle


def export_run(
    run_dir: Path = paths.RUNS / "pretrain",
    out: Path = DEFAULT_OUT,
    tokenizer_dir: Path = paths.TOKENIZER,
    corpus: Path = paths.CORPUS,
    shards: Path = paths.SHARDS,
) -> dict[str, Any]:
    """The newest complete checkpoint of run_dir as a Hugging Face folder at out."""
    if not Path(run_dir).is_dir():
        raise ExportError(f"--run-dir {run_dir}: no such folder")
    model, meta, ckpt = load_trained_model(Path(run_dir))
    model = model.float()
    cfg = model.cfg
    bundle = run_bundle(meta, cfg.seq_len, tokenizer_dir, corpus, shards)
    info = {"source": "run", "checkpoint": str(ckpt), "step": meta["step"]}
    write_folder(model, bundle, out, {**info, "config_hash": stable_hash(meta["config"])})
    return {
        "folder": str(out),
        "checkpoint": str(ckpt),
        "step": meta["step"],
        "architecture": architecture(cfg),
        "tied_embeddings": cfg.tie_embeddings,
        "tokenizer": bundle.note,
    }


def folder_bundle(folder: Path) -> TokenizerBundle:
    """The tokenizer of an existing Hugging Face folder, carried over unchanged (merged LoRA export)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ExportError(f"{path}: not found (only fast tokenizers, tokenizer.json, are supported)")
    cfg_path, gen_path = folder / "tokenizer_config.json", folder / "generation_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}
    eos = gen.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return TokenizerBundle(
        Tokenizer.from_file(str(path)), cfg, gen.get("bos_token_id"), eos_ids, gen.get("pad_token_id"),
        note=f"tokenizer of {folder}",
    )  # fmt: skip


def export_merged(base: Path, adapter: Path, out: Path) -> dict[str, Any]:
    """base + adapter with B A folded into each target weight, written as a plain Hugging Face folder.

    LoRA targets are attention and MLP projections only, so a tied embedding/head pair is never touched
    (merging into a tied lm_head would silently change the input embedding too: PEFT #2018).
    """
    from .lora import merge_and_unload

    base = check_model_folder(Path(base))
    if not Path(adapter).is_dir():
        raise ExportError(f"--adapter {adapter}: no such folder")
    # Opened as every command opens a model (B A already folded in), then unwrapped into plain Linears.
    model = merge_and_unload(load_model(base, adapter).model)
    if model.cfg.tie_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise ExportError("merging untied the embeddings; export aborted")
    # Everything carried over from the base, checked against its manifest (the weights were, as loaded).
    verify_manifest(base, [*TOKENIZER_READS, "tokenizer.model", *LICENCE_FILES])
    bundle = folder_bundle(base)
    if (base / "tokenizer.model").exists():
        bundle.extra_files.append(base / "tokenizer.model")
    # Weights derived from a licensed base (Gemma's terms) carry its licence files with them.
    bundle.extra_files += [base / name for name in LICENCE_FILES if (base / name).exists()]
    info = {
        "source": "merged",
        "base": str(base),
        "base_fingerprint": recorded_provenance(base).get("fingerprint"),
        "adapter": str(adapter),
        "config_hash": recorded_provenance(Path(adapter)).get("config_hash"),
    }
    write_folder(model, bundle, out, info)
    return {
        "folder": str(out),
        "base": str(base),
        "adapter": str(adapter),
        "architecture": architecture(model.cfg),
        "tied_embeddings": model.cfg.tie_embeddings,
        "tokenizer": bundle.note,
        "model": model,
    }
