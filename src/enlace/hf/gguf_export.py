"""Our Llama -> a GGUF file with the `gguf` package's writer, in llama.cpp's conventions.

Tensors get llama.cpp's names and layout, and the architecture its own keys, from the architecture's
module (hf/arch/). Weight matrices are stored as f32, f16, bf16 or Q8_0; norms stay f32, as
llama.cpp's converter keeps them. The vocabulary goes in as llama.cpp's sentencepiece ("llama") type when the
folder or run has our tokenizer.model or is Gemma 3 (its pieces rebuilt by gguf_gemma), as its byte-level
BPE ("gpt2") type for GPT-2-style tokenizer.json files (SmolLM2), and as 256 byte tokens for the byte-level
smoke model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.model import ModelConfig
from ..errors import GGUFExportError
from ..io import fsync_file
from ..manifest import recorded_provenance, sidecar, verify_manifest, write_file_manifest
from ..model import Llama
from . import sp_convert
from .arch import for_config
from .arch.common import Arch

FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE values
Q8_BLOCK = 32  # Q8_0 quantizes rows in blocks of 32 weights (one fp16 scale each)
PRE_TOKENIZER_DIGITS = "smollm"  # llama.cpp's name for GPT-2 regex after splitting digits one by one
# llama.cpp's name for the plain GPT-2 regex; it refuses the file ("unknown pre-tokenizer type") for "gpt2"
PRE_TOKENIZER_GPT2 = "gpt-2"


def gguf_arch(cfg: ModelConfig) -> Arch:
    """The architecture llama.cpp runs cfg as, or refuse what its graph would compute differently."""
    arch = for_config(cfg)
    if cfg.mlp_act == "relu2":
        raise GGUFExportError(
            f"model {cfg.name}: mlp_act relu2; llama.cpp's {arch.name} graph computes SwiGLU"
        )
    return arch


def spm_vocab(model_file: Path) -> dict[str, Any]:
    """llama.cpp's "llama" vocabulary: pieces, scores and types straight from our tokenizer.model."""
    m = sp_convert.read_model(model_file)
    if m.model_type != "bpe":
        # llama.cpp's sentencepiece tokenizer merges pieces by score, which is sentencepiece's BPE.
        print(f"note: {model_file} is {m.model_type}; llama.cpp tokenizes text as BPE (pass token ids)")
    # Our chat markers are sentencepiece user-defined symbols; llama.cpp expects control tokens for them
    # (it warns "control-looking token ... probably a bug in the model" and overrides <|im_end|>), so the
    # file says control, and lists the pieces so that our importer restores them as user-defined.
    marked = [p for p, _, t in m.pieces if t == sp_convert.USER_DEFINED and p in sp_convert.CHAT_MARKERS]
    return {
        "model": "llama",
        "tokens": [p for p, _, _ in m.pieces],
        "scores": [s for _, s, _ in m.pieces],
        "types": [sp_convert.CONTROL if p in marked else t for p, _, t in m.pieces],
        "user_defined": marked,
        "unk": m.ids_of(sp_convert.UNKNOWN)[0],
        "split_digits": bool(m.trainer.get("split_digits", 0)),
        "type": m.model_type,
    }


def byte_vocab() -> dict[str, Any]:
    return {
        "model": "llama",
        "tokens": [f"<0x{i:02X}>" for i in range(256)],
        "scores": [0.0] * 256,
        "types": [sp_convert.BYTE] * 256,
    }


def gpt2_vocab(folder: Path) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json (GPT-2 style, as SmolLM2's) as llama.cpp's "gpt2" vocabulary."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise GGUFExportError(
            f"{folder}/tokenizer.json: neither our sentencepiece tokenizer (no tokenizer.model) nor a "
            "byte-level BPE; cannot write its vocabulary as GGUF"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [
        (sp_convert.CONTROL if added[t].get("special") else sp_convert.USER_DEFINED) if t in added else 1
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    digits = "Digits" in json.dumps(data.get("pre_tokenizer"))
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges,
            "pre": PRE_TOKENIZER_DIGITS if digits else PRE_TOKENIZER_GPT2}  # fmt: skip


def _add_model_keys(w: Any, cfg: Any, ftype: str, name: str) -> None:
    """The architecture's hyperparameters and the file type."""
    w.add_name(name)
    w.add_context_length(cfg.seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(FILE_TYPES[ftype])


def _add_tokenizer(
    w: Any, cfg: Any, arch: Arch, vocab: dict[str, Any], special: dict[str, Any], chat_template: str | None
) -> None:
    """The vocabulary, the tokenizer's settings, the special token ids and the chat template."""
    w.add_tokenizer_model(vocab["model"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
        w.add_tokenizer_pre(vocab["pre"])
    # The architecture's own keys go here, where they have always been written (the file's bytes stay).
    arch.write_gguf_keys(w, cfg)
    if "add_space_prefix" in vocab:  # a vocabulary that states its own settings (Gemma's)
        w.add_tokenizer_pre(vocab["pre"])
        w.add_add_space_prefix(vocab["add_space_prefix"])
        if vocab.get("eot") is not None:
            w.add_eot_token_id(int(vocab["eot"]))  # a chat turn ends here (llama.cpp's end of generation)
    elif vocab["model"] == "llama":
        w.add_add_space_prefix(True)
        # What our importer needs to rebuild the exact sentencepiece pipeline (llama.cpp ignores them).
        w.add_bool("enlace.tokenizer.split_digits", bool(vocab.get("split_digits", False)))
        w.add_string("enlace.tokenizer.type", vocab.get("type", "bpe"))
        if vocab.get("user_defined"):
            w.add_array("enlace.tokenizer.user_defined", list(vocab["user_defined"]))
    for key, fn in (
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("pad", w.add_pad_token_id),
    ):
        if special.get(key) is not None:
            fn(int(special[key]))
    if vocab.get("unk") is not None:
        w.add_unk_token_id(int(vocab["unk"]))
    w.add_add_bos_token(bool(special.get("add_bos", special.get("bos") is not None)))
    w.add_add_eos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)


def _add_tensors(w: Any, arch: Arch, model: Llama, ftype: str) -> None:
    """The weights under llama.cpp's names, in the file type (norms and other vectors stay f32)."""
    import gguf

    for gname, t in arch.to_gguf(model.cfg, model.state_dict()).items():
        t = t.detach().cpu().float()
        if t.dim() == 1 or ftype == "f32":
            arr = t.numpy()
            w.add_tensor(gname, arr)
        elif ftype == "f16" or (ftype == "q8_0" and t.shape[-1] % Q8_BLOCK):
            # A row that is no whole number of Q8_0 blocks stays f16, as llama.cpp's converter does.
            w.add_tensor(gname, t.to(torch.float16).numpy())
        elif ftype == "q8_0":  # the gguf package's Q8_0, llama.cpp's reference rounding
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(t.numpy(), q8), raw_dtype=q8)
        else:  # bf16: numpy has no bfloat16, so the raw bits go in with their type
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(gname, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def write_gguf(
    model: Llama,
    path: Path,
    vocab: dict[str, Any],
    special: dict[str, Any],
    chat_template: str | None = None,
    ftype: str = "f16",
    name: str = "enlace",
) -> Path:
    """Write path atomically (a temporary file renamed into place once complete)."""
    import gguf

    if ftype not in FILE_TYPES:
        raise GGUFExportError(f"--gguf-type {ftype!r}: choose one of {sorted(FILE_TYPES)}")
    cfg = model.cfg
    if len(vocab["tokens"]) != cfg.vocab_size:
        raise GGUFExportError(f"tokenizer has {len(vocab['tokens'])} tokens, the model {cfg.vocab_size}")
    arch = gguf_arch(cfg)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch.name)
    try:
        _add_model_keys(w, cfg, ftype, name)
        _add_tokenizer(w, cfg, arch, vocab, special, chat_template)
        _add_tensors(w, arch, model, ftype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def export_folder_gguf(folder: Path, path: Path, ftype: str = "f16", model: Llama | None = None) -> Path:
    """A Hugging Face folder written by `enlace export` (or any byte-level-BPE Llama folder) as GGUF, with
    its sidecar manifest (`<path>.manifest.json`: the type and the folder it came from)."""
    folder = Path(folder)
    verify_manifest(
        folder, ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"]
    )
    sidecar(path).unlink(missing_ok=True)  # the old file's manifest must not vouch for the new file
    path = _folder_gguf(folder, path, ftype, model)
    recorded = recorded_provenance(folder)
    source = {"ftype": ftype, "source_folder": str(folder), "source_fingerprint": recorded.get("fingerprint")}
    write_file_manifest(path, "gguf", {**source, "config_hash": recorded.get("config_hash")})
    return path


def _folder_gguf(folder: Path, path: Path, ftype: str, model: Llama | None) -> Path:
    from .folder import load_hf_folder, read_config

    model = model if model is not None else load_hf_folder(folder)
    tok_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    arch = gguf_arch(model.cfg)
    if arch.gguf_vocab is not None:
        vocab = arch.gguf_vocab(folder)
    elif (folder / "tokenizer.model").exists():
        vocab = spm_vocab(folder / "tokenizer.model")
    elif (
        model.cfg.vocab_size == 256
        and not tok_json.get("added_tokens")
        and tok_json["model"].get("byte_fallback")
    ):
        vocab = byte_vocab()
    else:
        vocab = gpt2_vocab(folder)
    hf = read_config(folder)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    special = {
        "bos": gen.get("bos_token_id", hf.get("bos_token_id")),
        "eos": eos[0]
        if isinstance(eos, list)
        else eos,  # GGUF holds one eos; the chat end is in the template
        "pad": gen.get("pad_token_id", hf.get("pad_token_id")),
    }
    from tokenizers import Tokenizer

    # llama.cpp adds BOS only if told to: tell it exactly when the folder's tokenizer does.
    first = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("a").ids[:1]
    special["add_bos"] = special["bos"] is not None and first == [special["bos"]]
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    template = tc.get("chat_template")
    return write_gguf(
        model, path, vocab, special, template if isinstance(template, str) else None, ftype, folder.name
    )
