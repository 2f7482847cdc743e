"""The HTTP side, wired: the routes to the handlers of handlers.py, the guards of guard.py around them, and
OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every refusal. A client's mistake
is a 4xx; a bug is a 500 with a generic message (the details go to the server's log); the server keeps
serving whatever a request holds. /openapi.json describes every endpoint (the request bodies as schema.py
validates them), which the tests' fuzzer reads.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine
from .guard import OriginGuard, RequestGuard
from .handlers import Limits, Serving
from .protocol import ApiError, ClientGone
from .schema import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)  # fmt: skip

__all__ = ["ApiError", "Limits", "create_app"]
log = logging.getLogger("enlace.serve")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 503)
}


def _body(model) -> dict[str, Any]:
    """The OpenAPI description of a JSON request body (FastAPI does not read it: protocol.py does)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the request bodies' nested models moved where their references point."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path in doc["paths"].values():
            for op in path.values():
                body = (
                    op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
                )
                schemas.update(body.pop("$defs", {}))
        app.openapi_schema = doc
    return app.openapi_schema


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(
            status_code=499
        )  # nobody reads it; the access log shows the client left (nginx's 499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return ApiError(
            500, "internal server error (the server's log has the details)", kind="server_error"
        ).response()


def create_app(engine: Engine, limits: Limits | None = None, api_key: str | None = None, host: str = "127.0.0.1",
               cors_origins: tuple[str, ...] = ()) -> FastAPI:  # fmt: skip
    """The app: routes to one Serving's handlers, behind the guards (outermost first: Host and Origin, CORS
    for the origins allowed, the body's type and the API key)."""
    serving = Serving(engine, limits or Limits())
    app = FastAPI(title="enlace serve", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    _handle_errors(app)
    app.add_middleware(RequestGuard, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)  # fmt: skip
    app.add_middleware(OriginGuard, bind=host, cors_origins=cors_origins)

    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"], response_model=ChatCompletion,
                      responses=_ERRORS, openapi_extra=_body(ChatRequest))  # fmt: skip
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"], response_model=Completion,
                      responses=_ERRORS, openapi_extra=_body(CompletionRequest))  # fmt: skip
    app.add_api_route("/v1/models", serving.models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/v1/models/{name:path}", serving.model, methods=["GET"], response_model=ModelCard,
                      responses=_ERRORS)  # fmt: skip
    app.add_api_route("/health", serving.health, methods=["GET"], response_model=Health, responses=_ERRORS)
    app.add_api_route("/", serving.chat_page, methods=["GET"], response_class=HTMLResponse)
    return app
