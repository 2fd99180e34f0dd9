#!/usr/bin/env python3
"""Wait until the Ray cluster has room for every pdcluster worker, then exec `pdcluster serve`.

    python serve_when_ready.py [--device cpu|gpu] [--timeout-s 1800] -- pdcluster serve --address auto ...

Why: the launcher gives its placement group 120 s, but cloud or Kubernetes worker nodes can take longer
to boot and join. Waiting here (printing what is still missing) keeps that delay out of the launcher.
The serve flags are parsed with pdcluster's own parser, so a typo fails at once, not after the wait.
CPU clusters place a worker on one `prefill_slot` / `decode_slot`; GPU clusters on one GPU each
(cluster/launcher.py). Used by deploy/ray/*.yaml (file_mounts) and the Helm chart (ConfigMap).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def needed_resources(serve_argv: list[str], device: str) -> dict[str, float]:
    """Ray resources the launcher's placement group will ask for, from `pdcluster serve ...` argv."""
    from pdcluster.cli.main import build_parser

    if serve_argv[:1] != ["pdcluster"]:
        raise ValueError(f"expected `pdcluster serve ...` after --, got {serve_argv[:2]}")
    args = build_parser().parse_args(serve_argv[1:])
    if args.command != "serve" or args.mode == "local":
        raise ValueError(f"`pdcluster {args.command} --mode {args.mode}` does not run on a Ray cluster: "
                         "use `pdcluster serve --mode disagg` or `--mode colocated`")
    from pdcluster.cluster.serve_cli import resolve_auto_mode, role_splits

    mode = args.mode
    prefill_ranks, decode_ranks = role_splits(args)
    if mode == "auto" and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size):
        mode = "disagg"  # as `pdcluster serve` resolves it: a split for each role
    elif mode == "auto":  # what `pdcluster serve` resolves it to (serve_cli.resolve_auto_mode)
        # A GPU cluster gives each worker its own GPU (the chart asks for one per worker pod).
        mode = resolve_auto_mode(args.address, os.cpu_count() or 1, 2 if device == "gpu" else 0,
                                 max(prefill_ranks, decode_ranks))
    num_prefill = args.num_prefill if mode == "disagg" else 0
    if device == "gpu":  # a tensor-parallel worker takes a GPU per rank
        return {"GPU": num_prefill * prefill_ranks + args.num_decode * decode_ranks}
    return {k: v for k, v in (("prefill_slot", num_prefill), ("decode_slot", args.num_decode)) if v}


def missing_resources(needed: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {k: v - have.get(k, 0) for k, v in needed.items() if have.get(k, 0) < v}


def _connect(deadline: float, poll_s: float) -> None:
    """Join the local Ray node, waiting for it: on Kubernetes `ray start` runs beside this script."""
    import ray

    while True:
        try:
            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
            return
        except ConnectionError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ray node to join on this machine: {e}") from e
            time.sleep(poll_s)


def wait_for(needed: dict[str, float], timeout_s: float, poll_s: float) -> None:
    import ray

    deadline, last = time.monotonic() + timeout_s, None
    _connect(deadline, poll_s)
    try:
        while True:
            short = missing_resources(needed, ray.cluster_resources())
            if not short:
                return
            if short != last:
                print(f"serve_when_ready: waiting for Ray resources {short} (need {needed})", flush=True)
                last = short
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {timeout_s:.0f} s the cluster still lacks {short}: "
                                   "check the worker nodes (`ray status`, autoscaler or pod events)")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: serve_when_ready.py [options] -- pdcluster serve ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="serve_when_ready.py")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--poll-s", type=float, default=5.0)
    opts = p.parse_args(argv[:split])
    serve_argv = argv[split + 1:]
    try:
        wait_for(needed_resources(serve_argv, opts.device), opts.timeout_s, opts.poll_s)
    except (ValueError, TimeoutError) as e:
        print(f"serve_when_ready: error: {e}", file=sys.stderr, flush=True)
        return 1
    os.execvp(serve_argv[0], serve_argv)  # the server becomes this process: signals reach it directly


if __name__ == "__main__":
    sys.exit(main())
