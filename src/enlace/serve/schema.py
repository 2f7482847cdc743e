"""Request bodies of the OpenAI-compatible endpoints, validated strictly: a wrong type is refused, not coerced.

Fields a client may send that ENLACE does not act on (user, logit_bias left empty, penalties at 0) are
accepted and ignored; a value that would ask for something else than what is done (n > 1, logprobs, tools,
non-zero OpenAI penalties) is refused, naming the field. Beyond OpenAI's fields, ENLACE takes the sampling
settings of `enlace chat`: top_k, repetition_penalty, no_repeat_ngram, and ignore_eos (as llama.cpp, vLLM).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Bounds of what one request may ask for (beyond these the server's own limits apply: prompt tokens,
# max_tokens). temperature and top_p as OpenAI bounds them.
MAX_STOP = 4
MAX_STOP_CHARS = 64


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for a system message.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class Sampling(_Strict):
    """What both endpoints share. None: the server's default (those of `enlace chat`)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=1, le=10)] | None = None
    no_repeat_ngram: Annotated[int, Field(ge=0, le=64)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: (
        str
        | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=1)] = 1
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logprobs: Literal[False] | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens
    tools: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(Sampling):
    # A text, a list holding one text, or token ids.
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    )
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            return p[0]
        return p
