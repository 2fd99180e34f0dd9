"""`pdcluster drain`: take workers of a running `pdcluster serve` out of rotation and stop them, through the
server's admin routes (cluster/api/admin.py), before a node or pod goes away."""

from __future__ import annotations

import argparse
import os
import ssl
import sys

import httpx

from pdcluster.cli.http_answers import error_message, json_body
from pdcluster.cluster.http_options import error_reason
from pdcluster.engine.config import ConfigError


def add_drain_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "drain", help="drain workers of a running `pdcluster serve` (before a node or pod goes away)",
        description="Ask a running server (its /admin/drain route: cluster/api/admin.py) to drain workers: they "
                    "take no new requests, finish or hand over what they have, then stop. Returns when they have "
                    "left (exit 0), or exits 1 with the server's reason.")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--worker-id", help="one worker, by its id (see --list)")
    which.add_argument("--node-ip", help="every worker on the Ray node with this address (a pod's IP on Kubernetes)")
    which.add_argument("--all", action="store_true", help="every worker (before tearing the whole cluster down)")
    which.add_argument("--list", action="store_true", help="print the workers and their nodes; drain nothing")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="give up waiting after this long (the workers stay out of rotation)")
    p.add_argument("--admin-key", default=None, help="the server's admin key (default: $PDCLUSTER_ADMIN_KEY)")
    p.add_argument("--cacert", default=None, metavar="PATH",
                   help="an https server's certificate is checked against the CA certificates in this PEM file "
                        "(default: the system's)")
    p.set_defaults(func=drain_main)


def drain_main(args: argparse.Namespace) -> int:
    key = args.admin_key or os.environ.get("PDCLUSTER_ADMIN_KEY") or ""
    if not key:
        raise ConfigError("--admin-key: not given and $PDCLUSTER_ADMIN_KEY is not set")
    if not args.timeout_s > 0:
        raise ConfigError(f"--timeout-s: must be > 0, got {args.timeout_s}")
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {key}"}
    verify = _verify(args.cacert)
    try:
        with httpx.Client(timeout=httpx.Timeout(args.timeout_s + 60, connect=10), verify=verify) as http:
            if args.list:
                r = http.get(f"{url}/admin/workers", headers=headers)
            else:
                body = ({"worker_id": args.worker_id} if args.worker_id else {"node_ip": args.node_ip} if args.node_ip
                        else {"all": True})
                r = http.post(f"{url}/admin/drain", headers=headers, json={**body, "timeout_s": args.timeout_s})
    except httpx.HTTPError as e:
        print(f"pdcluster drain: error: {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    answer = json_body(r)
    if r.status_code != 200 or answer is None:
        message = error_message(answer)
        print(f"pdcluster drain: error: HTTP {r.status_code}: {message or r.text[:500]}", file=sys.stderr)
        return 1
    if args.list:
        for w in answer["workers"]:
            state = "in rotation" if w["in_rotation"] else "draining" if w["draining"] else "out of rotation"
            print(f"{w['worker_id']}\t{w['role']}\t{w['node_ip'] or '?'}\t{state}")
        return 0
    for d in answer["drained"]:
        print(f"drained {d['role']} worker {d['worker_id']} in {d['waited_s']:.1f} s "
              f"({d['num_requests_waited_for']} requests waited for)")
    for warning in answer.get("warnings", []):
        print(f"pdcluster drain: warning: {warning}", file=sys.stderr)
    return 0


def _verify(cacert: str | None) -> ssl.SSLContext | bool:
    """httpx's ``verify``: the CAs of --cacert (the Helm chart's drain hook: the API Service's certificate is checked
    against its Secret's ca.crt), else the system's."""
    if cacert is None:
        return True
    try:
        return ssl.create_default_context(cafile=cacert)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--cacert: cannot load {cacert} (PEM CA certificates): {error_reason(e)}") from None
