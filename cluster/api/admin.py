"""Draining workers from outside the server process: a Kubernetes preStop hook, an operator before
`ray down`, a script. The drain is the one `Cluster.remove_worker` runs (cluster/router/membership.py):
no new placements at once, the worker leaves only when nothing depends on it (a prefill worker once
every transfer it owes is acknowledged or revoked), then it is stopped; nothing is lost or recomputed.

Routes (``install_admin_routes``; every one needs ``Authorization: Bearer <admin key>``, the key of
``pdcluster serve --admin-key`` / $PDCLUSTER_ADMIN_KEY, which is not the API key: a client of the API
must not be able to take workers away; without an admin key the routes answer 403):

- ``POST /admin/drain`` with one of ``{"worker_id": ID}``, ``{"node_ip": IP}`` (every worker on the Ray
  node with that address: what a terminating pod or machine knows about itself) or ``{"all": true}``,
  and optionally ``"timeout_s"``. Answers once every selected worker has left: 200 with what each
  waited for; 404 for an unknown worker or a node hosting none; 504 when one did not drain in time
  (it stays out of rotation). A worker already draining is not drained twice: the call joins its drain,
  and a drain goes on when the caller disconnects (a repeated preStop call finds it).
- ``GET /admin/workers``: every worker, its role, Ray node and whether it takes placements.

``pdcluster drain --url URL (--worker-id ID | --node-ip IP | --all | --list)`` (cli/drain.py) is their
client.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.protocol import short

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 600.0  # also `pdcluster drain --timeout-s`'s default (cli/drain.py)
NODE_LOOKUP_TIMEOUT_S = 10.0


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    worker_id: str | None = Field(None, min_length=1)
    node_ip: str | None = Field(None, min_length=1)
    all: bool = False
    timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=24 * 3600)

    @model_validator(mode="after")
    def _one_selector(self) -> DrainRequest:
        given = [name for name in ("worker_id", "node_ip") if getattr(self, name) is not None]
        given += ["all"] if self.all else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of worker_id, node_ip or all: true (got {', '.join(given) or 'none'})")
        return self


@dataclass(frozen=True)
class WorkerPlace:
    worker_id: str
    role: str
    node_id: str | None  # None: the worker did not answer (dead, or Ray is restarting it)
    node_ip: str | None


async def worker_places(cluster, timeout_s: float = NODE_LOOKUP_TIMEOUT_S) -> list[WorkerPlace]:
    """Where every worker of ``cluster`` runs: its Ray node's id and address, asked of the worker itself."""

    def where(actor):  # runs in the worker's process; defined here so Ray ships it by value
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    roles = {**dict.fromkeys(cluster.prefill_handles, "prefill"), **dict.fromkeys(cluster.decode_handles, "decode")}
    handles = {**cluster.prefill_handles, **cluster.decode_handles}
    answers = await asyncio.gather(
        *(asyncio.wait_for(h.__ray_call__.remote(where), timeout_s) for h in handles.values()), return_exceptions=True)
    places = []
    for wid, answer in zip(handles, answers):
        if isinstance(answer, BaseException):
            log.warning("worker %s did not say which node it runs on: %r", wid, answer)
            answer = (None, None)
        places.append(WorkerPlace(wid, roles[wid], *answer))
    return places


class NothingToDrain(LookupError):
    """The selection matched no worker; the message says what exists."""


class Drainer:
    """Drains workers of one ``Cluster``; one drain per worker at a time, shared by every caller."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._drains: dict[str, asyncio.Task] = {}

    async def select(self, body: DrainRequest) -> list[str]:
        views = self.cluster.router.placement.views
        if body.all:
            return sorted(views)
        if body.worker_id is not None:
            if body.worker_id not in views:
                raise NothingToDrain(f"worker_id: no worker {body.worker_id!r} in this cluster "
                                     f"(workers: {', '.join(sorted(views)) or 'none'})")
            return [body.worker_id]
        places = await worker_places(self.cluster)
        chosen = sorted(p.worker_id for p in places if p.node_ip == body.node_ip and p.worker_id in views)
        if not chosen:
            known = sorted({p.node_ip for p in places if p.node_ip})
            raise NothingToDrain(f"node_ip: no worker runs on a Ray node with address {body.node_ip!r} "
                                 f"(workers run on: {', '.join(known) or 'none'})")
        return chosen

    async def drain(self, worker_ids: list[str], timeout_s: float) -> tuple[list[dict], dict[str, str]]:
        """Drain ``worker_ids`` together; (what drained, {worker id: why it did not})."""
        for wid in worker_ids:
            if wid not in self._drains:
                self._drains[wid] = asyncio.get_running_loop().create_task(self._drain_one(wid, timeout_s))
        tasks = [self._drains[wid] for wid in worker_ids]
        # Shielded: a caller that goes away (a preStop hook killed at its grace period) stops waiting,
        # not draining; a half-done drain would leave the worker out of rotation and still running.
        results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        drained, failed = [], {}
        for wid, result in zip(worker_ids, results):
            if isinstance(result, TimeoutError):
                failed[wid] = (f"did not drain within {timeout_s:g} s; it takes no new requests and still serves "
                               "the ones it has")
            elif isinstance(result, BaseException):
                failed[wid] = f"{type(result).__name__}: {result}"
            else:
                drained.append(result)
        return drained, failed

    async def _drain_one(self, worker_id: str, timeout_s: float) -> dict:
        view = self.cluster.router.placement.views.get(worker_id)
        gone = {"worker_id": worker_id, "role": view.role if view else "?", "waited_s": 0.0,
                "num_requests_waited_for": 0}
        try:
            result = await self.cluster.remove_worker(worker_id, timeout_s)
        except KeyError:  # it left meanwhile (the autoscale planner drained it, say): what the caller wants
            return gone
        finally:
            self._drains.pop(worker_id, None)
        log.warning("admin: worker %s drained and stopped", worker_id)
        return {**gone, "waited_s": round(result.waited_s, 3),
                "num_requests_waited_for": result.num_requests_waited_for}

    def in_rotation(self) -> dict[str, int]:
        placement = self.cluster.router.placement
        return {role: len(placement.role_views(role, in_rotation_only=True)) for role in ("prefill", "decode")}


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}, got {short(err.get('input'))}" if where else f"request body: {msg}")
    return "; ".join(parts)


def _first_field(e: ValidationError) -> str | None:
    loc = e.errors()[0]["loc"]
    return ".".join(str(x) for x in loc) or None


def _denied(request: Request, admin_key: bytes | None):
    """The error response for a request without the admin key, or None when it has it."""
    if admin_key is None:
        return error_response(403, "admin routes are disabled: start `pdcluster serve` with --admin-key or "
                                   "$PDCLUSTER_ADMIN_KEY to enable them",
                              kind="permission_error", code="admin_disabled")
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), admin_key):
        return None
    message = ("missing admin key: send the header 'Authorization: Bearer <admin key>'" if not given
               else "invalid admin key in the Authorization header")
    return error_response(401, message, kind="authentication_error", code="invalid_admin_key",
                          headers={"WWW-Authenticate": "Bearer"})


def install_admin_routes(app: FastAPI, cluster, admin_key: str | None) -> Drainer:
    """Add /admin/drain and /admin/workers to ``app`` (built by cluster/api/app.py for ``cluster``'s router)."""
    drainer = Drainer(cluster)
    key = admin_key.encode() if admin_key else None

    @app.post("/admin/drain")
    async def drain(request: Request):
        denied = _denied(request, key)
        if denied is not None:
            return denied
        try:
            body = DrainRequest.model_validate(json.loads(await request.body() or b"null"))
        except json.JSONDecodeError as e:
            return error_response(400, f"request body is not valid JSON: {e}")
        except ValidationError as e:
            return error_response(400, _explain(e), param=_first_field(e))
        try:
            worker_ids = await drainer.select(body)
        except NothingToDrain as e:
            return error_response(404, str(e), kind="not_found_error", code="no_such_worker")
        drained, failed = await drainer.drain(worker_ids, body.timeout_s)
        if failed:
            done = f"; drained: {', '.join(d['worker_id'] for d in drained)}" if drained else ""
            return error_response(504, "; ".join(f"worker {wid} {why}" for wid, why in failed.items()) + done,
                                  kind="timeout_error", code="drain_incomplete")
        in_rotation = drainer.in_rotation()
        needed = ("prefill", "decode") if cluster.spec.mode == "disagg" else ("decode",)
        warnings = [f"no {role} worker is left in rotation: requests get 503 until one is added"
                    for role in needed if in_rotation[role] == 0]
        return {"drained": drained, "workers_in_rotation": in_rotation, "warnings": warnings}

    @app.get("/admin/workers")
    async def workers(request: Request):
        denied = _denied(request, key)
        if denied is not None:
            return denied
        views = cluster.router.placement.views
        places = [p for p in await worker_places(cluster) if p.worker_id in views]
        return {"workers": [{**asdict(p), "in_rotation": views[p.worker_id].in_rotation,
                             "draining": views[p.worker_id].draining} for p in places]}

    return drainer
