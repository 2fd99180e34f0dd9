"""`pdcluster pd-proxy`: the proxy of vLLM's external prefill/decode split (cluster/pd_proxy.py) in front of instances
started with `pdcluster serve --kv-transfer-config`. The web stack is imported only when it runs."""

from __future__ import annotations

import argparse

from pdcluster.engine.config import ConfigError


def add_pd_proxy_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "pd-proxy", help="the proxy of an external prefill/decode split over `serve --kv-transfer-config` instances",
        description="vLLM's disaggregated-serving proxy: each request is prefilled on a --prefill instance, then "
                    "decoded on a --decode instance from the KV the first one holds (both started with "
                    "`pdcluster serve --kv-transfer-config ...`).")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances, e.g. http://p:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances, e.g. http://d:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="one leg's longest wait for its answer")
    p.set_defaults(func=pd_proxy_main)


def pd_proxy_main(args: argparse.Namespace) -> int:
    import uvicorn

    from pdcluster.cluster.pd_proxy import build_proxy_app

    for url in (*args.prefill, *args.decode):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--prefill/--decode: {url!r} is not an http(s) URL")
    if not args.timeout_s > 0:
        raise ConfigError(f"--timeout-s must be > 0, got {args.timeout_s}")
    uvicorn.run(build_proxy_app(args.prefill, args.decode, args.timeout_s), host=args.host, port=args.port,
                log_level="warning")
    return 0
