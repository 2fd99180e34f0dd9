"""The `pdcluster` command line: `generate` (offline, one engine), `drain` (workers of a running server),
more subcommands as they land.

Errors in what the user typed print one line to stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdcluster.engine.config import DTYPES, SPEC_METHODS, ConfigError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2", help="built-in name (smollm2, tiny-random) or an HF model directory")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA where torch sees a GPU: in a cluster, the GPU Ray gave the worker), cpu, cuda "
                        "or cuda:N")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto = the checkpoint's dtype (bfloat16 for smollm2: prepacked bf16 GEMMs on CPU)")
    g.add_argument("--max-model-len", type=int, default=0, help="0 = the model's limit, capped at 4096")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="0 = size the pool from --kv-cache-memory-gib")
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--spec", default="none", choices=SPEC_METHODS, help="speculative decoding method")
    g.add_argument("--num-spec-tokens", type=int, default=0, help="draft tokens per step (k)")
    g.add_argument("--mtp-checkpoint", default="",
                   help="MTP head for --spec mtp: a safetensors file from bench/train_mtp.py (default: the one "
                        "trained for --model in the cache dir; refused when there is none), or 'random'")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of through CUDA graphs (vLLM's --enforce-eager)")
    g.add_argument("--num-threads", type=int, default=0)
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a request's tokens and logprobs are bitwise the same whatever the "
                        "batch, chunking, speculation, placement or recovery (CPU; on by default, --no-deterministic for the "
                        "library GEMMs and, on hybrids, the chunked Mamba scan; see README)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-dir", default="", help="where converted models live (default ~/.cache/pdcluster)")


def engine_config_from_args(args: argparse.Namespace):
    from pdcluster.engine.config import EngineConfig

    num_spec = args.num_spec_tokens
    if args.spec != "none" and num_spec == 0:
        num_spec = 3
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        enable_prefix_caching=not args.no_prefix_caching,
        spec_method=args.spec,
        num_spec_tokens=num_spec,
        mtp_checkpoint=args.mtp_checkpoint,
        num_threads=args.num_threads,
        cuda_graphs=not args.no_cuda_graphs,
        seed=args.seed,
        cache_dir=args.cache_dir,
        **({} if getattr(args, "deterministic", None) is None else {"deterministic": args.deterministic}),
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sampling_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(engine_config_from_args(args))
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outputs = engine.generate(prompts, params)  # validates every prompt before the first step
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "num_draft_tokens": out.num_draft_tokens,
                "num_accepted_tokens": out.num_accepted_tokens,
            }), flush=True)
        else:
            print(f"{prompt!r} -> {out.text!r}", flush=True)
    return 0


def _add_drain_parser(subparsers) -> None:
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
    p.set_defaults(func=_cmd_drain)


def _cmd_drain(args: argparse.Namespace) -> int:
    import httpx

    key = args.admin_key or os.environ.get("PDCLUSTER_ADMIN_KEY") or ""
    if not key:
        raise ConfigError("--admin-key: not given and $PDCLUSTER_ADMIN_KEY is not set")
    if not args.timeout_s > 0:
        raise ConfigError(f"--timeout-s: must be > 0, got {args.timeout_s}")
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(timeout=httpx.Timeout(args.timeout_s + 60, connect=10)) as http:
            if args.list:
                r = http.get(f"{url}/admin/workers", headers=headers)
            else:
                body = ({"worker_id": args.worker_id} if args.worker_id else {"node_ip": args.node_ip} if args.node_ip
                        else {"all": True})
                r = http.post(f"{url}/admin/drain", headers=headers, json={**body, "timeout_s": args.timeout_s})
    except httpx.HTTPError as e:
        print(f"pdcluster drain: error: {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code != 200 or not isinstance(answer, dict):
        message = ((answer or {}).get("error") or {}).get("message") if isinstance(answer, dict) else None
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline with one engine (no cluster)")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    gen.set_defaults(func=_cmd_generate)

    from pdcluster.cluster.serve_cli import add_serve_parser, serve_main

    add_serve_parser(sub).set_defaults(func=serve_main)
    from pdcluster.cluster.loadtest.cli import add_loadtest_parser
    add_loadtest_parser(sub)
    _add_drain_parser(sub)
    from pdcluster.cluster.planner.cli import add_planner_parsers
    add_planner_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pdcluster.engine.llm_engine import InvalidRequestError
    from pdcluster.engine.models.registry import UnknownModelError

    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError, UnknownModelError, ValueError) as e:
        print(f"pdcluster {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
