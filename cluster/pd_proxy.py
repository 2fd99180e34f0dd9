"""The proxy of `pdcluster pd-proxy` (cli/pd_proxy.py): the proxy of vLLM's external prefill/decode split, for instances started with
``serve --kv-transfer-config`` (wire/external_kv.py). What vLLM's toy_proxy_server does, and what llm-d's routing
sidecar or Ray Serve LLM's PD app do in front of vLLM: each completion or chat request goes first to a prefill
instance (``max_tokens`` 1, not streamed, ``kv_transfer_params.do_remote_decode``), then, with that answer's
``kv_transfer_params``, to a decode instance, whose answer (streamed or not) is the client's. Instances are taken
in turn.

Where the prefill leg fails (the instance down, busy, or refusing a request it cannot split: n > 1, several
prompts, beam search), the decode instance serves the request whole: the client gets its answer (or the decode
instance's own 4xx), only without the split. A client's ``kv_transfer_params`` are the proxy's to set: refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

log = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
FORWARDED_HEADERS = ("authorization", "x-request-id")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": None, "code": None}}, status_code=status)


class PDProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("pd-proxy: give at least one --prefill and one --decode instance")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefills, self._decodes = itertools.cycle(self.prefill_urls), itertools.cycle(self.decode_urls)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.counters = {"split": 0, "whole": 0}

    async def prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill leg: its answer's kv_transfer_params, or None (the decode instance serves it whole)."""
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
        if "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        url = next(self._prefills)
        try:
            r = await self.http.post(f"{url}{path}", json=leg, headers=headers)
        except httpx.HTTPError as e:
            log.warning("pd-proxy: prefill instance %s: %s: %s; decoding whole", url, type(e).__name__, e)
            return None
        if r.status_code != 200:
            log.info("pd-proxy: prefill instance %s answered %d (%s); decoding whole", url, r.status_code,
                     r.text[:200])
            return None
        try:
            params = r.json().get("kv_transfer_params")
        except ValueError:
            return None
        return params if isinstance(params, dict) else None

    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params: set by the proxy; leave them out")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers.setdefault("x-request-id", uuid.uuid4().hex)  # one id on both legs, as vLLM's proxy
        params = await self.prefill(path, body, headers)
        self.counters["split" if params is not None else "whole"] += 1
        decode_body = {**body, "kv_transfer_params": params} if params is not None else body
        url = next(self._decodes)
        try:
            if not body.get("stream"):
                r = await self.http.post(f"{url}{path}", json=decode_body, headers=headers)
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            upstream = await self.http.send(self.http.build_request("POST", f"{url}{path}", json=decode_body,
                                                                    headers=headers), stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"decode instance {url}: {type(e).__name__}: {e}")
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"),
                                 background=BackgroundTask(upstream.aclose))


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> FastAPI:
    proxy = PDProxy(prefill_urls, decode_urls, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.http.aclose()

    app = FastAPI(title="pdcluster pd-proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            r = await proxy.http.get(f"{proxy.decode_urls[0]}/v1/models", headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"decode instance {proxy.decode_urls[0]}: {type(e).__name__}: {e}")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> dict:
        return {"prefill": proxy.prefill_urls, "decode": proxy.decode_urls, "requests": dict(proxy.counters)}

    return app
