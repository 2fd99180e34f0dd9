"""Sleep mode's routes, on a server started with ``--enable-sleep-mode`` (engine/sleep.py says what is released):
what an RL trainer sharing the machines sends before it trains and after.

- ``POST /sleep?level=1|2`` (vLLM's): every worker gives back its KV cache's memory (level 1) and its weights' too
  (level 2). Requests in flight finish first (ours: ``mode=wait``, the default; ``mode=abort`` ends them;
  ``timeout_s`` bounds the wait: 504, nothing released). From the answer on, generation routes answer 503 ("the
  model is sleeping") until the wake-up, as vLLM's do; /tokenize, /v1/models, /health and /metrics go on.
- ``POST /wake_up`` (vLLM's), ``tags=weights`` and/or ``tags=kv_cache`` (none: both): every worker takes that memory
  back; generation goes on once nothing sleeps (unless paused by POST /pause). Level-2 weights come back with a
  weight update (POST /update_weights_from_disk, allowed while asleep) or, when nothing wrote them, are read again
  from the checkpoint served: a 400 with the reason when its files changed since (they stay asleep).
- ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.
- SGLang's ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` ``{"tags": [...] | null}``:
  the same by tag (releasing ``weights`` discards them, as level 2).

With ``--api-key`` they need it (middleware.PROTECTED_PATHS); behind several API processes the router process answers
them (cluster/frontend/admin_proxy.py ``install_sleep_routes_proxy``).
"""

from __future__ import annotations

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.api.weight_routes import MAX_TIMEOUT_S
from pdcluster.cluster.generation_control import DEFAULT_DRAIN_TIMEOUT_S
from pdcluster.engine.sleep import SleepError, check_level, check_tags

SLEEP_ROUTES = {"/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET", "/release_memory_occupation": "POST",
                "/resume_memory_occupation": "POST"}


class MemoryOccupationRequest(BaseModel):
    """SGLang's release / resume body."""

    model_config = ConfigDict(extra="forbid")

    tags: list[str] | None = Field(None, max_length=8)
    timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)  # ours: the drain's bound


def install_sleep_routes(app: FastAPI, router) -> None:
    """``router``: the local or the Ray router (cluster/generation_control.py's WeightControlled)."""

    @app.post("/sleep")
    async def sleep(level: int = Query(1), mode: str = Query("wait"),
                    timeout_s: float = Query(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)):
        try:
            return await router.sleep(check_level(level), level, mode, timeout_s)
        except SleepError as e:
            return error_response(400, str(e), param="level")
        except RouterError as e:
            return error_response(e.status, str(e), kind=e.kind, param="mode" if e.status == 400 else None)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        try:
            return await router.wake_up(check_tags(tags or None))
        except SleepError as e:
            return error_response(400, str(e), param="tags")
        except RouterError as e:
            return error_response(e.status, str(e), kind=e.kind)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": router.is_sleeping}

    @app.post("/release_memory_occupation")  # SGLang's
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None):
        body = body or MemoryOccupationRequest()
        try:
            tags = check_tags(body.tags)
            answer = await router.sleep(tags, 2 if "weights" in tags else 1, "wait", body.timeout_s)
        except (SleepError, RouterError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=getattr(e, "status", 400))
        return {"success": True, "message": f"released {', '.join(tags)}", **answer}

    @app.post("/resume_memory_occupation")  # SGLang's
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None):
        body = body or MemoryOccupationRequest()
        try:
            tags = check_tags(body.tags)
            answer = await router.wake_up(tags)
        except (SleepError, RouterError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=getattr(e, "status", 400))
        return {"success": True, "message": f"resumed {', '.join(tags)}", **answer}
