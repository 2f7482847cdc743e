"""`enlace finetune`: LoRA or full fine-tuning as a task of the training loop (train/loop.py).

The task loads a Hugging Face base model, injects seeded adapters (only they train, in one AdamW group) or,
with `method: full`, unfreezes the decoder blocks (trainable_parameters), batches the instruction data so
every assistant token weighs the same, and writes the adapter (PEFT layout) or the whole model (a Hugging
Face folder) at the end. The loop gives it every guarantee pretraining has: one checkpoint layout, GradScaler
under fp16, non-finite steps skipped, SIGTERM/SIGINT save and stop, the run-directory lock, and a run
identity (settings, data, base model, code) that decides what may be resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from .. import lora as lora_module
from .. import model as model_module
from ..config import Config, save_resolved
from ..config.finetune import FinetuneConfig
from ..config.hardware import HardwareConfig
from ..config.resolve import stable_hash
from ..errors import ConfigError
from ..hf import folder as hf_module
from ..hf.arch.common import to_hf_state
from ..hf.folder import INDEX, WEIGHTS, write_model_manifest
from ..io import atomic_dir, atomic_write_text, sha256_file, write_safetensors
from ..load import load_model
from ..load.preamble import PreambleSpec, load_spec
from ..lora import cast_frozen_base, inject_lora, lora_parameters, save_adapter
from ..runtime import numerics, resolve_hardware
from ..train import dist as D
from ..train import loop as loop_module
from ..train import schedule as schedule_module
from ..train import step as step_module
from ..train.identity import RunIdentity, code_fingerprint, weight_keys
from ..train.loop import NonFiniteError, RunResult, Setup
from ..train.step import StepOutput, TrainState
from . import data as data_module
from . import loss as loss_module
from .data import batch_indices, collate, load_dataset
from .loss import assistant_loss_sum

# Settings that provably do not change the adapter: where it goes, how often it is logged and saved, what
# is done with it afterwards (held-out data, prompts, decoding).
CADENCE_KEYS = (
    "finetune.name",
    "finetune.out",
    "finetune.val_data",
    "finetune.log_every",
    "finetune.checkpoint",
    "finetune.max_nonfinite_in_row",
    "finetune.eval_prompts",
    "finetune.questions",
    "finetune.judge_base",
    "finetune.generation",
)
# The model's own forward is part of every step: a change there (attention, say) must not resume old adapters.
STEP_CODE = (
    model_module,
    step_module,
    loop_module,
    schedule_module,
    data_module,
    hf_module,
    lora_module,
    loss_module,
)
RUN_FILES = ("metrics.jsonl", "adapter", "model", "assistant.yaml", "eval.json")

FinetuneDiverged = NonFiniteError  # the loop's error, under the name fine-tuning code knew it by


def base_fingerprint(folder: Path) -> str:
    """The base model's weights and config, by content (a copied folder is the same base)."""
    parts = [f"{p.name}:{sha256_file(p)}" for p in sorted(Path(folder).glob("*.safetensors"))]
    cfg = Path(folder) / "config.json"
    parts.append(sha256_file(cfg) if cfg.exists() else "-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def data_fingerprint(files: list[str]) -> str:
    """The training files by content and order; one file keeps the fingerprint it always had (its sha256)."""
    digests = [sha256_file(Path(f)) for f in files]
    joined = digests[0] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()
    return joined[:16]


def run_identity(cfg: FinetuneConfig, hw: HardwareConfig, numerics: str) -> RunIdentity:
    """Everything that decides the adapter's weights (numerics: runtime.numerics of the device)."""
    keys = weight_keys({"finetune": cfg.model_dump(mode="json")}, CADENCE_KEYS)
    keys.update(
        {
            "data.fingerprint": data_fingerprint(cfg.train_files),
            "base.fingerprint": base_fingerprint(Path(cfg.base_model)),
            "hardware.dtype": resolve_hardware(hw).dtype,  # resolved: cpu-auto's bf16 or fp32
            "hardware.loss_scaler": hw.loss_scaler,
            "hardware.numerics": numerics,
            "code": code_fingerprint(STEP_CODE),
        }
    )
    if cfg.preamble is not None:  # the preamble's text is part of every training example
        keys["preamble.fingerprint"] = load_spec(cfg.preamble).text_fingerprint()[:16]
    return RunIdentity(keys, steps_key="finetune.max_steps")


def training_preamble(cfg: FinetuneConfig) -> PreambleSpec | None:
    """The layer's preamble spec, which must align the layer's own base (its adapter is served on it)."""
    if cfg.preamble is None:
        return None
    spec = load_spec(cfg.preamble)
    if Path(spec.base).resolve() != Path(cfg.base_model).resolve():
        raise ConfigError(
            "finetune", "preamble", f"{cfg.preamble} aligns {spec.base}, not base_model {cfg.base_model}"
        )
    return spec


def unfreeze_blocks(model: torch.nn.Module) -> None:
    """`method: full`: every parameter trains but the token embedding (and the head tied to it)."""
    frozen = model.model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(p is not frozen)


def trainable_parameters(model: torch.nn.Module, method: str) -> list[tuple[str, torch.nn.Parameter]]:
    """What the optimizer updates: the adapters (lora), or every unfrozen weight (full)."""
    if method == "lora":
        return lora_parameters(model)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def prepare(cfg: FinetuneConfig, device: torch.device):
    """Base model with fresh adapters (seeded) or unfrozen blocks, tokenizer and training data."""
    spec = training_preamble(cfg)  # a bad spec fails before the model loads
    base = load_model(cfg.base_model, device=device, flag="finetune.base_model")
    model, tok = base.model, base.hf_tokenizer("finetune")
    torch.manual_seed(cfg.seed)
    if cfg.method == "lora":
        inject_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.dropout)
    else:
        unfreeze_blocks(model)
    data = load_dataset(
        tok,
        [Path(f) for f in cfg.train_files],
        cfg.format,
        cfg.max_len,
        cfg.max_examples or None,
        cfg.system_prompt,
        spec,
    )
    return model, tok, data


def micro_batches(
    data: Any, pad_id: int, cfg: FinetuneConfig, start_step: int, device: torch.device
) -> Iterator:
    """Each step's micro-batches, tagged with the step's label count: every token weighs the same whatever
    micro-batch it is in."""
    step, accum = start_step, cfg.grad_accum_steps
    while True:
        batches = [
            collate(
                [
                    data.examples[i]
                    for i in batch_indices(
                        len(data.examples),
                        cfg.micro_batch_size,
                        step * accum + m,
                        cfg.seed,
                        data.lengths,
                        cfg.length_grouping,
                    )
                ],
                pad_id,
            )
            for m in range(accum)
        ]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for m, b in enumerate(batches):
            yield {"input_ids": b["input_ids"].to(device), "labels": b["labels"].to(device), "total": total,
                   "draw": (cfg.seed, step * accum + m)}  # fmt: skip
        step += 1


def sft_forward(model: torch.nn.Module, batch: dict[str, Any], neftune_alpha: float = 0.0):
    """The micro-batch's share of the step's loss; with neftune_alpha, on noisy input embeddings."""
    with neftune(model, neftune_alpha, batch.get("draw", (0, 0)), batch["input_ids"]):
        s, n = assistant_loss_sum(model, batch["input_ids"], batch["labels"])
    return s / max(batch["total"], 1), {"tokens": s.new_tensor(float(n))}


@contextlib.contextmanager
def neftune(model: torch.nn.Module, alpha: float, draw: tuple[int, int], input_ids: torch.Tensor):
    """NEFTune for one forward: the model's embeddings plus uniform noise in [-alpha / sqrt(T d), +alpha /
    sqrt(T d)] (T the padded length, d the width), drawn from a generator seeded by (seed, micro-batch
    number): the same noise in a rerun and after a resume."""
    raw = getattr(model, "_orig_mod", model)  # the Llama inside a compiled wrapper
    if alpha <= 0:
        yield
        return
    (b, t), d = input_ids.shape, raw.cfg.d_model
    gen = torch.Generator().manual_seed(draw[0] * 1_000_003 + draw[1])
    raw.embed_noise = ((torch.rand(b, t, d, generator=gen) * 2 - 1) * (alpha / math.sqrt(t * d))).to(
        input_ids.device
    )
    try:
        yield
    finally:
        raw.embed_noise = None


class FinetuneTask:
    """What fine-tuning trains. `resolved`: the whole config, written beside the run when given."""

    section = "finetune"
    world_size = 1
    run_files = RUN_FILES

    def __init__(self, cfg: FinetuneConfig, hw: HardwareConfig, resolved: Config | None = None):
        self.cfg, self.hw, self.resolved = cfg, hw, resolved
        self.settings = cfg
        self.data: Any = None
        self.pad_id = 0

    def setup(self, device: torch.device, info: D.DistInfo) -> Setup:
        cfg = self.cfg
        model, tok, self.data = prepare(cfg, device)  # checks the base folder and the data file, naming them
        self.pad_id = tok.pad_id
        if self.hw.dtype == "bf16":
            # The frozen base in bf16 under bf16 autocast; adapters (or unfrozen blocks) and AdamW stay fp32.
            cast_frozen_base(model)
        ident = run_identity(cfg, self.hw, numerics(device))
        rep = self.data.report()
        print(
            f"data: {rep['examples']} examples ({rep['assistant_tokens']} assistant tokens); dropped "
            f"{rep['dropped_too_long']} longer than max_len={cfg.max_len}, {rep['dropped_no_answer']} without an answer",
            flush=True,
        )
        named = trainable_parameters(model, cfg.method)
        groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
        o = cfg.optimizer
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        return Setup(model, opt, ident, trainable_only=True)

    def batches(self, start_step: int, device: torch.device) -> Iterator[Any]:
        return micro_batches(self.data, self.pad_id, self.cfg, start_step, device)

    def forward(self, model: torch.nn.Module, batch: Any):
        return sft_forward(model, batch, self.cfg.neftune_alpha)

    def step_tokens(self, out: StepOutput) -> int:
        return int(round(out.parts["tokens"]))

    def log_record(self, out: StepOutput, state: TrainState, seconds: float, steps: int) -> dict[str, Any]:
        return {
            "step": state.step,
            "loss": round(out.loss, 5),
            "lr": out.lr,
            "grad_norm": round(out.grad_norm, 5),
            "tokens": self.step_tokens(out),
            "s_per_step": round(seconds / max(steps, 1), 3),
            "skipped": state.skipped,
        }

    # No validate hook: the held-out loss and answers are `enlace finetune-eval`'s.

    def checkpoint_meta(self, state: TrainState) -> dict[str, Any]:
        return {"config": self.cfg.model_dump(mode="json")}

    def write_config(self, run_dir: Path) -> None:
        if self.resolved is not None:
            save_resolved(self.resolved, run_dir / "config.json")

    def finish(self, model: torch.nn.Module, run_dir: Path) -> None:
        # The manifest records what made the adapter: the whole resolved config's hash when there is one.
        cfg_hash = (
            self.resolved.hash if self.resolved is not None else stable_hash(self.cfg.model_dump(mode="json"))
        )
        trained_in: dict[str, Any] = {"steps": self.cfg.max_steps}  # finish runs once the last step is done
        if self.cfg.preamble is not None:  # served only with this spec's text (serve.loader.default_adapter)
            trained_in["preamble"] = self.cfg.preamble
            trained_in["preamble_text_sha256"] = load_spec(self.cfg.preamble).text_fingerprint()
        provenance = {"config_hash": cfg_hash, **trained_in}
        if self.cfg.method == "full":
            save_finetuned(model, Path(self.cfg.base_model), run_dir, self.cfg.preamble, provenance)
            return
        save_adapter(model, run_dir / "adapter", self.cfg.base_model, provenance)
        print(f"adapter written to {run_dir / 'adapter'}", flush=True)


def save_finetuned(
    model: torch.nn.Module, base: Path, run_dir: Path, preamble: str | None, provenance: dict[str, Any]
) -> None:
    """A full fine-tune's model/: the base folder's files (config, tokenizer, licence) with the trained
    weights in fp32 and a manifest recording what made them; with a preamble, assistant.yaml: the spec
    served on that folder (`enlace judge --assistant`, `enlace serve --model`)."""
    out = run_dir / "model"
    with atomic_dir(out) as tmp:
        for f in sorted(base.iterdir()):
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("manifest.json", INDEX):
                shutil.copyfile(f, tmp / f.name)
        raw = getattr(model, "_orig_mod", model)
        state = {k: v.float() for k, v in raw.state_dict().items()}
        write_safetensors(tmp / WEIGHTS, to_hf_state(raw.cfg, state), metadata={"format": "pt"})
        write_model_manifest(tmp, "hf-model", {"base_model": str(base), **provenance})
    print(f"model written to {out}", flush=True)
    if preamble is not None:
        spec = load_spec(preamble)
        served = spec.model_copy(update={"name": f"{spec.name}+{run_dir.name}", "base": str(out)})
        text = yaml.safe_dump(served.model_dump(mode="json"), allow_unicode=True, sort_keys=False)
        atomic_write_text(run_dir / "assistant.yaml", f"# {spec.name} on the full fine-tune in {out}\n{text}")
        print(f"assistant spec written to {run_dir / 'assistant.yaml'}", flush=True)


def finetune(
    cfg: FinetuneConfig,
    hw: HardwareConfig,
    fresh: bool = False,
    progress: bool = True,
    resolved: Config | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Train (or resume) the adapter run in cfg.out; one process per run folder. The one entry of a
    fine-tuning run: resolve the hardware for this CPU, then loop.open_run (the lock, the process group)."""
    hw = resolve_hardware(hw)  # `dtype: auto` decided for this CPU (a no-op where the caller did)
    task = FinetuneTask(cfg, hw, resolved)
    with loop_module.open_run(Path(cfg.out), hw, task.world_size) as ctx:
        return loop_module.run(task, ctx, fresh=fresh, progress=progress, stop_after=stop_after)
