"""`pdcluster update-weights`: have a running `pdcluster serve --enable-weight-updates` serve a new checkpoint (its
POST /update_weights_from_disk: cluster/api/weight_routes.py), as an RL trainer's script does between rollouts."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from pdcluster.cli.http_answers import error_message, json_body
from pdcluster.engine.config import ConfigError


def add_update_weights_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "update-weights", help="have a running `pdcluster serve --enable-weight-updates` serve a new checkpoint",
        description="Every worker of the server reads the checkpoint at --model-path (a path on the workers' "
                    "machines) and serves it from the answer on; the requests in flight finish first (or, with "
                    "--abort-all-requests, end). Prints the server's answer (JSON) and exits 0, or exits 1 with "
                    "its reason (nothing changed).")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-path", required=True, help="the new checkpoint's directory (same architecture)")
    p.add_argument("--weight-version", default=None,
                   help="a name for these weights (default: the directory's name and the update's count)")
    p.add_argument("--abort-all-requests", action="store_true", help="end the requests in flight instead of "
                                                                      "waiting for them")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long the requests in flight may take")
    p.add_argument("--api-key", default=None, help="the server's --api-key (default: $PDCLUSTER_API_KEY, else "
                                                   "$VLLM_API_KEY)")
    p.set_defaults(func=update_weights_main)


def update_weights_main(args: argparse.Namespace) -> int:
    if not args.timeout_s > 0:
        raise ConfigError(f"--timeout-s: must be > 0, got {args.timeout_s}")
    key = args.api_key or os.environ.get("PDCLUSTER_API_KEY") or os.environ.get("VLLM_API_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model_path": args.model_path, "abort_all_requests": args.abort_all_requests, "timeout_s": args.timeout_s}
    if args.weight_version:
        body["weight_version"] = args.weight_version
    url = args.url.rstrip("/")
    try:
        with httpx.Client(timeout=httpx.Timeout(args.timeout_s + 1800, connect=10)) as http:
            r = http.post(f"{url}/update_weights_from_disk", headers=headers, json=body)
    except httpx.HTTPError as e:
        print(f"pdcluster update-weights: error: {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    answer = json_body(r)
    if r.status_code == 200 and answer is not None and answer.get("success"):
        print(json.dumps(answer, indent=2))
        return 0
    message = error_message(answer)
    if r.status_code == 404:
        message = "the server has no weight routes: start it with --enable-weight-updates"
    print(f"pdcluster update-weights: error: HTTP {r.status_code}: {message or r.text[:500]}", file=sys.stderr)
    return 1
