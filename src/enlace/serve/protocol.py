"""Reading a request: OpenAI's error shape, the body under a size limit and a deadline, and its checks.

The cheap checks (the declared size, the bytes as they arrive, their deadline) run on the event loop; the
costly ones (decoding the JSON, walking it, validating it against the schema) run in a worker thread, so a
large or hostile body never holds up the other requests' streams.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .schema import MAX_MESSAGES, MAX_PROMPT_IDS

# A union's branch names in pydantic's error locations ("stop.constrained-str"): not what the client sent.
_BRANCH = re.compile(r"^(constrained-)?(str|int|float|bool|dict)$|\[")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
MAX_DEPTH = 10  # the deepest body the schema describes is 5 levels (body, messages, message, content, part)


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


class ClientGone(Exception):
    """The client hung up before its answer began: nobody reads what the server would send."""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _bad_unicode(text: str, where: str) -> ApiError | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        message = f"{where}: not valid Unicode (a lone surrogate at character {e.start})"
        return ApiError(400, message, param=where, code="invalid_unicode")
    return None


def check_tree(obj: Any, strings: bool = True) -> None:
    """Refuse a body nested deeper than MAX_DEPTH, or (with `strings`) holding a lone surrogate in a key or
    string (JSON's "\\ud800" escapes allow them; UTF-8 does not). Walked without recursion: depth costs no
    stack."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if not strings:
                continue
            if (bad := _bad_unicode(node, path or "body")) is not None:
                raise bad
            continue
        if not isinstance(node, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise ApiError(400, f"{path or 'body'}: JSON nested more than {MAX_DEPTH} levels deep",
                           param=path or None, code="too_deep")  # fmt: skip
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if strings and (bad := _bad_unicode(str(key), f"{path or 'body'} (a key)")) is not None:
                raise bad
            stack.append((value, f"{path}.{key}" if path else str(key), depth + 1))


def decode_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an ApiError naming what is wrong with it (runs in a worker thread)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {e.start}: {e.reason})", code="invalid_utf8"
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None  # fmt: skip
    except RecursionError:
        raise ApiError(
            400, f"request body: JSON nested more than {MAX_DEPTH} levels deep", code="too_deep"
        ) from None
    except ValueError as e:  # NaN, Infinity, an integer of more digits than Python converts
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(
            400, f"request body must be a JSON object, not {type(obj).__name__}", code="invalid_json"
        )
    # The long lists first, by their length alone: 30,000 messages are refused before anything walks them.
    for field, limit in (("messages", MAX_MESSAGES), ("prompt", MAX_PROMPT_IDS)):
        value = obj.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise ApiError(400, f"{field}: at most {limit} items, not {len(value)}", param=field,
                           code="invalid_value")  # fmt: skip
    # A lone surrogate can only come from a \ud800-\udfff escape (UTF-8 cannot carry one): without such an
    # escape in the text, no string needs checking.
    check_tree(obj, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return obj


def validate(model_cls: type[BaseModel], obj: dict[str, Any]) -> Any:
    """The body as `model_cls`, or an ApiError naming the first field at fault (all unknown ones at once)."""
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
    unknown = [".".join(str(x) for x in err["loc"]) for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        raise ApiError(400, f"unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: this "
                       "server does not act on them", param=unknown[0], code="unsupported_parameter")  # fmt: skip
    err = errors[0]
    param = ".".join(str(x) for x in err["loc"] if not _BRANCH.search(str(x))) or None
    message, code = err["msg"], "invalid_value"
    if err["type"] == "missing":
        message = "required"
    elif err["type"] == "value_error":
        message = message.removeprefix("Value error, ")
    elif err["type"] == "unsupported":
        code = "unsupported_parameter"
    raise ApiError(400, f"{param}: {message}" if param else message, param=param, code=code) from None


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body's bytes: 413 past `limit` (declared or sent), 408 when it takes longer than `timeout`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large"
        )
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s", code="body_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


async def read_request(request: Request, model_cls: type[BaseModel], limit: int, timeout: float) -> Any:
    body = await read_body(request, limit, timeout)

    def check() -> Any:
        return validate(model_cls, decode_json(body))

    return await asyncio.to_thread(check)
