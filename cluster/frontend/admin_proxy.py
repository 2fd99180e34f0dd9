"""/admin/* in an API process: handed to the router process (service.py answers it with the cluster's
admin routes, cluster/api/admin.py), whose reply is this process's answer."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdcluster.cluster.api.middleware import error_response
from pdcluster.cluster.api.router_contract import RouterError
from pdcluster.cluster.api.control_routes import CONTROL_ROUTES
from pdcluster.cluster.api.sleep_routes import SLEEP_ROUTES
from pdcluster.cluster.api.weight_routes import WEIGHT_ROUTES

# What the admin routes read of a request: the admin key and the body's type.
FORWARDED_HEADERS = ("authorization", "content-type")


async def _forward(router, request: Request, target: str) -> Response:
    """``request`` answered by the router process at ``target`` (a path and query as the router process routes it)."""
    headers = [(k, v) for k, v in request.headers.items() if k in FORWARDED_HEADERS]
    try:
        reply = await router.admin(request.method, target, headers, await request.body())
    except RouterError as e:
        return error_response(e.status, str(e), kind=e.kind)
    return Response(reply.body, status_code=reply.status, headers=dict(zip(reply.header_names, reply.header_values)))


def _with_query(path: str, request: Request) -> str:
    return path + (f"?{request.url.query}" if request.url.query else "")


def _forwarding(router, path: str):
    async def forward(request: Request):  # the route's own path: the router process has no --root-path prefix
        return await _forward(router, request, _with_query(path, request))

    return forward


def install_admin_proxy(app: FastAPI, router) -> None:
    """``router``: a RemoteRouter (its ``admin`` call)."""

    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def admin(path: str, request: Request):
        # The route's own path: behind --root-path the URL's carries the prefix, which the router process has not.
        return await _forward(router, request, _with_query(f"/admin/{path}", request))


def install_weight_routes_proxy(app: FastAPI, router) -> None:
    """The weight routes (cluster/api/weight_routes.py) in an API process, answered by the router process's."""
    for path, method in WEIGHT_ROUTES.items():
        app.add_api_route(path, _forwarding(router, path), methods=[method], include_in_schema=False)


def install_sleep_routes_proxy(app: FastAPI, router) -> None:
    """Sleep mode's routes (cluster/api/sleep_routes.py) in an API process, answered by the router process's."""
    for path, method in SLEEP_ROUTES.items():
        app.add_api_route(path, _forwarding(router, path), methods=[method], include_in_schema=False)


def install_control_proxy(app: FastAPI, router) -> None:
    """The aborts and the cache flushes (cluster/api/control_routes.py) in an API process, answered by the router
    process's: it holds every API process's requests and the workers."""
    for path, methods in CONTROL_ROUTES.items():
        app.add_api_route(path, _forwarding(router, path), methods=list(methods), include_in_schema=False)
