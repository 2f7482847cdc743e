"""The HTTP side: OpenAI's chat and completion endpoints (plain JSON or server-sent events), the model list,
health, and the chat page. Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a
4xx status for anything the client sent wrong; the server keeps serving whatever a request holds.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Event, GenRequest, Job, QueueFull
from .schema import ChatRequest, CompletionRequest, Sampling

MAX_BODY_BYTES = 1 << 20  # a prompt of the largest context this project serves is well under 100 kB


@dataclass
class Limits:
    max_prompt_tokens: int = 2048  # capped at the model's context less one token
    max_tokens: int = 512
    max_body_bytes: int = MAX_BODY_BYTES


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _find_surrogate(obj: Any, path: str = "") -> str | None:
    """Where a string holds a lone surrogate (JSON's "\\ud800" escapes allow them; UTF-8 does not)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path or 'body'}: not valid Unicode (a lone surrogate at character {e.start})"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = _find_surrogate(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, or an ApiError naming what is wrong with it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large"
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {e.start}: {e.reason})", code="invalid_utf8"
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ApiError(
            400,
            f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
            code="invalid_json",
        ) from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(
            400, f"request body must be a JSON object, not {type(obj).__name__}", code="invalid_json"
        )
    bad = _find_surrogate(obj)
    if bad:
        param = bad.split(":")[0]
        raise ApiError(400, bad, param=param, code="invalid_unicode")
    return obj


def parse(model_cls: type[Sampling], obj: dict[str, Any]) -> Any:
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        message = err["msg"]
        if err["type"] == "missing":
            message = "required"
        elif err["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        raise ApiError(
            400, f"{param}: {message}" if param else message, param=param, code="invalid_value"
        ) from None


class _JobStream(StreamingResponse):
    """A streamed answer that gives its job's queue place back even if the client left before the first
    byte (then the body is never iterated, and its own cleanup never runs)."""

    def __init__(self, engine: Engine, job: Job, body: AsyncIterator[str], **kw: Any):
        super().__init__(body, **kw)
        self.engine, self.job = engine, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.abandon(self.job)


def _chat_sampling() -> dict[str, Any]:
    from ..finetune.chat import CHAT_SAMPLING

    return CHAT_SAMPLING


def create_app(engine: Engine, limits: Limits | None = None, api_key: str | None = None) -> FastAPI:
    limits = limits or Limits()
    served = engine.served
    context = served.context
    max_prompt = max(1, min(limits.max_prompt_tokens, context - 1))
    created = int(time.time())
    app = FastAPI(title="enlace serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # The page and health stay open; the API needs the key when one is set.
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            ):
                return ApiError(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                                code="invalid_api_key").response()  # fmt: skip
        return await call_next(request)

    def model_card() -> dict[str, Any]:
        return {
            "id": served.name, "object": "model", "created": created, "owned_by": "enlace",
            # Not OpenAI's: what the chat page and scripts need to know about the model.
            "context_length": context, "chat": served.encode_chat is not None, "weights": served.weights,
        }  # fmt: skip

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise ApiError(404, f"model {name!r} not found; this server serves {served.name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    def gen_request(req: Sampling, prompt_ids: list[int], prompt_param: str) -> GenRequest:
        if not prompt_ids:
            raise ApiError(
                400, f"{prompt_param}: the prompt is empty", param=prompt_param, code="empty_prompt"
            )
        if len(prompt_ids) > max_prompt:
            raise ApiError(400, f"{prompt_param}: the prompt is {len(prompt_ids)} tokens; this server takes at most "
                           f"{max_prompt}", param=prompt_param, code="context_length_exceeded")  # fmt: skip
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
            ignore_eos=req.ignore_eos,
        )  # fmt: skip

    def admit(gen: GenRequest) -> Job:
        try:
            return engine.admit(gen)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full", kind="server_busy",
                           headers={"Retry-After": "1"}) from None  # fmt: skip

    async def watch_disconnect(request: Request, job: Job) -> None:
        # The body has been read, so the next message is the client going away (or the response ending).
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel.set()
                return

    async def collect(request: Request, job: Job) -> tuple[str, Event]:
        watcher = asyncio.create_task(watch_disconnect(request, job))
        parts: list[str] = []
        try:
            async for ev in engine.events(job):
                if ev.kind == "text":
                    parts.append(ev.text)
                elif ev.kind == "error":
                    raise ApiError(500, ev.text, kind="server_error")
                else:
                    return "".join(parts), ev
        finally:
            watcher.cancel()
            engine.abandon(job)
        return "".join(parts), Event("done", finish_reason="cancelled")

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(job: Job, chunk, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: chunk(text=..., finish=..., extra=...) makes each OpenAI chunk."""
        first = chunk(text="", first=True)
        if first is not None:
            yield sse(first)
        async for ev in engine.events(job):
            if ev.kind == "text":
                yield sse(chunk(text=ev.text))
            elif ev.kind == "error":
                yield sse(ApiError(500, ev.text, kind="server_error").body())
                break
            else:
                yield sse(chunk(finish=ev.finish_reason, extra={"usage": ev.usage, "timings": ev.timings}))
                if include_usage:
                    yield sse(chunk(usage_only=ev.usage))
        yield "data: [DONE]\n\n"

    def streaming(job: Job, body: AsyncIterator[str]) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return _JobStream(engine, job, body, media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await read_json(request, limits.max_body_bytes))
        check_model(req.model)
        if served.encode_chat is None:
            raise ApiError(400, f"model {served.name!r} has no chat template (a pretraining run): use /v1/completions",
                           param="messages", code="no_chat_template")  # fmt: skip
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
        ]
        if not any(m["role"] == "user" for m in messages):
            raise ApiError(400, "messages: no user message", param="messages", code="invalid_value")
        try:
            prompt_ids = served.encode_chat(messages)
        except Exception as e:  # the model's own template refusing an order of roles (raise_exception)
            raise ApiError(400, f"messages: the model's chat template refused them: {e}", param="messages",
                           code="invalid_value") from None  # fmt: skip
        job = admit(gen_request(req, prompt_ids, "messages"))
        cid, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(text="", first=False, finish=None, extra=None, usage_only=None):
            base = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": served.name,
                    "system_fingerprint": None}  # fmt: skip
            if usage_only is not None:
                return {**base, "choices": [], "usage": usage_only}
            delta = (
                {"role": "assistant", "content": ""} if first else {"content": text} if finish is None else {}
            )
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    **(extra or {})}  # fmt: skip

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return streaming(job, stream(job, chunk, include))
        text, done = await collect(request, job)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": now, "model": served.name, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": done.finish_reason}],
            "usage": done.usage, "timings": done.timings,
        })  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await read_json(request, limits.max_body_bytes))
        check_model(req.model)
        prompt = req.prompt_value()
        if isinstance(prompt, str):
            prompt_ids = served.encode_text(prompt) if prompt else []
        else:
            vocab = served.model.cfg.vocab_size
            bad = next((i for i, t in enumerate(prompt) if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt.{bad}: token id {prompt[bad]} is outside the vocabulary (0-{vocab - 1})",
                               param="prompt", code="invalid_value")  # fmt: skip
            prompt_ids = list(prompt)
        job = admit(gen_request(req, prompt_ids, "prompt"))
        cid, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(text="", first=False, finish=None, extra=None, usage_only=None):
            base = {"id": cid, "object": "text_completion", "created": now, "model": served.name,
                    "system_fingerprint": None}  # fmt: skip
            if first:
                return None
            if usage_only is not None:
                return {**base, "choices": [], "usage": usage_only}
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                    **(extra or {})}  # fmt: skip

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return streaming(job, stream(job, chunk, include))
        text, done = await collect(request, job)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": now, "model": served.name, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": done.usage, "timings": done.timings,
        })  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.name, **engine.status()}

    page = resources.files("enlace.serve").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    return app
