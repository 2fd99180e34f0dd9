"""Two of vLLM's server flags about requests in flight, as ASGI middleware (a streamed response counts until its last
chunk is sent, which a per-route decorator would not see):

- ``--enable-server-load-tracking``: GET /load answers ``{"server_load": N}``, the generation and pooling requests
  this API process is answering now (a load balancer's signal, as vLLM's; 0 without the flag, as there). Each API
  process of ``--api-servers`` counts its own, as each of vLLM's does.
- ``--enable-request-id-headers``: every response carries ``X-Request-Id``: the client's (its X-Request-Id header,
  which also names the request in the engine), else a new one.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdcluster.cluster.api.middleware import route_path

# The routes vLLM counts (its load_aware_call): what makes the engine work.
LOADED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling",
                          "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                          "/invocations"})


class ServerLoad:
    """The count /load reports; the middleware below keeps it."""

    def __init__(self) -> None:
        self.num_requests = 0


class ServerLoadMiddleware:
    def __init__(self, app, load: ServerLoad):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in LOADED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.num_requests += 1
        try:  # the app returns once the response's last chunk went out, or the client left
            await self.app(scope, receive, send)
        finally:
            self.load.num_requests -= 1


class RequestIdHeaderMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_request_tracking(app: FastAPI, load_tracking: bool, request_id_headers: bool) -> None:
    """GET /load (always, as vLLM's: 0 unless ``load_tracking``), and the middleware the flags ask for. Installed
    outermost: a request refused by the key or the body limit still gets its X-Request-Id."""
    load = ServerLoad()

    @app.get("/load")
    async def server_load() -> JSONResponse:
        return JSONResponse({"server_load": load.num_requests})

    if load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
