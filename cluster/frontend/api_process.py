"""One API process (spawned by supervisor.py): the OpenAI app (cluster/api/app.py) over a RemoteRouter,
uvicorn on the listening socket every API process shares; /admin/* is handed to the router process.

Imports only the standard library at module level: the supervisor imports this module for its
config, and the child pays for FastAPI and the tokenizer inside ``main``.
"""

from __future__ import annotations

import logging
import signal
import socket
from dataclasses import dataclass

from pdcluster.cluster.api.options import ApiOptions  # standard library only
from pdcluster.cluster.http_options import HttpOptions  # standard library only

HANDSHAKE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ApiConfig:
    socket_dir: str  # the ipc sockets: "router" (the RouterService), "api-<index>" (each process's replies)
    metrics_dir: str  # prometheus_client's multiprocess directory, shared by every process
    host: str
    port: int
    served_model_name: str
    options: ApiOptions  # build_app's keyword arguments (runtime LoRA routes are answered by the router process)
    http: HttpOptions = HttpOptions()  # uvicorn's log level, access log, root path and TLS, as the serve flags say


def router_endpoint(socket_dir: str) -> str:
    return f"ipc://{socket_dir}/router"


def main(config: ApiConfig, index: int, sock: socket.socket) -> int:
    # Ctrl-C reaches the whole process group: the supervisor stops us with SIGTERM, in its order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"api-{index} %(levelname)s %(name)s: %(message)s")
    from pdcluster.cluster.metrics import enable_multiprocess

    enable_multiprocess(config.metrics_dir)  # before any metric exists
    from pdcluster.cluster.api.app import build_app
    from pdcluster.cluster.frontend.admin_proxy import (install_admin_proxy, install_control_proxy,
                                                        install_sleep_routes_proxy, install_weight_routes_proxy)
    from pdcluster.cluster.frontend.remote_router import RemoteRouter, handshake
    from pdcluster.cluster.http_server import run_server
    from pdcluster.cluster.metrics import Metrics

    endpoint, reply_endpoint = router_endpoint(config.socket_dir), f"ipc://{config.socket_dir}/api-{index}"
    router = RemoteRouter(endpoint, reply_endpoint, index, handshake(endpoint, index, HANDSHAKE_TIMEOUT_S))
    kwargs = config.options.app_kwargs()
    weight_updates = kwargs.pop("weight_updates")  # answered by the router process (its admin app), not here
    sleep_mode = kwargs.pop("sleep_mode")  # likewise
    app = build_app(router, config.served_model_name,
                    metrics=Metrics(config.served_model_name, multiprocess_dir=config.metrics_dir,
                                    prefix=config.options.metrics_prefix),
                    router_control=False, **kwargs)

    install_admin_proxy(app, router)
    install_control_proxy(app, router)
    if weight_updates:
        install_weight_routes_proxy(app, router)
    if sleep_mode:
        install_sleep_routes_proxy(app, router)
    try:
        return run_server(app, config.host, config.port, config.served_model_name, sock=sock,
                          on_ready=lambda loop: router.announce_ready(), announce=False, http=config.http)
    finally:
        router.close()
