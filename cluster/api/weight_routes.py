"""Routes an RL trainer drives between rollouts, on a server started with ``--enable-weight-updates`` (or vLLM's
VLLM_SERVER_DEV_MODE=1, which serves vLLM's): vLLM's pause routes and SGLang's weight update from disk.

- ``POST /pause?mode=abort|wait`` (vLLM's; ``clear_cache`` accepted: KV of old weights never matches anyway): no
  request starts from the answer on; ``abort`` ends those in flight (finish_reason "abort"), ``wait`` lets them
  finish; answers once none is left. ``mode=keep`` is refused (400): a request never runs on two sets of weights.
  ``timeout_s`` (ours; default 600) bounds the wait: 504 when requests outlast it (generation stays paused).
- ``POST /resume``; ``GET /is_paused`` -> ``{"is_paused": bool}``. Requests sent while paused wait (up to the
  server's request timeout), as vLLM's.
- ``POST /update_weights_from_disk`` (SGLang's) ``{"model_path": DIR, "weight_version": NAME?,
  "abort_all_requests": false, "load_format": null|"auto"|"safetensors", "flush_cache": true, "timeout_s": 600}``:
  every worker serves the checkpoint in DIR (a path on the workers' machines, or a Hub id) from the answer on; the
  requests in flight finish first (or are aborted). 200 ``{"success": true, "message", "num_paused_requests",
  "weight_version", "workers": [...]}``; 400 ``{"success": false, "message"}`` when it does not fit (another
  architecture, a version name used before), nothing changed.
- SGLang's weight update from a trainer's process group (cluster/weights_from_trainer.py): ``POST
  /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset", "world_size", "group_name":
  "weight_update_group", "backend": "gloo"}`` joins the trainer's group (this server receives as one rank: its router
  process); ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name", "weight_version"?,
  "abort_all_requests": false, "flush_cache": true}`` takes the tensors the trainer broadcasts (Hugging Face names and
  shapes of the served checkpoint), served from the answer on, or, while generation is paused, from the resume (the
  buckets of one version together); ``POST /destroy_weights_update_group`` ``{"group_name"}``. Answers as SGLang's:
  ``{"success", "message"}``, 400 with ``success`` false when refused.
- ``GET /get_weight_version`` (SGLang's) and ``GET /weight_info`` (vLLM's) -> ``{"weight_version": NAME}``
  ("default" until an update).
- SGLang's ``POST /pause_generation`` ``{"mode": "abort"}`` and ``POST /continue_generation``: /pause?mode=abort and
  /resume under SGLang's names. Its modes "retract" and "in_place" keep requests across the pause (to go on under
  the new weights): refused (400), as vLLM's keep.

With ``--api-key`` they need it (middleware.PROTECTED_PATHS). The router does the work
(cluster/generation_control.py); behind several API processes the router process answers them
(cluster/frontend/admin_proxy.py ``install_weight_routes_proxy``).
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.generation_control import DEFAULT_DRAIN_TIMEOUT_S
from pdcluster.cluster.weights_from_trainer import DEFAULT_GROUP_NAME, JOIN_TIMEOUT_S

WEIGHT_ROUTES = {"/pause": "POST", "/resume": "POST", "/is_paused": "GET", "/update_weights_from_disk": "POST",
                 "/get_weight_version": "GET", "/weight_info": "GET", "/pause_generation": "POST",
                 "/continue_generation": "POST", "/init_weights_update_group": "POST",
                 "/update_weights_from_distributed": "POST", "/destroy_weights_update_group": "POST"}
MAX_TIMEOUT_S = 24 * 3600.0


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, max_length=4096)
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    load_format: Literal["auto", "safetensors"] | None = None  # SGLang's; safetensors is what is read here
    flush_cache: bool = True  # SGLang's; KV of the old weights never matches a request under the new ones
    timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)


class InitWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=1 << 16)
    group_name: str = Field(DEFAULT_GROUP_NAME, min_length=1, max_length=256)
    backend: str = "nccl"  # SGLang's default: refused here with the reason (the receiving rank has no GPU)
    timeout_s: float = Field(JOIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)  # ours: the rendezvous and each broadcast


class UpdateWeightsFromDistributedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(DEFAULT_GROUP_NAME, min_length=1, max_length=256)
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    flush_cache: bool = True  # SGLang's; KV of the old weights never matches a request under the new ones
    load_format: Literal["auto"] | None = None  # SGLang's "flattened_bucket" (one buffer per call) is not read here
    torch_empty_cache: bool = False  # SGLang's; nothing to empty on a CPU
    timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_name: str = Field(DEFAULT_GROUP_NAME, min_length=1, max_length=256)


class PauseGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "retract", "in_place"] = "abort"  # SGLang's modes
    timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)


def install_weight_routes(app: FastAPI, router, staging_dir: str = "") -> None:
    """``router``: a WeightControl (cluster/api/router_contract.py): a LocalRouter or ClusterRouter. ``staging_dir``:
    where the checkpoints a trainer broadcasts are written ("" = the system's temporary directory)."""
    if staging_dir:
        router.trainer_weights.staging_dir = staging_dir

    async def paused(mode: str, timeout_s: float):
        try:
            await router.pause(mode, timeout_s)
        except RouterError as e:
            return error_response(e.status, str(e), kind=e.kind, param="mode" if e.status == 400 else None)
        return {"status": "paused"}

    @app.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True),
                    timeout_s: float = Query(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)):
        return await paused(mode, timeout_s)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest):
        if body.mode != "abort":
            return error_response(400, f"mode {body.mode!r} is not supported here: a request never runs on two sets "
                                       "of weights; pause with mode 'abort' (or POST /pause?mode=wait)", param="mode")
        return await paused("abort", body.timeout_s)

    @app.post("/resume")
    @app.post("/continue_generation")  # SGLang's name
    async def resume():
        try:
            update = await router.resume()
        except RouterError as e:  # a trainer's staged weights could not be served: still paused
            return error_response(e.status, f"{e} (generation stays paused)", kind=e.kind)
        return {"status": "resumed", **({"weight_update": update} if update else {})}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": router.is_paused}

    async def answered(call) -> dict | JSONResponse:
        """SGLang's answer to a weight call: its own, or ``{"success": false, "message"}`` with the error's status."""
        try:
            return await call
        except RouterError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=e.status)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        return await answered(router.update_weights_from_disk(body.model_path, body.weight_version,
                                                              body.abort_all_requests, body.timeout_s))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        return await answered(router.trainer_weights.init_group(body.master_address, body.master_port,
                                                                body.rank_offset, body.world_size, body.group_name,
                                                                body.backend, body.timeout_s))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        return await answered(router.trainer_weights.update(body.names, body.dtypes, body.shapes, body.group_name,
                                                            body.weight_version, body.abort_all_requests,
                                                            body.timeout_s))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest):
        return await answered(router.trainer_weights.destroy_group(body.group_name))

    @app.get("/get_weight_version")  # SGLang's name
    @app.get("/weight_info")  # vLLM's
    async def weight_version():
        return {"weight_version": router.weight_version}
