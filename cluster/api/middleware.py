"""What stands between a client and the routes: errors answered in OpenAI's format
``{"error": {"message", "type", "param", "code"}}`` (every client mistake a 4xx whose message names the
field and the value; only our own faults are 5xx, with a generic message and the details in the log),
the body size limit (413), the API key (401), and the last-resort 500.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pdcluster.cluster.api.protocol import error_body, short

log = logging.getLogger(__name__)


class APIError(Exception):
    """A request we answer with an error status; ``message`` says what was wrong and with which value."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class BodyTooLarge(StarletteHTTPException):
    """Raised from the request's receive channel; FastAPI re-raises HTTPExceptions from body reading."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


def error_response(status: int, message: str, kind: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


# ================================================================================== exception handlers


def _param_name(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    name = ""
    for p in parts:
        name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else str(p))
    return name or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's errors, and the first bad field (OpenAI's ``param``)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first["loc"][-1] if first.get("loc") else "?"
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')} " \
               f"(at character {where})", None
    messages, seen = [], set()
    for e in errors:
        param = _param_name(tuple(e.get("loc", ())))
        if param is None:
            messages.append("request body must be a JSON object (send Content-Type: application/json)")
            continue
        if param in seen:  # a union reports each of its branches: one message per field is enough
            continue
        seen.add(param)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "missing":
            messages.append(f"{param}: field required")
        elif e.get("type") == "value_error":
            messages.append(f"{param}: {msg}")
        else:
            messages.append(f"{param}: {msg}, got {short(e.get('input'))}")
        if len(messages) == 3:
            break
    more = len({_param_name(tuple(e.get("loc", ()))) for e in errors}) - len(messages)
    text = "; ".join(messages) + (f" (and {more} more)" if more > 0 else "")
    return text, _param_name(tuple(first.get("loc", ())))


def install_error_handlers(app: FastAPI) -> None:
    """APIError, pydantic's validation errors and Starlette's 404/405/413 in OpenAI's error format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, code=exc.status_code, headers=exc.headers)


# ================================================================================== ASGI middleware


class CatchAllMiddleware:
    """An unexpected exception becomes a 500 with a generic message (details go to the log), answered
    here so the connection stays usable (Starlette's last-resort handler re-raises, and uvicorn then
    drops the connection)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out: the server has to drop the connection
            response = error_response(500, "internal server error (details are in the server log)")
            await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_body_bytes``: at once by Content-Length, else while it streams in."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            response = error_response(413, f"request body has {int(length)} bytes, more than the limit of "
                                           f"{limit} bytes", code="request_too_large")
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


# Besides /v1/*: they cost CPU (and a model's time) like any API call, or change what is served. Every route is one
# of these or of OPEN_PATHS (tests/test_api.py checks each route of a server with every feature on).
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/classify", "/pooling",
                   "/invocations", "/pause", "/resume", "/is_paused", "/update_weights_from_disk",
                   "/get_weight_version", "/weight_info", "/pause_generation", "/continue_generation",
                   # a trainer's weights (weight_routes.py): joining a process group and serving its tensors
                   "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                   # sleep mode (sleep_routes.py)
                   "/sleep", "/wake_up", "/is_sleeping", "/release_memory_occupation", "/resume_memory_occupation",
                   # SGLang's native routes (sglang_routes.py), as SGLang's --api-key guards them
                   "/generate", "/abort_request", "/flush_cache", "/reset_prefix_cache", "/get_model_info", "/model_info",
                   "/get_server_info", "/server_info", "/get_load",
                   # vLLM's tokens-in route and its abort (vllm_tokens.py, control_routes.py)
                   "/inference/v1/generate", "/abort_requests")


# Open with --api-key too: probes and what a load balancer or a KV-aware router polls (vLLM and SGLang leave them
# open), the docs.
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics", "/load", "/kv_event_sources", "/health_generate",
              "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on /v1/* and PROTECTED_PATHS; the rest (OPEN_PATHS) stays open."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and ((path := route_path(scope)).startswith("/v1") or path in PROTECTED_PATHS):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given
                           else "invalid API key in the Authorization header")
                response = error_response(401, message, code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def route_path(scope) -> str:
    """The path the routes match: behind --root-path uvicorn puts the prefix before it, and Starlette's routing takes it
    off (its get_route_path); the prefixed path would leave /v1/* open to anyone without the key."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):]
    return path


def install_middleware(app: FastAPI, max_body_bytes: int, api_key: str | None, cors=None) -> None:
    """The middleware stack, innermost first: catch-all 500, body limit, then (outermost, so no body is
    read without a key) the API key; around them all, with a ``cors`` policy (options.CorsPolicy), CORS: a
    browser's preflight carries no key, and a refusal must still carry the CORS headers for the page to read it."""
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
