"""One handler per endpoint, in the shape of vLLM's OpenAI entrypoint: `Serving` holds what every request
needs (the engine, the limits), each method answers one endpoint with the typed models of schema.py.

A generation request goes: read and validate the body (protocol.py), encode the prompt in a worker thread,
check its length, take a place in the queue (429 at once if there is none), wait for a slot (503 past the
queue deadline), then stream or collect the engine's events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from .engine import Engine, Event, GenRequest, Job, QueueFull, QueueTimeout
from .guard import AUTHORIZED
from .protocol import ApiError, ClientGone, read_request
from .schema import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    ChunkChoice,
    Completion,
    CompletionRequest,
    Delta,
    Health,
    HealthBrief,
    ModelCard,
    ModelList,
    Sampling,
    TextChoice,
    Timings,
    Usage,
)  # fmt: skip

log = logging.getLogger("enlace.serve")
MAX_BODY_BYTES = 1 << 20  # a prompt of the largest context this project serves is well under 100 kB


@dataclass
class Limits:
    max_prompt_tokens: int = 2048  # capped at the model's context less one token
    max_tokens: int = 512
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = 10.0  # seconds to receive a whole body
    queue_timeout: float = 60.0  # seconds a request may wait for a generation slot


def _chat_sampling() -> dict[str, Any]:
    from ..finetune.chat import CHAT_SAMPLING

    return CHAT_SAMPLING


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _sse(model: BaseModel) -> str:
    return f"data: {json.dumps(model.model_dump(mode='json'), ensure_ascii=False)}\n\n"


class _ChatChunks:
    """The pieces of one chat answer, whole or streamed."""

    def __init__(self, model: str):
        self.base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}

    def first(self) -> ChatCompletionChunk | None:
        return ChatCompletionChunk(
            **self.base, choices=[ChunkChoice(delta=Delta(role="assistant", content=""))]
        )

    def text(self, text: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.base, choices=[ChunkChoice(delta=Delta(content=text))])

    def finish(self, ev: Event) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.base, choices=[ChunkChoice(delta=Delta(), finish_reason=ev.finish_reason)],
                                   usage=Usage(**ev.usage), timings=Timings(**ev.timings))  # fmt: skip

    def usage(self, ev: Event) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.base, choices=[], usage=Usage(**ev.usage))

    def whole(self, text: str, ev: Event) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=ev.finish_reason)
        return ChatCompletion(
            **self.base, choices=[choice], usage=Usage(**ev.usage), timings=Timings(**ev.timings)
        )


class _TextChunks:
    """The pieces of one /v1/completions answer, whole or streamed (one object for both, as OpenAI's)."""

    def __init__(self, model: str):
        self.base = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}

    def first(self) -> Completion | None:
        return None  # a completion stream starts with its first text

    def text(self, text: str) -> Completion:
        return Completion(**self.base, choices=[TextChoice(text=text)])

    def finish(self, ev: Event) -> Completion:
        return Completion(**self.base, choices=[TextChoice(text="", finish_reason=ev.finish_reason)],
                          usage=Usage(**ev.usage), timings=Timings(**ev.timings))  # fmt: skip

    def usage(self, ev: Event) -> Completion:
        return Completion(**self.base, choices=[], usage=Usage(**ev.usage))

    def whole(self, text: str, ev: Event) -> Completion:
        choice = TextChoice(text=text, finish_reason=ev.finish_reason)
        return Completion(
            **self.base, choices=[choice], usage=Usage(**ev.usage), timings=Timings(**ev.timings)
        )


Chunks = _ChatChunks | _TextChunks


class _JobStream(StreamingResponse):
    """A streamed answer that gives its job back even if the client left before the first byte (then the
    body is never iterated, and its own cleanup never runs)."""

    def __init__(self, engine: Engine, job: Job, body: AsyncIterator[str], **kw: Any):
        super().__init__(body, **kw)
        self.engine, self.job = engine, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.abandon(self.job)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so that is the next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Serving:
    """The endpoints of one served model."""

    def __init__(self, engine: Engine, limits: Limits):
        self.engine, self.served, self.limits = engine, engine.served, limits
        self.max_prompt = max(1, min(limits.max_prompt_tokens, self.served.context - 1))
        self.created = int(time.time())
        self.page = resources.files("enlace.serve").joinpath("static/chat.html").read_text(encoding="utf-8")

    # ---- endpoints ----

    async def chat_completions(self, request: Request) -> Response:
        req: ChatRequest = await self.read(request, ChatRequest)
        self.check_model(req.model)
        if self.served.encode_chat is None:
            raise ApiError(400, f"model {self.served.name!r} has no chat template (a pretraining run): use "
                           "/v1/completions", param="messages", code="no_chat_template")  # fmt: skip
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
        ]
        if not any(m["role"] == "user" for m in messages):
            raise ApiError(400, "messages: no user message", param="messages", code="invalid_value")
        prompt_ids = await asyncio.to_thread(self.encode_chat, messages)
        return await self.answer(request, req, prompt_ids, "messages", _ChatChunks(self.served.name))

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.read(request, CompletionRequest)
        self.check_model(req.model)
        prompt = req.prompt_value()
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(self.served.encode_text, prompt) if prompt else []
        else:
            vocab = self.served.model.cfg.vocab_size
            bad = next((i for i, t in enumerate(prompt) if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt.{bad}: token id {prompt[bad]} is outside the vocabulary "
                               f"(0-{vocab - 1})", param="prompt", code="invalid_value")  # fmt: skip
            prompt_ids = list(prompt)
        return await self.answer(request, req, prompt_ids, "prompt", _TextChunks(self.served.name))

    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    async def model(self, name: str) -> ModelCard:
        self.check_model(name)
        return self.model_card()

    async def health(self, request: Request) -> JSONResponse:
        """503 once generations keep failing; the details only to a client with the key (if there is one)."""
        status = "ok" if self.engine.healthy else "degraded"
        code = 200 if status == "ok" else 503
        if not request.scope.get(AUTHORIZED, True):
            return _json(HealthBrief(status=status), code)
        return _json(Health(status=status, model=self.served.name, **self.engine.status()), code)

    async def chat_page(self) -> HTMLResponse:
        return HTMLResponse(self.page, headers={"Cache-Control": "no-cache"})

    # ---- the steps a generation request goes through ----

    async def read(self, request: Request, model_cls: type[Sampling]) -> Any:
        return await read_request(request, model_cls, self.limits.max_body_bytes, self.limits.body_timeout)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template and the tokenizer (in a worker thread): a template's own refusal is a 400."""
        from jinja2.exceptions import TemplateError

        try:
            return self.served.encode_chat(messages)
        except TemplateError as e:  # e.g. raise_exception("roles must alternate")
            message = " ".join(str(e).split())[:300]
            raise ApiError(400, f"messages: the model's chat template refused them: {message}", param="messages",
                           code="invalid_value") from None  # fmt: skip

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served.name:
            raise ApiError(404, f"model {name[:100]!r} not found; this server serves {self.served.name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def model_card(self) -> ModelCard:
        s = self.served
        return ModelCard(id=s.name, created=self.created, context_length=s.context,
                         chat=s.encode_chat is not None, weights=s.weights)  # fmt: skip

    def gen_request(self, req: Sampling, prompt_ids: list[int], prompt_param: str) -> GenRequest:
        limits, context = self.limits, self.served.context
        if not prompt_ids:
            raise ApiError(
                400, f"{prompt_param}: the prompt is empty", param=prompt_param, code="empty_prompt"
            )
        if len(prompt_ids) > self.max_prompt:
            raise ApiError(400, f"{prompt_param}: the prompt is {len(prompt_ids)} tokens; this server takes at most "
                           f"{self.max_prompt}", param=prompt_param, code="context_length_exceeded")  # fmt: skip
        room = context - len(prompt_ids)
        if req.max_tokens is not None and req.max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens: {req.max_tokens} exceeds this server's limit of {limits.max_tokens}",
                           param="max_tokens", code="invalid_value")  # fmt: skip
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(400, f"max_tokens: the prompt ({len(prompt_ids)} tokens) plus {req.max_tokens} new tokens "
                           f"exceed the model's context of {context}", param="max_tokens",
                           code="context_length_exceeded")  # fmt: skip
        defaults = _chat_sampling()
        pick = lambda name: getattr(req, name) if getattr(req, name) is not None else defaults[name]  # noqa: E731
        return GenRequest(
            prompt_ids=prompt_ids, max_tokens=req.max_tokens or min(limits.max_tokens, room),
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            repetition_penalty=pick("repetition_penalty"), no_repeat_ngram=pick("no_repeat_ngram"),
            seed=req.seed if req.seed is not None else secrets.randbits(32), stop=req.stops(),
            ignore_eos=bool(req.ignore_eos),
        )  # fmt: skip

    async def answer(
        self, request: Request, req: Sampling, prompt_ids: list[int], param: str, chunks: Chunks
    ) -> Response:
        job = self.admit(self.gen_request(req, prompt_ids, param))
        await self.start(request, job)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            body = self.stream(job, chunks, include)
            return _JobStream(self.engine, job, body, media_type="text/event-stream", headers=headers)
        text, done = await self.collect(request, job)
        return _json(chunks.whole(text, done))

    def admit(self, gen: GenRequest) -> Job:
        try:
            return self.engine.admit(gen)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full", kind="server_busy",
                           headers={"Retry-After": "1"}) from None  # fmt: skip

    async def start(self, request: Request, job: Job) -> None:
        """Wait for a slot, before the answer begins: a client that hangs up meanwhile gives its place back,
        one that waits too long gets a 503."""
        start = asyncio.ensure_future(self.engine.start(job, self.limits.queue_timeout))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not start.done():
                start.cancel()
                self.engine.abandon(job)
        if start.cancelled() or not start.done():
            raise ClientGone()
        try:
            start.result()
        except QueueTimeout as e:
            raise ApiError(503, f"server busy: {e}; retry later", code="queue_timeout", kind="server_busy",
                           headers={"Retry-After": "5"}) from None  # fmt: skip

    async def collect(self, request: Request, job: Job) -> tuple[str, Event]:
        watcher = asyncio.create_task(self.watch(request, job))
        parts: list[str] = []
        try:
            async for ev in self.engine.events(job):
                if ev.kind == "text":
                    parts.append(ev.text)
                elif ev.kind == "error":
                    raise ApiError(500, ev.text, kind="server_error")
                else:
                    return "".join(parts), ev
        finally:
            watcher.cancel()
            self.engine.abandon(job)
        raise ClientGone()

    @staticmethod
    async def watch(request: Request, job: Job) -> None:
        await _disconnected(request)
        job.cancel.set()

    async def stream(self, job: Job, chunks: Chunks, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks, then [DONE]."""
        first = chunks.first()
        if first is not None:
            yield _sse(first)
        async for ev in self.engine.events(job):
            if ev.kind == "text":
                yield _sse(chunks.text(ev.text))
            elif ev.kind == "error":
                yield f"data: {json.dumps(ApiError(500, ev.text, kind='server_error').body())}\n\n"
                break
            else:
                yield _sse(chunks.finish(ev))
                if include_usage:
                    yield _sse(chunks.usage(ev))
        yield "data: [DONE]\n\n"
