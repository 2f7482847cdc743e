"""Finetune layer: LoRA on a Hugging Face base model with instruction data."""

import re
from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator

from ..choices import DecayShape, InstructFormat
from .base import Strict
from .extra import FINETUNE_EVAL, GenerationConfig
from .train import AdamWConfig, CheckpointConfig, ScheduleConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FinetuneOptimizer(AdamWConfig):
    """AdamW on the adapters: LoRA tolerates ~10x the full fine-tuning rate (B starts at zero)."""

    lr: StrictFloat = Field(default=1e-3, gt=0)
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.999)
    weight_decay: StrictFloat = Field(default=0.0, ge=0)


class FinetuneSchedule(ScheduleConfig):
    """Linear warmup, then a cosine decay over every later step (decay_steps null: no plateau)."""

    warmup_steps: StrictInt = Field(default=10, ge=0)
    decay_steps: StrictInt | None = Field(default=None, ge=0)
    decay_shape: DecayShape = "cosine"
    final_lr_frac: StrictFloat = Field(default=0.1, ge=0, le=1)


class FinetuneCheckpoint(CheckpointConfig):
    every: StrictInt = Field(default=50, gt=0)


class FinetuneConfig(Strict):
    """The fine-tuning run: what to adapt, on which data, and the same loop sections as the train layer."""

    name: str
    base_model: str = "models/smollm2-135m-instruct"  # a Hugging Face folder (enlace import-gguf makes one)
    # One instruction file or several, read in this order, each in `format` (a --data flag gives one).
    train_data: str | list[str] = "assets/instruct/es_familia_train.jsonl"
    val_data: str = "assets/instruct/es_familia_val.jsonl"
    format: InstructFormat = "dolly"
    system_prompt: str | None = None  # null: the chat template's own default system message
    # An assistant spec (configs/assistant/NAME.yaml): train in its plain format, each example rendered as the
    # served preamble assistant renders the question (the preamble in the prompt), the loss on the answer and
    # its end only; serve the adapter as `--assistant SPEC --adapter DIR`. null: the chat template.
    preamble: str | None = None
    max_len: StrictInt = Field(default=320, gt=1)
    max_examples: StrictInt = Field(default=0, ge=0)  # 0: all
    # lora: seeded adapters on `targets` train, the base stays frozen; the run writes adapter/ (PEFT layout).
    # full: every weight of the decoder blocks and the final norm trains (rank, alpha, dropout and targets
    # unused); the token embedding, tied to the output head, stays frozen: it is most of a small multilingual
    # model's bytes (Gemma 3 270M: 168 M of 268 M), and a few hundred examples touch few of its rows. The run
    # writes model/, a Hugging Face folder (with a preamble, assistant.yaml too: the spec on that folder).
    method: Literal["lora", "full"] = "lora"
    rank: StrictInt = Field(default=8, gt=0)
    alpha: StrictFloat = Field(default=16.0, gt=0)
    dropout: StrictFloat = Field(default=0.05, ge=0, lt=1)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    seed: StrictInt = 0
    max_steps: StrictInt = Field(default=80, gt=0)
    micro_batch_size: StrictInt = Field(default=4, gt=0)
    grad_accum_steps: StrictInt = Field(default=1, gt=0)
    # Batches of similar length: each epoch's shuffle is sorted by length in runs of this many micro-batches,
    # whose order is then shuffled (finetune.data.epoch_order), so a batch pads less. 0: a plain shuffle.
    length_grouping: StrictInt = Field(default=0, ge=0)
    # NEFTune (Jain et al., 2023): uniform noise of magnitude alpha / sqrt(length x width) added to the input
    # embeddings (after Gemma's scale) at each training step, drawn from the seed and the step, so a resumed
    # run draws the same. 0: off. The paper's alphas are 5, 10 and 15.
    neftune_alpha: StrictFloat = Field(default=0.0, ge=0)
    optimizer: FinetuneOptimizer = FinetuneOptimizer()
    schedule: FinetuneSchedule = FinetuneSchedule()
    checkpoint: FinetuneCheckpoint = FinetuneCheckpoint()
    out: str = "runs/finetune"
    log_every: StrictInt = Field(default=1, gt=0)
    # Non-finite losses or gradients tolerated in a row before the run stops.
    max_nonfinite_in_row: StrictInt = Field(default=5, gt=0)
    eval_prompts: list[str] = [
        "¿Qué puedo preparar de cena con huevos, patatas y cebolla?",
        "Escribe un mensaje corto para felicitar a mi abuela por su cumpleaños.",
        "Dame tres consejos para que los niños se acuesten temprano.",
    ]
    # Questions the instruction set never saw, with topic keywords: finetune-eval answers and judges each one
    # (in Spanish, on topic, no loops; enlace.finetune.judge). null: none. judge_base: the base model too.
    questions: str | None = "assets/eval/preguntas-juez.jsonl"
    judge_base: StrictBool = True
    # Which questions of the file: test (the reported ones), dev (those a prompt may be tuned on) or all.
    questions_split: Literal["test", "dev", "all"] = "test"
    # Judge only the first N of the split, kinds in turn (0: all): a layer inside `make run`'s budget takes a
    # fair sample, `enlace judge` and `make assistant` take them all.
    questions_limit: StrictInt = Field(default=0, ge=0)
    # Each decoding answers every question: greedy (temperature 0 with `generation`'s repetition controls, as
    # `enlace serve` answers at temperature 0) and sample-N (`generation`, seed N). The first is the flat one.
    judge_decodings: list[str] = Field(default=["greedy", "sample-0", "sample-1"], min_length=1)
    # finetune-eval answers the fixed prompts as `enlace chat` would (same defaults, seeded), so its checks
    # measure what a user gets; greedy decoding loops on small models ("¿Por qué? ¿Por qué? ...").
    generation: GenerationConfig = FINETUNE_EVAL

    @field_validator("train_data")
    @classmethod
    def _files(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("no training file; name one or several")
        return v

    @property
    def train_files(self) -> list[str]:
        """The training files, in reading order."""
        return [self.train_data] if isinstance(self.train_data, str) else list(self.train_data)

    @field_validator("judge_decodings")
    @classmethod
    def _decodings(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if re.fullmatch(r"greedy|sample-\d+", d) is None]
        if bad:
            raise ValueError(f"unknown decodings {bad}; use greedy or sample-N (N a seed)")
        return v

    @field_validator("targets", mode="before")
    @classmethod
    def _split(cls, v):
        # `--targets q_proj,v_proj` and `--set finetune.targets=q,v` arrive as one string.
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        short = {t.removesuffix("_proj"): t for t in TARGETS}
        return [short.get(t, t) for t in v] if isinstance(v, list) else v

    @field_validator("targets")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in TARGETS]
        if bad or not v:
            raise ValueError(f"unknown or empty LoRA targets {bad}; choose from {', '.join(TARGETS)}")
        return v
