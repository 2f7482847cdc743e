"""Small config sections that live in params.yaml rather than in a layer file."""

from pydantic import Field, StrictFloat, StrictInt

from .base import Strict


class GenerationConfig(Strict):
    """How a model samples. The defaults are a plain continuation's (the eval stage's samples); the presets
    of the commands (GENERATE, CHAT, FINETUNE_EVAL) sit beside this class: every sampling default is here."""

    max_new_tokens: StrictInt = Field(default=48, gt=0)
    temperature: StrictFloat = Field(default=0.8, ge=0)  # 0: greedy
    top_k: StrictInt = Field(default=50, ge=0)  # 0: off
    top_p: StrictFloat = Field(default=0.95, gt=0, le=1)
    repetition_penalty: StrictFloat = Field(default=1.0, ge=1)  # 1: off
    no_repeat_ngram: StrictInt = Field(default=0, ge=0)  # 0: off
    seed: StrictInt = 0


# `enlace generate`: the eval stage's sampling, a longer text.
GENERATE = GenerationConfig(max_new_tokens=64)
# An assistant's replies: `enlace chat`, `enlace serve` (a request's unset fields) and finetune-eval's answers
# (finetune.generation, with a budget of its own). Greedy decoding of a small model loops ("¿Por qué? ¿Por
# qué? ..."); a mild penalty plus a 4-gram ban stops that without banning the short phrases Spanish repeats
# legitimately ("de la", "que el"). Measured in runs/finetune/eval.json.
CHAT = GenerationConfig(
    max_new_tokens=256, temperature=0.7, top_k=0, top_p=0.9, repetition_penalty=1.1, no_repeat_ngram=4
)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "no_repeat_ngram")
# A reply's sampler when neither the request nor the assistant sets one (`enlace serve`, `enlace chat`).
CHAT_SAMPLING = CHAT.model_dump(include=set(SAMPLING_KEYS))


class SamplingDefaults(Strict):
    """An assistant's own sampling defaults (a preamble spec's `sampling:`): each value set replaces CHAT's
    where a request leaves it unset; None keeps CHAT's."""

    temperature: StrictFloat | None = Field(default=None, ge=0)  # 0: greedy
    top_k: StrictInt | None = Field(default=None, ge=0)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    repetition_penalty: StrictFloat | None = Field(default=None, ge=1)
    no_repeat_ngram: StrictInt | None = Field(default=None, ge=0)

    def over_chat(self) -> dict[str, float | int]:
        """The sampler a reply takes by default: CHAT's, with what is set here instead."""
        return {**CHAT_SAMPLING, **self.model_dump(exclude_none=True)}


# finetune-eval answers the fixed prompts as `enlace chat` would, seeded, with a shorter budget.
FINETUNE_EVAL = CHAT.model_copy(update={"max_new_tokens": 96})


class EvalConfig(Strict):
    batches: StrictInt = Field(default=16, gt=0)
    # The prose yardstick: everyday Spanish never used in training, scored in full by every model.
    prose: str = "assets/eval/prosa-es.txt"
    # A second such text, written later and scored apart (prose_new_*) so that every prose_* figure stays
    # comparable; prose_all_* is the two together, total bits over total bytes. null: score prose only.
    prose_new: str | None = "assets/eval/prosa-es-nueva.txt"
    prose_context: StrictInt = Field(default=1024, gt=1)  # window cap in tokens (SmolLM2 could take 8192)
    prompts: list[str] = ["La ciudad de", "Había una vez", "El sol sale por"]
    generation: GenerationConfig = GenerationConfig()
