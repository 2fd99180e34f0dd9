"""vLLM's runtime LoRA routes, on a server started with ``--enable-lora`` (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true):

- ``POST /v1/load_lora_adapter`` ``{"lora_name": NAME, "lora_path": DIR}``: every worker loads the PEFT adapter
  in DIR (a path on the workers' machines); from the answer on, the API's ``model`` field may name it and
  /v1/models lists it. 200 with vLLM's text; 400 with the reason for an adapter that cannot run here, a name
  already loaded, or max_loras adapters held.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": NAME}``: new requests naming it get 404 from the answer on;
  the requests running with it finish with it. 404 for a name not loaded.

Both sit under /v1, behind the API key when one is set, as vLLM's do. The router does the work
(cluster/router/lora.py on a cluster, cluster/local_router.py on one engine).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.router_contract import RouterError


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's request carries it; names identify adapters here


def install_lora_routes(app: FastAPI, router, served_model_name: str,
                        served_model_aliases: tuple[str, ...] = ()) -> None:
    """``served_model_name`` and ``served_model_aliases``: the names the base model is served under (serve
    --served-model-name NAME...), which no adapter may take: a request naming one could mean either."""
    served_names = (served_model_name, *served_model_aliases)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        if body.lora_name in served_names:
            return error_response(400, f"lora_name: {body.lora_name!r} is the base model's name; give the adapter "
                                       "another", param="lora_name")
        try:
            await router.load_lora(body.lora_name, body.lora_path)
        except RouterError as e:
            return error_response(e.status, str(e), kind=e.kind)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        try:
            await router.unload_lora(body.lora_name)
        except RouterError as e:
            return error_response(e.status, str(e), kind=e.kind)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
