"""Routes that act on the router's requests and the workers' caches, by SGLang's and vLLM's names; the router process
answers them for every API process (cluster/frontend/admin_proxy.py ``install_control_proxy``):

- SGLang's ``POST /abort_request`` ``{"rid": str, "abort_all": bool}``: ends /generate's request named ``rid`` (each of
  its samples: finish_reason ``{"type": "abort"}``), or with ``abort_all`` every request in flight, OpenAI's too;
- vLLM's ``POST /abort_requests`` ``{"request_ids": [...]}``: ends /inference/v1/generate's requests of those ids;
  both answer 200 ``{"num_aborted"}`` (0 when none matched: it may have finished);
- SGLang's ``GET|POST /flush_cache`` and vLLM's ``POST /reset_prefix_cache``: every worker forgets its cached prefixes
  (device pool and host / disk tiers); 200 when done, 400 while requests run (SGLang's rule: nothing changed then).

The router does the work: ``abort_matching`` (cluster/generation_control.py) over the router request ids the routes
give each request (fanout.named_prompt_id, matched by fanout.named_ids_pattern), ``flush_cache`` (cluster/local_router.py,
cluster/router/router.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.api import sglang_generate, vllm_tokens
from pdcluster.cluster.api.fanout import named_ids_pattern

# Routes the router process answers for every API process (the admin proxy forwards them), with their methods.
CONTROL_ROUTES = {"/abort_request": ("POST",), "/abort_requests": ("POST",), "/flush_cache": ("GET", "POST"),
                  "/reset_prefix_cache": ("POST",)}
MAX_ABORT_IDS = 1024


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's finished_reason / abort_message: the answer says "abort"

    rid: str = Field("", max_length=4096)
    abort_all: bool = False


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] = Field(max_length=MAX_ABORT_IDS)


def install_control_routes(app: FastAPI, router) -> None:
    """The routes on ``router`` (a LocalRouter or ClusterRouter: ``abort_matching``, ``flush_cache``)."""

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if not body.abort_all and not body.rid:
            return error_response(400, "give the rid of a /generate request, or abort_all true", param="rid")
        pattern = ".*" if body.abort_all else named_ids_pattern(sglang_generate.REQUEST_ID_PREFIX, body.rid)
        return {"num_aborted": await router.abort_matching(pattern)}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequests):
        if not body.request_ids:
            return {"num_aborted": 0}
        pattern = "|".join(f"(?:{named_ids_pattern(vllm_tokens.REQUEST_ID_PREFIX, request_id)})"
                           for request_id in body.request_ids)
        return {"num_aborted": await router.abort_matching(pattern)}

    async def flush():
        try:
            flushed = await router.flush_cache()
        except RouterError as e:
            return error_response(e.status, f"cache not flushed: {e}", kind=e.kind)
        if not flushed:
            return error_response(400, "cache not flushed: requests are running or waiting on a worker (flush when "
                                       "none is, e.g. after POST /pause)")
        return {"success": True, "message": "cache flushed"}

    app.add_api_route("/flush_cache", flush, methods=["GET", "POST"])
    app.add_api_route("/reset_prefix_cache", flush, methods=["POST"])  # vLLM's
