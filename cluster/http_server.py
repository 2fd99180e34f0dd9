"""The HTTP server under `pdcluster serve`, both modes (local: cluster/serve_cli.py; Ray:
cluster/launcher.py): uvicorn on a socket bound first, so a busy port is one clear error line, not a
traceback after the model loaded or Ray started."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import socket
import sys
import threading

import uvicorn

from pdcluster.cluster.http_options import HttpOptions
from pdcluster.engine.config import ConfigError
from pdcluster.engine.gc_heap import freeze_startup_objects


def run_server(app, host: str, port: int, model_name: str, sock: socket.socket | None = None,
               on_ready=None, announce: bool = True, http: HttpOptions = HttpOptions()) -> int:
    """Run uvicorn until SIGINT/SIGTERM, then return (so the caller's cleanup runs); print "pdcluster
    serving <model> on http://host:port" (https:// with TLS) to stderr once the socket listens (the real port
    when ``port`` is 0). ``sock``: a socket already bound to host:port (see ``listen``); closed on return.
    ``on_ready(loop)``: called once the server listens, on its event loop (background tasks).
    ``announce=False``: no serving line (an API process of several: cluster/frontend/ prints one for all).
    ``http``: the serve flags for uvicorn (cluster/http_options.py: log level, access log, root path, TLS)."""

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after shutdown, which would kill us before the
            # caller's cleanup (router.close(), stopping workers): take the signals, do not re-raise.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            captured = signals_to_capture()
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in captured}
            was_blocked = unblock(captured)
            try:
                yield
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, was_blocked)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    sock = sock or listen(host, port)  # bound before uvicorn, so a busy port is one clear error line
    # The TLS files' identity before uvicorn reads them: a renewal while the server starts is taken too.
    refresher = ssl_refresher(http) if http.ssl and http.ssl_refresh else None
    bound = sock.getsockname()[1]
    try:
        server = Server(uvicorn_config(app, host, bound, http))
    except BaseException:
        sock.close()
        raise

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        refreshing = None
        if server.started:
            if announce:
                announce_serving(model_name, host, bound, http.scheme)
            if refresher is not None:
                refresher.context = server.config.ssl  # the context the listening socket serves with
                refreshing = asyncio.create_task(refresher.run())
            if on_ready is not None:
                on_ready(asyncio.get_running_loop())
        try:
            await task
        finally:
            if refreshing is not None:
                refreshing.cancel()

    try:
        run_serving_loop(serve())
    finally:
        sock.close()
    return 0 if server.started else 1


def uvicorn_config(app, host: str, port: int, http: HttpOptions) -> uvicorn.Config:
    """uvicorn's Config, which configures logging as it is made: a --log-config-file whose handlers or formatters
    cannot be built is one line naming the flag (http_options.py checked only that it parses)."""
    try:
        return uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5,
                              http="httptools" if _has("httptools") else "h11", **http.uvicorn_kwargs())
    except (ValueError, TypeError, AttributeError, ImportError, KeyError, OSError) as e:
        if http.log_config_file is None:
            raise
        raise ConfigError(f"--log-config-file: {http.log_config_file}: logging cannot be configured with it: {e}") \
            from None


def ssl_refresher(http: HttpOptions):
    """--enable-ssl-refresh: a refresher of ``http``'s TLS files, for the SSLContext uvicorn will make of them."""
    from pdcluster.cluster.ssl_refresh import SSLCertRefresher

    return SSLCertRefresher(None, http.ssl_certfile, http.ssl_keyfile, http.ssl_ca_certs)


def signals_to_capture() -> list[int]:
    """SIGINT and SIGTERM, but not one the process ignores: an API process of several ignores Ctrl-C's SIGINT
    (cluster/frontend/api_process.py: its supervisor stops it with SIGTERM). Taking that SIGINT too made the
    supervisor's SIGTERM a second signal, which uvicorn treats as "force exit": its lifespan task was cancelled
    mid-shutdown (a traceback on Ctrl-C)."""
    return [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]


def unblock(signals) -> set:
    """Unblock ``signals`` in this thread; the mask before. A signal mask survives fork and exec: started by a thread
    that had SIGINT blocked (a supervisor's, a test runner's), a server held Ctrl-C pending for ever and only SIGTERM
    stopped it. A signal a server takes is one it must receive."""
    return signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def run_serving_loop(main):
    """Run the coroutine ``main`` as a serving process's event loop (uvloop where installed; Windows has
    none) after ``freeze_startup_objects`` (engine/gc_heap.py: Ray's, FastAPI's and the routes' objects); its
    result."""
    freeze_startup_objects()
    if _has("uvloop"):
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def announce_serving(model_name: str, host: str, port: int, scheme: str = "http") -> None:
    """The line tools wait for (tools/server_process.py READY); ``scheme`` https where the server speaks TLS."""
    shown = f"[{host}]" if ":" in host else host
    print(f"pdcluster serving {model_name} on {scheme}://{shown}:{port}", file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
