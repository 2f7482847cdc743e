"""One handler per endpoint, in the shape of vLLM's OpenAI entrypoint: `Serving` holds what every request
needs (the engine, the limits), each method answers one endpoint with the typed models of schema.py.

A generation request goes: read and validate the body (protocol.py), encode the prompt in a worker thread,
check its length, take a place in the queue (429 at once if there is none), wait for a slot (503 past the
queue deadline), then stream or collect the engine's events.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    Health,
    HealthBrief,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Sampling,
    TextChoice,
    Timings,
    TokenLogprob,
    TopLogprob,
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


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _sse(model: BaseModel, null_usage: bool = False) -> str:
    """One server-sent event; null_usage: `"usage": null` where there is none (stream_options.include_usage)."""
    body = model.model_dump(mode="json")
    if null_usage:
        body.setdefault("usage", None)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


_MARK = "\ue000"  # a private-use character: where a text piece goes in a chunk's template


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chat_logprobs(entries: list[dict[str, Any]] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    content = [
        TokenLogprob(token=e["token"], logprob=e["logprob"], bytes=_bytes(e["token"]),
                     top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=_bytes(t)) for t, lp in e["top"]])
        for e in entries
    ]  # fmt: skip
    return ChoiceLogprobs(content=content)


def _text_logprobs(entries: list[dict[str, Any]] | None, offset: int = 0) -> CompletionLogprobs | None:
    if entries is None:
        return None
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return CompletionLogprobs(tokens=[e["token"] for e in entries], token_logprobs=[e["logprob"] for e in entries],
                              top_logprobs=[dict(e["top"]) for e in entries], text_offset=offsets)  # fmt: skip


@dataclass
class Choice:
    """One choice of an answer, as collected: its text, its end, its logprob entries."""

    text: str
    done: Event
    logprobs: list[dict[str, Any]] | None


def _usage(choices: list[Choice]) -> Usage:
    """The prompt once, every choice's new tokens."""
    prompt = choices[0].done.usage["prompt_tokens"]
    new = sum(c.done.usage["completion_tokens"] for c in choices)
    # The prompt counted once: as cached as its least cached copy (the first choice prefilled it).
    cached = min(c.done.usage["prompt_tokens_details"]["cached_tokens"] for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=new, total_tokens=prompt + new,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))  # fmt: skip


class _Chunks:
    """What both endpoints' answers share: the id, and a text chunk's template (made once: a chunk per token
    is then one string join, not a pydantic model and its serialiser)."""

    prefix = ""

    def __init__(self, model: str):
        self.base = {
            "id": f"{self.prefix}-{secrets.token_hex(12)}",
            "created": int(time.time()),
            "model": model,
        }
        self.templates: dict[tuple[int, bool], tuple[str, str]] = {}

    def text_sse(self, text: str, index: int, null_usage: bool) -> str:
        key = (index, null_usage)
        if key not in self.templates:
            before, _, after = _sse(self.text(_MARK, index), null_usage).partition(
                json.dumps(_MARK, ensure_ascii=False)
            )
            self.templates[key] = (before, after)
        before, after = self.templates[key]
        return before + json.dumps(text, ensure_ascii=False) + after

    def text(self, text: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None) -> BaseModel:
        raise NotImplementedError


class _ChatChunks(_Chunks):
    """The pieces of one chat answer, whole or streamed."""

    prefix = "chatcmpl"

    def first(self, index: int = 0) -> ChatCompletionChunk | None:
        return ChatCompletionChunk(
            **self.base, choices=[ChunkChoice(index=index, delta=Delta(role="assistant", content=""))]
        )

    def text(
        self, text: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None
    ) -> ChatCompletionChunk:
        choice = ChunkChoice(index=index, delta=Delta(content=text), logprobs=_chat_logprobs(logprobs))
        return ChatCompletionChunk(**self.base, choices=[choice])

    def finish(self, ev: Event, index: int, with_usage: bool) -> ChatCompletionChunk:
        choice = ChunkChoice(index=index, delta=Delta(), finish_reason=ev.finish_reason)
        return ChatCompletionChunk(**self.base, choices=[choice], usage=Usage(**ev.usage) if with_usage else None,
                                   timings=Timings(**ev.timings))  # fmt: skip

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.base, choices=[], usage=usage)

    def whole(self, choices: list[Choice]) -> ChatCompletion:
        out = [ChatChoice(index=i, message=AssistantMessage(content=c.text), logprobs=_chat_logprobs(c.logprobs),
                          finish_reason=c.done.finish_reason) for i, c in enumerate(choices)]  # fmt: skip
        return ChatCompletion(
            **self.base, choices=out, usage=_usage(choices), timings=Timings(**choices[0].done.timings)
        )


class _TextChunks(_Chunks):
    """The pieces of one /v1/completions answer, whole or streamed (one object for both, as OpenAI's)."""

    prefix = "cmpl"

    def first(self, index: int = 0) -> Completion | None:
        return None  # a completion stream starts with its first text

    def text(self, text: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None) -> Completion:
        return Completion(
            **self.base, choices=[TextChoice(index=index, text=text, logprobs=_text_logprobs(logprobs))]
        )

    def finish(self, ev: Event, index: int, with_usage: bool) -> Completion:
        choice = TextChoice(index=index, text="", finish_reason=ev.finish_reason)
        return Completion(**self.base, choices=[choice], usage=Usage(**ev.usage) if with_usage else None,
                          timings=Timings(**ev.timings))  # fmt: skip

    def usage(self, usage: Usage) -> Completion:
        return Completion(**self.base, choices=[], usage=usage)

    def whole(self, choices: list[Choice]) -> Completion:
        out = [TextChoice(index=i, text=c.text, logprobs=_text_logprobs(c.logprobs), finish_reason=c.done.finish_reason)
               for i, c in enumerate(choices)]  # fmt: skip
        return Completion(
            **self.base, choices=out, usage=_usage(choices), timings=Timings(**choices[0].done.timings)
        )


Chunks = _ChatChunks | _TextChunks


class _JobStream(StreamingResponse):
    """A streamed answer that gives its jobs back even if the client left before the first byte (then the
    body is never iterated, and its own cleanup never runs)."""

    def __init__(self, engine: Engine, jobs: list[Job], body: AsyncIterator[str], **kw: Any):
        super().__init__(body, **kw)
        self.engine, self.jobs = engine, jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                self.engine.abandon(job)


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
                         chat=s.encode_chat is not None, weights=s.weights, answers=s.source)  # fmt: skip

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
        defaults = self.served.sampling
        pick = lambda name: getattr(req, name) if getattr(req, name) is not None else defaults[name]  # noqa: E731
        return GenRequest(
            prompt_ids=prompt_ids, max_tokens=req.max_tokens or min(limits.max_tokens, room),
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            repetition_penalty=pick("repetition_penalty"), no_repeat_ngram=pick("no_repeat_ngram"),
            seed=req.seed if req.seed is not None else secrets.randbits(32), stop=req.stops(),
            ignore_eos=bool(req.ignore_eos), logprobs=req.top_logprobs_asked(),
        )  # fmt: skip

    async def answer(
        self, request: Request, req: Sampling, prompt_ids: list[int], param: str, chunks: Chunks
    ) -> Response:
        n = req.n or 1
        if n > self.engine.slots:
            raise ApiError(400, f"n: {n} choices need as many generation slots; this server has {self.engine.slots}",
                           param="n", code="invalid_value")  # fmt: skip
        gen = self.gen_request(req, prompt_ids, param)
        # Choice i samples with seed + i: the same request gives the same choices, and no two alike.
        jobs: list[Job] = []
        try:
            for i in range(n):
                jobs.append(self.admit(dataclasses.replace(gen, seed=(gen.seed + i) % 2**63)))
            for job in jobs:
                await self.start(request, job)
        except BaseException:
            for job in jobs:
                self.engine.abandon(job)
            raise
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            body = self.stream(jobs, chunks, include)
            return _JobStream(self.engine, jobs, body, media_type="text/event-stream", headers=headers)
        watcher = asyncio.create_task(self.watch(request, jobs))
        try:
            choices = await asyncio.gather(*(self.collect(job) for job in jobs))
        finally:
            watcher.cancel()
            for job in jobs:
                self.engine.abandon(job)
        return _json(chunks.whole(list(choices)))

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

    async def collect(self, job: Job) -> Choice:
        parts: list[str] = []
        logprobs: list[dict[str, Any]] | None = [] if job.req.logprobs is not None else None
        async for ev in self.engine.events(job):
            if ev.kind == "text":
                parts.append(ev.text)
                if logprobs is not None and ev.logprobs:
                    logprobs.extend(ev.logprobs)
            elif ev.kind == "error":
                raise ApiError(500, ev.text, kind="server_error")
            else:
                return Choice("".join(parts), ev, logprobs)
        raise ClientGone()

    @staticmethod
    async def watch(request: Request, jobs: list[Job]) -> None:
        await _disconnected(request)
        for job in jobs:
            job.cancel.set()

    async def stream(self, jobs: list[Job], chunks: Chunks, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: OpenAI's chunks (each choice's with its index), then [DONE]. With
        include_usage every chunk has `"usage": null` and a last one, without choices, the usage."""
        merged: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            async for ev in self.engine.events(job):
                merged.put_nowait((i, ev))

        pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            for i in range(len(jobs)):
                first = chunks.first(i)
                if first is not None:
                    yield _sse(first, include_usage)
            ended: list[Choice] = []
            while len(ended) < len(jobs):
                i, ev = await merged.get()
                if ev.kind == "text":
                    if ev.logprobs is None:
                        yield chunks.text_sse(ev.text, i, include_usage)
                    else:
                        yield _sse(chunks.text(ev.text, i, ev.logprobs), include_usage)
                elif ev.kind == "error":
                    yield f"data: {json.dumps(ApiError(500, ev.text, kind='server_error').body())}\n\n"
                    break
                else:
                    ended.append(Choice("", ev, None))
                    yield _sse(
                        chunks.finish(ev, i, with_usage=not include_usage and len(jobs) == 1), include_usage
                    )
            else:
                if include_usage:
                    yield _sse(chunks.usage(_usage(ended)))
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
