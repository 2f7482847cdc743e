"""Finetune layer: LoRA on a Hugging Face base model with instruction data."""

from typing import Literal

from pydantic import Field, field_validator

from .base import Strict

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FinetuneGeneration(Strict):
    # finetune-eval answers the fixed prompts as `enlace chat` would (same defaults, seeded), so its
    # checks measure what a user gets; greedy decoding loops on small models ("¿Por qué? ¿Por qué? ...").
    max_new_tokens: int = Field(default=96, gt=0)
    temperature: float = Field(default=0.7, ge=0)  # 0: greedy
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=0.9, gt=0, le=1)
    repetition_penalty: float = Field(default=1.1, ge=1)  # 1: off
    no_repeat_ngram: int = Field(default=4, ge=0)  # 0: off
    seed: int = 0


class FinetuneConfig(Strict):
    name: str
    base_model: str = "models/smollm2-135m-instruct"  # a Hugging Face folder (enlace import-gguf makes one)
    train_data: str = "assets/instruct/es_familia_train.jsonl"
    val_data: str = "assets/instruct/es_familia_val.jsonl"
    format: Literal["dolly", "chat"] = "dolly"
    system_prompt: str | None = None  # null: the chat template's own default system message
    steps: int = Field(default=80, gt=0)
    micro_batch: int = Field(default=4, gt=0)
    grad_accum: int = Field(default=1, gt=0)
    lr: float = Field(default=1e-3, gt=0)
    warmup: int = Field(default=10, ge=0)
    final_lr_frac: float = Field(default=0.1, ge=0, le=1)  # cosine decay to this fraction of lr
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0)  # 0 disables clipping
    max_len: int = Field(default=320, gt=1)
    max_examples: int = Field(default=0, ge=0)  # 0: all
    rank: int = Field(default=8, gt=0)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.05, ge=0, lt=1)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    seed: int = 0
    out: str = "runs/finetune"
    checkpoint_every: int = Field(default=50, gt=0)
    keep_checkpoints: int = Field(default=2, ge=1)
    eval_prompts: list[str] = [
        "¿Qué puedo preparar de cena con huevos, patatas y cebolla?",
        "Escribe un mensaje corto para felicitar a mi abuela por su cumpleaños.",
        "Dame tres consejos para que los niños se acuesten temprano.",
    ]
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


def register() -> None:
    from .resolve import register_layer

    register_layer("finetune", FinetuneConfig)


register()
