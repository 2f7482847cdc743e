"""The one way ENLACE opens a model: `load_model(path, adapter)` -> `Loaded`.

Any model ENLACE can use: one of our pretraining runs (its newest complete checkpoint and the codec of its
tokenizer), a Hugging Face folder (an import, an export), a LoRA run (its base with its adapter) or a GGUF
file (imported into a temporary folder by hf.gguf_import), plus an optional LoRA adapter merged in; or an
assistant spec (configs/assistant/*.yaml, load/preamble.py): a base folder aligned in context by a preamble.
`Loaded` carries the model with everything a front-end needs around it: encode and decode, the chat
template, stop ids, the context length, what was loaded in words, and the sampling defaults.
`enlace generate`, `chat`, `serve`, `eval`, `export`, `finetune` and finetune-eval open models here;
`bench-es` and `bench-bases` score with lm-eval and transformers, but take their paths from `locate`.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..config.extra import CHAT, CHAT_SAMPLING, GenerationConfig
from ..errors import HardwareError, ModelError
from ..hf.folder import load_hf_folder
from ..hf.tokenizer import HFTokenizer, Message, StreamDecoder
from ..model import Llama
from ..runtime import release_freed_memory
from ..text import ByteCodec, SentencePieceCodec
from .locate import ModelRef, base_of_lora_run, check_model_folder, locate
from .preamble import PreambleSpec, load_spec
from .run import RunStream, load_trained_model, run_codec

if TYPE_CHECKING:
    from ..generate import CopyTable

__all__ = [
    "Loaded",
    "TextStream",
    "ModelRef",
    "add_adapter",
    "base_of_lora_run",
    "check_model_folder",
    "load_model",
    "load_trained_model",
    "locate",
    "model_name",
]


class TextStream(Protocol):
    def push(self, token_id: int) -> str: ...


@dataclass
class Loaded:
    """A model ready to generate, and how text goes in and out of it."""

    model: Llama
    ref: ModelRef  # what was asked for: kind, path, adapter
    source: str  # what was loaded, in words (logs, /health)
    generation: GenerationConfig  # the sampling defaults for this model
    tokenizer: HFTokenizer | None = None  # Hugging Face folders and GGUF files
    codec: ByteCodec | SentencePieceCodec | None = None  # our runs
    meta: dict[str, Any] | None = None  # our runs: the checkpoint's meta.json
    checkpoint: Path | None = None  # our runs: the checkpoint loaded
    weights: str = "fp32"  # the decode weights the model now holds
    device: str = "cpu"
    # A GGUF file's imported folder (tokenizer.json for token bytes, say): deleted with this object.
    keep: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    # An assistant spec's preamble (load/preamble.py): it renders the chat, and its stop strings end an answer.
    preamble: PreambleSpec | None = None
    # Its example answers, copied at most `copy_guard` tokens in a row by every reply (None: no guard).
    copy: CopyTable | None = None

    @property
    def context(self) -> int:
        """The model's window in tokens: prompt plus completion must fit in it."""
        return self.model.cfg.seq_len

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_ids if self.tokenizer is not None else tuple(self.codec.eos_ids)

    @property
    def stops(self) -> tuple[str, ...]:
        """Strings that end an answer besides the end ids: a preamble's next turn."""
        return tuple(self.preamble.stop) if self.preamble is not None else ()

    @property
    def chat_sampling(self) -> dict[str, float | int]:
        """How a reply samples where the request sets nothing: CHAT's sampler, or what an assistant spec's
        `sampling:` sets instead (`enlace serve`, `enlace chat`)."""
        return self.preamble.sampling.over_chat() if self.preamble is not None else dict(CHAT_SAMPLING)

    @property
    def name(self) -> str:
        if self.preamble is not None:
            return self.preamble.name + adapter_suffix(self.ref.adapter, self.ref.adapter_scale)
        return model_name(self.ref.path, self.ref.adapter, self.ref.adapter_scale)

    @property
    def chat_template(self) -> Callable[[list[Message]], list[int]] | None:
        """Messages -> prompt ids ending where the assistant's reply begins; None without a chat template."""
        if self.preamble is not None:
            spec, tok = self.preamble, self.tokenizer
            return lambda messages: spec.encode(tok, messages)
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            return None
        tok = self.tokenizer
        return lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """A plain prompt's ids; an empty text is the start token alone where the model has one."""
        if self.tokenizer is None:
            return self.codec.encode(text)
        ids = self.tokenizer.encode(text)
        return ids or ([self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else [])

    def stream(self, prompt_ids: list[int]) -> TextStream:
        """A decoder of new tokens into text pieces, holding back a character split across tokens."""
        if self.tokenizer is not None:
            return StreamDecoder(self.tokenizer)
        return RunStream(self.codec, prompt_ids)

    def hf_tokenizer(self, why: str) -> HFTokenizer:
        """The Hugging Face tokenizer, or a one-line refusal naming the path and what needed it."""
        if self.tokenizer is None:
            raise ModelError(
                f"{self.ref.path}: a pretraining run has no Hugging Face tokenizer, which {why} needs; "
                f"export it first (`enlace export --run-dir {self.ref.path}`)"
            )
        return self.tokenizer


def model_name(path: Path, adapter: Path | None, scale: float = 1.0) -> str:
    """A model's id: the folder's (or GGUF file's) name, plus the adapter's run (runs/finetune/adapter ->
    "+finetune")."""
    path = Path(path).resolve()
    name = path.stem if path.suffix.lower() == ".gguf" else path.name
    return name + adapter_suffix(adapter, scale)


def adapter_suffix(adapter: Path | None, scale: float = 1.0) -> str:
    """ "+" and the adapter's run (runs/finetune/adapter -> "+finetune", scaled by 0.5: "+finetune@0.5");
    "" without one."""
    if adapter is None:
        return ""
    a = Path(adapter).resolve()
    return "+" + (a.parent.name if a.name == "adapter" else a.name) + (f"@{scale:g}" if scale != 1.0 else "")


def adapter_steps(adapter: Path) -> str:
    """ " (N steps)": how long the adapter trained, where its manifest records it (older ones do not)."""
    from ..manifest import recorded_provenance

    steps = recorded_provenance(Path(adapter)).get("steps")
    return f" ({steps} steps)" if isinstance(steps, int) else ""


def add_adapter(
    model: Llama, adapter: Path, base: str | Path, merge: bool = True, scale: float = 1.0
) -> Llama:
    """Load a LoRA adapter trained on `base` into the model (its delta times `scale`); merged: no extra
    matmuls per token."""
    from ..lora import load_adapter, set_merged

    load_adapter(model, Path(adapter), str(base), scale)
    if merge:
        set_merged(model, True)
    return model


def _open_hf(ref: ModelRef, folder: Path, device: str, source: str) -> Loaded:
    tok = HFTokenizer(folder)
    # Parsing Gemma 3's 33 MB tokenizer.json peaks 366 MiB above where it ends; what it freed is given
    # back before the weights are read, or it stays in the process's peak (and, with the runtime's
    # keep_freed_memory, in its memory) beside them: a served Gemma int8 peaked at 908 MiB, 678 after load.
    release_freed_memory()
    model = load_hf_folder(folder, device=device)
    if ref.adapter is not None:
        add_adapter(model, ref.adapter, folder, scale=ref.adapter_scale)
        scaled = f" scaled by {ref.adapter_scale:g}" if ref.adapter_scale != 1.0 else ""
        source += f" with the LoRA adapter {ref.adapter}" + adapter_steps(ref.adapter) + scaled
    generation = CHAT if tok.chat_template is not None else GenerationConfig()
    return Loaded(model.eval(), ref, source, generation, tokenizer=tok, device=str(device))


def _open_gguf(ref: ModelRef, device: str) -> Loaded:
    from ..hf.gguf_import import import_gguf

    # Imported aside, into a folder that lives as long as the Loaded: the model and its tokenizer are read
    # whole, but a scorer may still read the folder's tokenizer.json.
    tmp = tempfile.TemporaryDirectory(prefix="enlace-gguf-")
    folder = import_gguf(ref.path, Path(tmp.name) / ref.path.stem)
    loaded = _open_hf(ref, folder, device, f"{ref.path} (imported from GGUF)")
    loaded.keep = tmp
    return loaded


def _open_preamble(ref: ModelRef, device: str) -> Loaded:
    """The spec's base folder, with the spec rendering every chat; plus an adapter when one is given (trained
    in the spec's format: finetune.preamble)."""
    spec = load_spec(ref.path)
    base = replace(locate(spec.base, ref.adapter, f"{ref.path}: base"), adapter_scale=ref.adapter_scale)
    if base.kind != "hf":
        raise ModelError(f"{ref.path}: base {spec.base} is not a Hugging Face model folder")
    check_trained_format(base.path, spec, ref.path)
    what = f"{spec.base}, aligned in context by {ref.path}" + ("" if ref.adapter else " (no adapter)")
    loaded = _open_hf(base, base.path, device, what)
    loaded.ref, loaded.preamble, loaded.generation = ref, spec, CHAT
    loaded.copy = spec.copy_table(loaded.tokenizer)
    return loaded


def check_trained_format(folder: Path, spec: PreambleSpec, spec_path: Path) -> None:
    """A base fine-tuned in a preamble's format (finetune `method: full`) answers only with that text: its
    manifest records the text's fingerprint, as an adapter's does."""
    from ..manifest import recorded_provenance

    trained = recorded_provenance(folder).get("preamble_text_sha256")
    if trained is not None and trained != spec.text_fingerprint():
        raise ModelError(
            f"{spec_path}: its base {folder} was fine-tuned in another preamble's text; serve it with the spec "
            "written beside that run (assistant.yaml)"
        )


def _open_run(ref: ModelRef, device: str) -> Loaded:
    model, meta, ckpt = load_trained_model(ref.path, device)
    source = f"{ckpt} (a pretraining run: plain continuation, no chat template)"
    return Loaded(
        model, ref, source, GenerationConfig(), codec=run_codec(meta), meta=meta, checkpoint=ckpt,
        device=str(device),
    )  # fmt: skip


def load_model(
    path: str | Path,
    adapter: str | Path | None = None,
    device: str | torch.device = "cpu",
    weights: str | None = None,
    flag: str = "--model",
    head: str = "same",
    kernels: str = "auto",
    adapter_scale: float = 1.0,
) -> Loaded:
    """Open any model ENLACE can use (see the module docstring); `flag` names `path` in errors.

    weights: decode weights to convert to (auto, fp32, bf16, int8; see generate.decode_weights), checked
    before anything is read; None keeps the fp32 weights a model trains and scores with.
    head: "int8" puts the output head (and a tied embedding) in int8 whatever the rest is (--head).
    kernels: which kernels decode (choices.DecodeKernels, --kernels); checked before anything is read.
    adapter_scale: the adapter's delta times this (--adapter-scale; 1: as trained), part of the model's name.
    """
    from ..generate import HEAD_WEIGHTS, KERNEL_CHOICES, decode_weights, resolve_decode_weights

    resolved = resolve_decode_weights(weights, device) if weights is not None else "fp32"
    if head not in HEAD_WEIGHTS:
        raise ModelError(f"--head {head}: choose from {', '.join(HEAD_WEIGHTS)}")
    if kernels not in KERNEL_CHOICES:
        raise ModelError(f"--kernels {kernels}: choose from {', '.join(KERNEL_CHOICES)}")
    if kernels != "auto" and weights is None:
        raise ModelError(f"--kernels {kernels}: decode kernels need decode weights (--weights)")
    if head == "int8" and torch.device(device).type != "cpu":
        raise HardwareError(f"--head int8 on {device}: the int8 kernel is torch's CPU one; leave --head out")
    ref = locate(path, adapter, flag)
    if adapter_scale != 1.0:
        if not math.isfinite(adapter_scale):
            raise ModelError(
                f"--adapter-scale {adapter_scale}: give a finite number (1: the adapter as trained)"
            )
        if ref.adapter is None:
            raise ModelError(f"--adapter-scale {adapter_scale:g}: {path} has no LoRA adapter to scale")
        ref = replace(ref, adapter_scale=adapter_scale)
    if ref.kind == "run":
        loaded = _open_run(ref, str(device))
    elif ref.kind == "gguf":
        loaded = _open_gguf(ref, str(device))
    elif ref.kind == "preamble":
        loaded = _open_preamble(ref, str(device))
    else:
        loaded = _open_hf(ref, ref.path, str(device), str(ref.path))
    if weights is not None or head != "same":
        decode_weights(loaded.model, resolved, device, head=head, kernel_choice=kernels)
        loaded.weights = resolved if head == "same" or resolved == "int8" else f"{resolved} ({head} head)"
        release_freed_memory()  # the weights the conversion replaced
    return loaded
