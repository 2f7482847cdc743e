"""The OpenAI-compatible endpoints' bodies, both ways: requests validated strictly, responses typed.

Requests: a wrong type is refused, not coerced, and every field has its bound (the message count, the total
characters, each string), so nothing a client sends costs more than the server chose to spend on it. A field
ENLACE does not know is refused, named (code `unsupported_parameter`), never silently ignored; so is a known
field whose value would ask for something else than what is done (a non-empty `logit_bias`, a
`response_format` other than text, tools, non-zero OpenAI penalties). Sending such a field empty or as null
is fine. `n` (up to MAX_N, and the server's slots), `logprobs` and `top_logprobs` (up to MAX_TOP_LOGPROBS;
a completion's `logprobs` up to MAX_COMPLETION_LOGPROBS, as OpenAI bounds them) are served. Beyond OpenAI's fields, ENLACE takes the sampling settings of `enlace chat`:
top_k, repetition_penalty, no_repeat_ngram, and ignore_eos (as llama.cpp, vLLM).

Responses: the models below are what the handlers send and what /openapi.json describes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

# Bounds of what one request may ask for (beyond these the server's own limits apply: prompt tokens,
# max_tokens, the body's bytes). temperature and top_p as OpenAI bounds them.
MAX_STOP = 4
MAX_STOP_CHARS = 64
MAX_MESSAGES = 1024  # far more turns than the longest context served holds (each costs a few tokens)
MAX_CHARS = 262_144  # the prompt's text, all messages together: well past any prompt the context holds
MAX_PARTS = 256  # text parts of one message's content
MAX_PROMPT_IDS = 65_536  # token ids of a /v1/completions prompt
MAX_NAME_CHARS = 256  # model, user
MAX_INT = 2**31 - 1  # counts and ids beyond this are never meaningful
MAX_N = 16  # choices of one request (each takes a slot, so the server's --slots bounds it too)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI bounds it
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI bounds it


def _only(allowed: Callable[[Any], bool], what: str) -> AfterValidator:
    """A field accepted only with a value that asks for nothing ENLACE does not do."""

    def check(value: Any) -> Any:
        if value is not None and not allowed(value):
            raise PydanticCustomError("unsupported", "not supported by this server (send {what} or leave it out)",
                                      {"what": what})  # fmt: skip
        return value

    return AfterValidator(check)


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_CHARS)]


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for a system message.
    role: Literal["system", "developer", "user", "assistant"]
    content: (
        Annotated[str, Field(max_length=MAX_CHARS)] | Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
    )
    # What the openai client sends back with an earlier answer; only as null (they would ask for tools).
    refusal: None = None
    tool_calls: None = None
    function_call: None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class Sampling(_Strict):
    """What both endpoints share. None (left out or sent as null): the server's default (for the sampling
    settings the model's own: config.extra.CHAT's sampler, or what its assistant spec's `sampling:` sets)."""

    model: Name | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_INT)] | None = None
    repetition_penalty: Annotated[float, Field(ge=1, le=10)] | None = None
    no_repeat_ngram: Annotated[int, Field(ge=0, le=64)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logit_bias: Annotated[dict[str, float], _only(lambda v: not v, "{}")] | None = None
    user: Name | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: each token's and its k likeliest rivals'."""
        return None


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Annotated[str, Field(max_length=16), _only(lambda v: v == "none", '"none"')] | None = None
    response_format: (
        Annotated[
            dict[str, str], Field(max_length=1), _only(lambda v: v == {"type": "text"}, '{"type": "text"}')
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _bounds(self) -> ChatRequest:
        chars = sum(len(m.text()) for m in self.messages)
        if chars > MAX_CHARS:
            raise PydanticCustomError("too_long", "messages: {chars} characters in all; at most {limit}",
                                      {"chars": chars, "limit": MAX_CHARS})  # fmt: skip
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    # A text, a list holding one text, or token ids.
    prompt: (
        Annotated[str, Field(max_length=MAX_CHARS)]
        | Annotated[list[Annotated[str, Field(max_length=MAX_CHARS)]], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[int, Field(ge=0, le=MAX_INT)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)
        ]
    )
    echo: Literal[False] | None = None
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            return p[0]
        return p


# ---- Responses -------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache, not prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class Timings(BaseModel):
    """Not OpenAI's (llama.cpp's server sends the like): measured inside the server."""

    prompt_tokens: int
    prompt_ms: float  # time to the first token
    completion_tokens: int
    decode_ms: float
    decode_tokens_per_s: float  # the rate of the decode steps after the first token


_REPLY_ORDER = ("id", "object", "created", "model", "system_fingerprint", "choices")


class _Reply(BaseModel):
    """What every completion and chunk starts with. usage and timings are left out of the JSON, not sent as
    null, where they are None (every chunk but the last ones), as OpenAI and llama.cpp send them."""

    id: str
    created: int
    model: str
    system_fingerprint: None = None
    usage: Usage | None = None
    timings: Timings | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler) -> dict[str, Any]:
        out = handler(self)
        first = {k: out.pop(k) for k in _REPLY_ORDER if k in out}  # OpenAI's order, for people reading it
        return {**first, **{k: v for k, v in out.items() if v is not None or k not in ("usage", "timings")}}


FinishReason = Literal["stop", "length", "cancelled"] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat's logprobs: one entry per generated token (the model's, before temperature and the repetition
    controls)."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """/v1/completions' logprobs, in OpenAI's older shape."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(BaseModel):
    """A streamed piece: the first carries the role, the last (with the finish reason) nothing."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class Completion(_Reply):
    """A whole answer of /v1/completions, and each of its streamed chunks (OpenAI uses one object for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "enlace"
    # Not OpenAI's: what the chat page and scripts need to know about the model.
    context_length: int
    chat: bool  # whether it has a chat template
    weights: str
    answers: str = (
        ""  # what answers, in words: the base and its preamble or adapter (the startup line says it too)
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthBrief(BaseModel):
    """/health without the API key (when the server has one): only whether it serves."""

    status: Literal["ok", "degraded"]


class Health(HealthBrief):
    model: str
    slots: int
    busy: int
    queued: int
    queue: int
    requests: int
    completed: int
    cancelled: int
    failed: int
    refused: int
    tokens_generated: int
    prompt_tokens: int  # of the requests that ended, prefilled or taken from the prompt cache
    prompt_tokens_cached: int  # of those, taken from the prompt cache
    prompt_cache_hits: int  # requests that took any
    prompt_cache_tokens: int  # positions the prompt cache holds now
    prompt_cache_limit: int  # the most it may hold (--prompt-cache; 0: off)
    consecutive_failures: int
