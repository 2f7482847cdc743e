"""Who may talk to the server, checked before any work: plain ASGI middleware (a BaseHTTPMiddleware would
pass every streamed chunk through one more queue).

- `Host` must name the address the server is bound to (localhost, 127.0.0.1, [::1] or the --host value, any
  port): a page on another site that rebinds its own DNS name to 127.0.0.1 sends its own name, and is refused.
- A browser's `Origin` must be the server's own, or one --cors-origin allows (then CORS is answered): a
  page on another site cannot use the API from its visitors' browsers.
- A request with a body must be `application/json`: a cross-site form or `text/plain` POST, which browsers
  send without asking, is refused.
- With an API key, /v1/ needs `Authorization: Bearer KEY`; /health answers its details only with it.
"""

from __future__ import annotations

import hmac
import ipaddress
import re

from .protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARDS = ("0.0.0.0", "::", "")  # every interface: the machine's names are not known, any Host is taken
_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\[\]]+)(?::\d{1,5})?$")
BODY_METHODS = (b"POST", b"PUT", b"PATCH", b"DELETE")
AUTHORIZED = "enlace.authorized"  # the scope key the handlers read: the request carried the API key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The names a request's Host may give, lower case and without the port; None: any (a wildcard bind)."""
    if bind in WILDCARDS:
        return None
    return frozenset({*LOOPBACK_NAMES, (f"[{bind}]" if ":" in bind else bind).lower()})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _shown(value: str) -> str:
    return repr(value[:100])


class OriginGuard:
    """The outer check: Host, then Origin."""

    def __init__(self, app, bind: str, cors_origins: tuple[str, ...] = ()):
        self.app, self.hosts = app, allowed_hosts(bind)
        self.cors = frozenset(o.rstrip("/").lower() for o in cors_origins)

    def refusal(self, scope) -> ApiError | None:
        host = _header(scope, b"host")
        if host is None:
            return ApiError(400, "no Host header", code="invalid_host")
        match = _HOST.match(host)
        if self.hosts is not None and (match is None or match.group(1).lower() not in self.hosts):
            names = ", ".join(sorted(self.hosts))
            return ApiError(
                421, f"Host {_shown(host)} is not a name of this server ({names})", code="invalid_host"
            )
        origin = _header(scope, b"origin")
        if origin is None:  # not a browser, or a same-origin GET
            return None
        origin = origin.rstrip("/").lower()
        if origin in (f"http://{host.lower()}", f"https://{host.lower()}") or origin in self.cors:
            return None
        return ApiError(403, f"Origin {_shown(origin)} is not allowed (the server's own origin is; others need "
                        "--cors-origin)", code="forbidden_origin")  # fmt: skip

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (error := self.refusal(scope)) is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestGuard:
    """The inner check, after CORS preflights are answered: the body's type, then the API key."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    def has_key(self, scope) -> bool:
        if self.key is None:
            return True
        scheme, _, token = (_header(scope, b"authorization") or "").encode("latin-1").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def refusal(self, scope) -> ApiError | None:
        has_body = scope["method"].encode() in BODY_METHODS or _header(scope, b"content-length") not in (
            None,
            "0",
        )
        if has_body or _header(scope, b"transfer-encoding") is not None:
            media, _, params = (_header(scope, b"content-type") or "").partition(";")
            charset = params.strip().lower().replace(" ", "")
            if media.strip().lower() != "application/json" or charset not in ("", "charset=utf-8"):
                return ApiError(415, "a request body must be sent as Content-Type: application/json",
                                code="unsupported_media_type")  # fmt: skip
        if scope["path"].startswith("/v1/") and not scope[AUTHORIZED]:
            return ApiError(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                            code="invalid_api_key")  # fmt: skip
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[AUTHORIZED] = self.has_key(scope)
            if (error := self.refusal(scope)) is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
