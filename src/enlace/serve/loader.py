"""What `enlace serve` serves: one model, opened by enlace.load (any model path it takes, with a LoRA adapter
merged in), with the text side the server needs (prompt ids, chat template, streamed decoding, stop ids).
Without --model: the in-context Gemma 3 assistant (paths.DEFAULT_ASSISTANT) once Gemma is imported, else the
finetune layer's base model and its run's adapter (the default pipeline's assistant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.extra import CHAT_SAMPLING, GenerationConfig
from ..errors import EnlaceError
from ..generate import CopyTable
from ..hf.tokenizer import Message
from ..load import Loaded, TextStream, locate, model_name
from ..paths import DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER


@dataclass
class Served:
    """A loaded model and how text goes in and out of it."""

    name: str  # the model id clients send and /v1/models lists
    source: str  # what was loaded, in words (logs, /health)
    model: torch.nn.Module
    context: int  # the model's window in tokens: prompt plus completion must fit in it
    eos_ids: tuple[int, ...]
    encode_text: Callable[[str], list[int]]  # a plain prompt (/v1/completions)
    encode_chat: Callable[[list[Message]], list[int]] | None  # None: the model has no chat template
    stream: Callable[[list[int]], TextStream]  # a decoder of new tokens, given the prompt's ids
    weights: str = "fp32"
    device: str = "cpu"
    info: dict = field(default_factory=dict)
    generation: GenerationConfig | None = None  # the model's sampling defaults (enlace.load)
    token_text: Callable[[int], str] = str  # one token id's own text (logprobs name tokens by it)
    stops: tuple[
        str, ...
    ] = ()  # strings that end every answer besides the request's (a preamble's next turn)
    copy: CopyTable | None = None  # a preamble's example answers, copied at most copy.n tokens in a row
    trim: bool = False  # a preamble's answers: the whitespace around them (after "ENLACE:", before the stop) is not sent
    # How a request samples where it sets nothing: CHAT's sampler, or an assistant spec's (Loaded.chat_sampling).
    sampling: dict = field(default_factory=lambda: dict(CHAT_SAMPLING))

    @classmethod
    def from_loaded(cls, loaded: Loaded, name: str) -> Served:
        return cls(
            name=name, source=loaded.source, model=loaded.model, context=loaded.context,
            eos_ids=loaded.eos_ids, encode_text=loaded.encode, encode_chat=loaded.chat_template,
            stream=loaded.stream, weights=loaded.weights, device=loaded.device, generation=loaded.generation,
            token_text=_token_text(loaded), stops=loaded.stops, copy=loaded.copy, sampling=loaded.chat_sampling,
            trim=loaded.preamble is not None,
        )  # fmt: skip


def _token_text(loaded: Loaded) -> Callable[[int], str]:
    if loaded.tokenizer is not None:
        tok = loaded.tokenizer
        return lambda i: tok.decode([i], skip_special_tokens=False)
    codec = loaded.codec
    return lambda i: codec.decode([i])


def resolve(model: str | None, adapter: str | None, default: Callable[[], tuple[Path, Path]]) -> tuple:
    """(kind, path, adapter) for --model/--adapter, as enlace.load.locate tells them. No --model: the in-context
    assistant (paths.DEFAULT_ASSISTANT) once its base is imported, with the LoRA trained in its format when
    the `assistant` stage (`make run`) made one for its present text (default_adapter); else `default()`'s base and adapter."""
    if model is None and adapter is None and _preamble_ready(DEFAULT_ASSISTANT):
        return "preamble", DEFAULT_ASSISTANT, default_adapter(DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER)
    if model is None:
        base, adapter_dir = default()
        if not (adapter_dir / "adapter_config.json").exists():
            raise EnlaceError(
                f"no assistant yet: {adapter_dir} not found; run `make run` (or `dvc repro finetune`), or "
                f"import Gemma 3 for {DEFAULT_ASSISTANT} (`dvc repro import-gemma3`), or pass --model FOLDER "
                f"(e.g. --model {base})"
            )
        if adapter is not None:
            adapter_dir = Path(adapter)
        return "hf", base, adapter_dir
    ref = locate(model, adapter)
    return ref.kind, ref.path, ref.adapter


def default_adapter(spec: Path, adapter: Path) -> Path | None:
    """`adapter` when it was trained in `spec`'s format with the spec's present text (its manifest records
    the spec's text_fingerprint), else None: a spec whose preamble changed since would be served with an
    adapter that learnt another one, so the spec is served alone, and a line on stderr says why. The
    adapter's files are verified when it loads."""
    import sys

    from ..load.preamble import load_spec
    from ..manifest import read_manifest

    if not (adapter / "adapter_config.json").exists():
        return None
    try:
        trained = read_manifest(adapter / "manifest.json").get("provenance", {}).get("preamble_text_sha256")
    except EnlaceError as e:
        trained = None
        print(f"warning: {e}", file=sys.stderr)
    if trained != load_spec(spec).text_fingerprint():
        print(f"warning: not serving {adapter}: it was not trained with {spec} as it is now (`dvc repro "
              "assistant` trains it again); serving the spec alone", file=sys.stderr, flush=True)  # fmt: skip
        return None
    return adapter


def default_in_words(adapter_dir: Path) -> str:
    """What `enlace serve` without --model would answer with now, in words (the end of `enlace report`)."""
    if _preamble_ready(DEFAULT_ASSISTANT):
        lora = default_adapter(DEFAULT_ASSISTANT, DEFAULT_ASSISTANT_ADAPTER)
        if lora is not None:
            return f"the in-context assistant {DEFAULT_ASSISTANT} with the LoRA {lora} trained in its format"
        return (
            f"the in-context assistant {DEFAULT_ASSISTANT} (the Gemma 3 270M base, no adapter, no training)"
        )
    if (adapter_dir / "adapter_config.json").exists():
        return f"the LoRA adapter {adapter_dir} on its base (`make finetune`)"
    return f"nothing yet: import Gemma 3 (`dvc repro import-gemma3`) for {DEFAULT_ASSISTANT}"


def _preamble_ready(spec: Path) -> bool:
    """Whether the spec exists and names a base folder that holds a model."""
    from ..load.preamble import load_spec

    return spec.is_file() and (Path(load_spec(spec).base) / "config.json").exists()


def default_name(kind: str, folder: Path, adapter: Path | None) -> str:
    """The model id: the folder's name, plus the adapter's run (runs/finetune/adapter -> "+finetune")."""
    return model_name(folder, adapter)


def load_served(
    model: str | None,
    adapter: str | None,
    default: Callable[[], tuple[Path, Path]],
    weights: str = "auto",
    device: str = "cpu",
    name: str | None = None,
    head: str = "same",
    kernels: str = "auto",
    adapter_scale: float = 1.0,
) -> Served:
    from ..load import load_model

    kind, path, adapter_dir = resolve(model, adapter, default)
    loaded = load_model(
        path,
        adapter_dir,
        device=device,
        weights=weights,
        head=head,
        kernels=kernels,
        adapter_scale=adapter_scale,
    )
    return Served.from_loaded(loaded, name or loaded.name)
