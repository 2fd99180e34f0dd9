"""SGLang's native routes, beside the OpenAI ones, for the clients written against SGLang's server (RL rollout loops
such as slime and verl's server mode, SGLang's own benchmarks and router):

- ``POST /generate``: text or token ids in, text, token ids and logprobs out (cluster/api/sglang_generate.py);
- ``POST /abort_request``, ``GET|POST /flush_cache``: cluster/api/control_routes.py (with vLLM's
  ``/abort_requests`` and ``/reset_prefix_cache``);
- ``GET /get_model_info`` (``/model_info``), ``GET /get_server_info`` (``/server_info``): what is served, in SGLang's
  keys where they have a meaning here;
- ``GET /health_generate``: 200 once a one-token greedy generation came back within HEALTH_GENERATE_TIMEOUT_S, else
  503 saying why (SGLang's deep health check).

With ``--api-key`` every one but /health_generate needs it (middleware.PROTECTED_PATHS).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.cluster.api.images import image_spec
from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.control_routes import install_control_routes
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.api.sglang_generate import serve_generate
from pdcluster.cluster.api.sglang_protocol import GenerateRequest
from pdcluster.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's


def load_entry(stats: dict) -> dict:
    """SGLang's /get_load entry of a router's stats (cluster/api/router_contract.py's ``stats()``)."""
    running, waiting = int(stats.get("num_requests_running", 0)), int(stats.get("num_requests_waiting", 0))
    pool_tokens = int(stats.get("num_gpu_blocks", 0)) * int(stats.get("block_size", 0))
    used_tokens = round(float(stats.get("kv_cache_usage_perc", 0.0)) * pool_tokens)
    queued_tokens = sum(int(w.get("queued_prefill_tokens") or 0) for w in stats.get("workers", []))
    return {"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
            "num_tokens": used_tokens + queued_tokens, "num_pending_tokens": queued_tokens,
            "ts_tic": time.perf_counter()}


def _model_config(tokenizer) -> dict:
    path = getattr(tokenizer, "model_dir", None)
    try:
        return json.loads((Path(path) / "config.json").read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def install_sglang_routes(app: FastAPI, router, served_names: tuple[str, ...], policy, metrics, strings,
                          generates: bool, version: str, router_control: bool = True) -> None:
    """SGLang's routes on ``app`` over ``router``; ``generates``: the model generates (not an embedding model);
    ``router_control``: the aborts and the flushes (control_routes.py) answered here (an API process behind a router
    process forwards them instead)."""
    config = _model_config(router.tokenizer)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if not generates:
            return error_response(400, f"the model {served_names[0]!r} does not generate: POST /v1/embeddings",
                                  code="unsupported_model")
        return await serve_generate(body, request, router, served_names, policy, metrics, strings)

    def weight_version() -> str:
        # A RemoteRouter (an API process) knows it from the router process's stats: as of the last (every
        # frontend.protocol.STATS_INTERVAL_S). Answers' meta_info carry the exact one; /get_weight_version is forwarded.
        version = getattr(router, "weight_version", None)
        return version or (router.stats().get("weights") or {}).get("weight_version") or "default"

    async def model_info():
        return {"model_path": router.model_name, "tokenizer_path": str(getattr(router.tokenizer, "model_dir", "")),
                "served_model_name": served_names[0], "is_generation": generates,
                "preferred_sampling_params": None, "weight_version": weight_version(),
                "has_image_understanding": image_spec(router.tokenizer) is not None,
                "has_audio_understanding": False, "model_type": config.get("model_type"),
                "architectures": config.get("architectures"), "max_model_len": router.max_model_len}

    async def server_info():
        try:
            stats = router.stats()
        except Exception as e:  # noqa: BLE001 - say what is known
            stats = {"error": f"router stats failed: {e!r}"}
        return {"model_path": router.model_name, "served_model_name": served_names[0],
                "context_length": router.max_model_len, "version": version, "weight_version": weight_version(),
                "lora_paths": list(router.lora_names), "internal_states": [stats]}

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report, which its router's power-of-two and cache-aware policies poll (sglang-router's
        worker load probe): one entry, as this whole server is one rank to that router. ``num_tokens``: the KV tokens
        in use plus the prompt tokens queued for prefill, SGLang's measure of a server's load."""
        try:
            stats = router.stats()
        except Exception as e:  # noqa: BLE001 - a router that cannot say is not "idle"
            return error_response(503, f"router stats failed: {e!r}", kind="server_error")
        return [load_entry(stats)]

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.get("/health_generate")
    async def health_generate():
        if not generates:
            return JSONResponse({"status": "ok"})
        request_id = f"health-generate-{uuid.uuid4().hex}"
        prompt = router.tokenizer.encode("Hello") or [0]
        stream = router.generate(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        try:
            async def first_token() -> None:
                async for delta in stream:
                    if delta.finished:
                        if delta.finish_reason == "error":
                            raise RouterError(delta.error or "generation failed")
                        return
            await asyncio.wait_for(first_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(503, f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s", kind="server_error")
        except RouterError as e:
            return error_response(503, f"generation failed: {e}", kind="server_error")
        finally:
            await stream.aclose()  # leaving the stream unfinished aborts the request
        return JSONResponse({"status": "ok"})

    if router_control:
        install_control_routes(app, router)
