"""``pdcluster serve --api-servers N`` (N > 1): this process keeps the router (and in ``--mode local``
the engine) and serves it to N API processes (api_process.py) that share the listening socket.

The serving line is printed once every API process listens. SIGINT or SIGTERM stops the API
processes (SIGTERM: uvicorn finishes what it can within its grace period), then returns so the caller
closes the router and the workers. An API process that dies stops the whole server with status 1, as
vLLM does: a server missing a process would take its share of connections and answer none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile

from pdcluster.cluster.api.options import ApiOptions
from pdcluster.cluster.frontend.api_process import ApiConfig, main as api_process_main, router_endpoint
from pdcluster.cluster.frontend.protocol import AdminCall, AdminReply
from pdcluster.cluster.frontend.service import RouterService
from pdcluster.cluster.http_options import HttpOptions
from pdcluster.cluster.http_server import announce_serving, run_serving_loop, unblock
from pdcluster.cluster.metrics import enable_multiprocess

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # an API process's time to finish its streams after SIGTERM (uvicorn's is 5 s)
WATCH_INTERVAL_S = 0.2


class ApiServers:
    """Make this before the process's Metrics (``metrics_dir`` must be set when they are created), then
    ``run`` it; it owns ``sock`` from then on (as run_server does), and ``close`` closes it."""

    def __init__(self, num_processes: int, sock: socket.socket, host: str):
        if num_processes < 2:
            raise ValueError(f"ApiServers is for 2 or more API processes, got {num_processes}")
        self.num_processes, self.sock, self.host = num_processes, sock, host
        self.port = sock.getsockname()[1]
        # Owner-only (mkdtemp): the ipc socket in it is the router's door, with no secret of its own.
        self.dir = tempfile.mkdtemp(prefix="pdcluster-api-")
        self.endpoint = router_endpoint(self.dir)
        self.metrics_dir = os.path.join(self.dir, "metrics")
        os.mkdir(self.metrics_dir)
        enable_multiprocess(self.metrics_dir)
        self._procs: list[multiprocessing.Process] = []

    def run(self, router, served_model_name: str, options: ApiOptions, *, admin_app=None, on_ready=None,
            http: HttpOptions = HttpOptions()) -> int:
        """Serve until SIGINT/SIGTERM (0) or an API process's death (1). ``options``: every API process's app
        (build_app's keyword arguments). ``admin_app``: an ASGI app whose /admin/* routes answer the API processes'
        admin calls. ``on_ready(loop)``: as run_server's. With ``options.runtime_lora`` the API processes serve
        vLLM's runtime LoRA routes, answered here, on ``router``, beside the admin routes
        (cluster/api/lora_routes.py); with ``options.weight_updates`` the pause and weight routes
        (cluster/api/weight_routes.py) likewise; the aborts and cache flushes always (cluster/api/control_routes.py). ``http``: every API process's uvicorn settings (its log level, root path, TLS)."""
        config = ApiConfig(self.dir, self.metrics_dir, self.host, self.port, served_model_name, options, http)
        if admin_app is None:  # the aborts and the flushes at least (cluster/api/control_routes.py)
            from fastapi import FastAPI

            from pdcluster.cluster.api.middleware import error_response, install_error_handlers

            admin_app = FastAPI()
            install_error_handlers(admin_app)

            @admin_app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
            async def no_admin(path: str):  # the cluster's /admin/* (drain, workers) come with the Ray launcher's
                return error_response(404, "no admin routes in this mode", kind="not_found")
        if options.runtime_lora:
            from pdcluster.cluster.api.lora_routes import install_lora_routes

            install_lora_routes(admin_app, router, served_model_name, options.served_model_aliases)
        from pdcluster.cluster.api.control_routes import install_control_routes

        install_control_routes(admin_app, router)  # the API processes forward them here (admin_proxy.py)
        if options.weight_updates:  # the API processes forward them here (cluster/frontend/admin_proxy.py)
            from pdcluster.cluster.api.weight_routes import install_weight_routes

            install_weight_routes(admin_app, router, options.weight_staging_dir)
        if options.sleep_mode:  # likewise (cluster/api/sleep_routes.py)
            from pdcluster.cluster.api.sleep_routes import install_sleep_routes

            install_sleep_routes(admin_app, router)
        return run_serving_loop(self._serve(router, config, admin_app, on_ready))

    async def _serve(self, router, config: ApiConfig, admin_app, on_ready) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        unblock((signal.SIGINT, signal.SIGTERM))
        ready: set[int] = set()

        def on_hello(index: int, is_ready: bool) -> None:
            if is_ready and index not in ready:
                ready.add(index)
                if len(ready) == self.num_processes:
                    announce_serving(config.served_model_name, self.host, self.port, config.http.scheme)

        admin = _asgi_admin(admin_app) if admin_app is not None else None
        service = RouterService(router, self.endpoint, str(router.tokenizer.model_dir), admin=admin, on_hello=on_hello)
        serving = loop.create_task(service.run())
        status = 0
        try:
            context = multiprocessing.get_context("spawn")  # no fork of a process holding torch, Ray, threads
            for index in range(self.num_processes):
                proc = context.Process(target=api_process_main, args=(config, index, self.sock),
                                       name=f"pdcluster-api-{index}")
                proc.start()
                self._procs.append(proc)
            if on_ready is not None:
                on_ready(loop)
            while not stop.is_set():
                dead = [p for p in self._procs if not p.is_alive()]
                if dead or serving.done():
                    what = (f"API process {dead[0].name} exited with status {dead[0].exitcode}" if dead
                            else f"the router service stopped: {serving.exception()!r}")
                    print(f"pdcluster serve: {what}; stopping the server", file=sys.stderr, flush=True)
                    status = 1
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), WATCH_INTERVAL_S)
        finally:
            await loop.run_in_executor(None, self._stop_processes)
            serving.cancel()
            with contextlib.suppress(BaseException):
                await serving
            service.close()
        return status

    def _stop_processes(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(STOP_GRACE_S)
            if proc.is_alive():
                log.warning("API process %s did not stop in %.0f s: killing it", proc.name, STOP_GRACE_S)
                proc.kill()
                proc.join(STOP_GRACE_S)

    def close(self) -> None:
        """Stop the processes, close the listening socket (it was handed over), remove the directory."""
        self._stop_processes()
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# The API process's response sets its own length and framing.
_NOT_FORWARDED = ("content-length", "transfer-encoding", "connection")


def _asgi_admin(app):
    """An AdminCall answered by ``app`` in this process (httpx over ASGI: no socket)."""
    import httpx

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router-process")

    async def call(msg: AdminCall) -> AdminReply:
        response = await client.request(msg.method, msg.path, headers=list(zip(msg.header_names, msg.header_values)),
                                        content=msg.body, timeout=None)
        headers = [(k, v) for k, v in response.headers.multi_items() if k not in _NOT_FORWARDED]
        return AdminReply(msg.call_id, response.status_code, [k for k, _ in headers], [v for _, v in headers],
                          response.content)

    return call
