"""Finetune layer: LoRA on a Hugging Face base model with instruction data."""

from typing import Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator

from .base import Strict

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FinetuneGeneration(Strict):
    # finetune-eval answers the fixed prompts as `enlace chat` would (same defaults, seeded), so its
    # checks measure what a user gets; greedy decoding loops on small models ("¿Por qué? ¿Por qué? ...").
    max_new_tokens: StrictInt = Field(default=96, gt=0)
    temperature: StrictFloat = Field(default=0.7, ge=0)  # 0: greedy
    top_k: StrictInt = Field(default=0, ge=0)
    top_p: StrictFloat = Field(default=0.9, gt=0, le=1)
    repetition_penalty: StrictFloat = Field(default=1.1, ge=1)  # 1: off
    no_repeat_ngram: StrictInt = Field(default=4, ge=0)  # 0: off
    seed: StrictInt = 0


class FinetuneConfig(Strict):
    name: str
    base_model: str = "models/smollm2-135m-instruct"  # a Hugging Face folder (enlace import-gguf makes one)
    train_data: str = "assets/instruct/es_familia_train.jsonl"
    val_data: str = "assets/instruct/es_familia_val.jsonl"
    format: Literal["dolly", "chat"] = "dolly"
    system_prompt: str | None = None  # null: the chat template's own default system message
    steps: StrictInt = Field(default=80, gt=0)
    micro_batch: StrictInt = Field(default=4, gt=0)
    grad_accum: StrictInt = Field(default=1, gt=0)
    lr: StrictFloat = Field(default=1e-3, gt=0)
    warmup: StrictInt = Field(default=10, ge=0)
    final_lr_frac: StrictFloat = Field(default=0.1, ge=0, le=1)  # cosine decay to this fraction of lr
    weight_decay: StrictFloat = Field(default=0.0, ge=0)
    grad_clip: StrictFloat = Field(default=1.0, ge=0)  # 0 disables clipping
    max_len: StrictInt = Field(default=320, gt=1)
    max_examples: StrictInt = Field(default=0, ge=0)  # 0: all
    rank: StrictInt = Field(default=8, gt=0)
    alpha: StrictFloat = Field(default=16.0, gt=0)
    dropout: StrictFloat = Field(default=0.05, ge=0, lt=1)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    seed: StrictInt = 0
    out: str = "runs/finetune"
    checkpoint_every: StrictInt = Field(default=50, gt=0)
    keep_checkpoints: StrictInt = Field(default=2, ge=1)
    # Changed settings, data or code: "move" keeps the old run under <out>/previous/<identity>/.
    on_identity_change: Literal["move", "delete"] = "move"
    # Non-finite losses or gradients tolerated in a row before the run stops.
    max_nonfinite_in_row: StrictInt = Field(default=5, gt=0)
    eval_prompts: list[str] = [
        "¿Qué puedo preparar de cena con huevos, patatas y cebolla?",
        "Escribe un mensaje corto para felicitar a mi abuela por su cumpleaños.",
        "Dame tres consejos para que los niños se acuesten temprano.",
    ]
    # Questions the instruction set never saw, with topic keywords: finetune-eval answers and judges each one
    # (in Spanish, on topic, no loops; enlace.finetune.judge). null: none. judge_base: the base model too.
    questions: str | None = "assets/instruct/es_preguntas_nuevas.jsonl"
    judge_base: StrictBool = True
    generation: FinetuneGeneration = FinetuneGeneration()

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
