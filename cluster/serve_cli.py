"""`pdcluster serve`: the OpenAI-compatible server. ``--mode local`` runs one in-process engine (no Ray);
``disagg`` and ``colocated`` start (or join) a Ray cluster through cluster/launcher.py.

The `pdcluster` command (cli/main.py) registers it: ``add_serve_parser(sub)``; the parser's default
``func`` is ``serve_main``. What serves (the launcher, the local router, the app) is imported when a
server starts: they load torch and the engine (about 1.5 s), which `pdcluster --help` should not wait for.
"""

from __future__ import annotations

import argparse
import os
import sys

from pdcluster.cluster.api.generation_defaults import sampling_defaults
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.api.options import (MAX_LOGPROBS, ApiOptions, CorsPolicy, chat_template_text,
                                           check_max_logprobs, check_response_role, check_template_kwargs, json_flag)
from pdcluster.cluster.api.reasoning import PARSERS as REASONING_PARSERS
from pdcluster.cluster.api.served_names import add_served_model_name_arg, check_served_names
from pdcluster.cluster.api.tool_parsers import PARSER_CHOICES
from pdcluster.cluster.autoscale import AutoscaleConfig
from pdcluster.cluster.engine_args import DEFAULT_MODEL, add_engine_args, engine_config_from_args
from pdcluster.cluster.http_options import HttpOptions, add_http_flags
from pdcluster.cluster.http_server import listen, run_server
from pdcluster.cluster.metrics import METRIC_PREFIXES, Metrics
from pdcluster.cluster.policies import POLICIES
from pdcluster.cluster.vllm_flags import add_vllm_flags, apply_vllm_flags
from pdcluster.engine.config import ConfigError, EngineConfig, parse_lora_modules
from pdcluster.engine.models.registry import default_cache_dir

MODES = ("auto", "disagg", "colocated", "local")
# Below this many cores (and no GPU, no cluster to join) a prefill/decode pair would get one core
# each: "auto" serves colocated there (measured on 2 cores, 2 req/s: TTFT 304 ms colocated vs 733 ms
# disaggregated; vLLM on its one engine core: 598 ms).
MIN_CORES_FOR_DISAGG = 4
# --api-servers auto: a GPU's decode steps outrun one process streaming every token (bench/results/
# served_merged_deltas_s57.json: 1.47x the tokens/s with 2 on a GPU-like engine); a CPU's cores go to the model.
GPU_API_SERVERS = 2
MIN_CORES_FOR_API_SERVERS = 4
TRANSPORTS = ("ucx", "nccl", "tcp", "shm", "cuda_ipc")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health "
                                          "and /metrics. The engine flags apply to every worker.")
    add_engine_args(p)  # --model, --spec, --num-spec-tokens, ... (shared with `generate`)
    add_vllm_flags(p)  # `serve MODEL`, and vLLM's flags that need nothing here
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=_port, default=os.environ.get("PDCLUSTER_PORT") or "8000",
                   help="0 = any free port (printed when ready); default: $PDCLUSTER_PORT, else 8000")
    add_served_model_name_arg(g, "the model names clients may send, as vLLM's; answers and metrics give the first "
                                 "(default: --model)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDCLUSTER_API_KEY, else vLLM's $VLLM_API_KEY; none = open)")
    g.add_argument("--admin-key", default=None,
                   help="enable /admin/drain and /admin/workers (`pdcluster drain`) for 'Authorization: Bearer KEY' "
                        "(default: $PDCLUSTER_ADMIN_KEY; none = those routes answer 403). Not the API key: API "
                        "clients must not be able to take workers away")
    g.add_argument("--api-servers", "--api-server-count", type=_api_servers, default="auto", dest="api_servers",
                   help="HTTP server processes sharing the port (vLLM's --api-server-count): each parses, "
                        "tokenizes, detokenizes and streams its own requests over one router; more than one "
                        "when a GPU's output outruns one process (about 15k streamed tokens/s each). auto "
                        f"(default): {GPU_API_SERVERS} where this machine serves from a GPU and has at least "
                        f"{MIN_CORES_FOR_API_SERVERS} cores, else 1")
    g.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="abort a request that makes no progress for this long")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default 1 MiB; 32 MiB for a model that takes images)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url parts may be file: URLs of images under DIR, read by the API process (vLLM's "
                        "flag; a security risk: set it only where every client may read DIR). Default: no file: URLs")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image_url http(s) URLs (and their redirects) may name only these hosts (vLLM's flag). "
                        "Default: any host this process reaches")
    g.add_argument("--enable-mm-embeds", action="store_true",
                   help="chat messages may carry image_embeds parts in place of images (vLLM's flag): base64 of a "
                        "[rows, hidden] tensor, as torch.save writes it (loaded weights-only) or as a .npy file; its "
                        "rows become the image's placeholders and no vision tower runs. Default: refused (400)")
    g.add_argument("--tool-call-parser", choices=PARSER_CHOICES, default="auto",
                   help="the model's tool-call format, read for tool_choice 'auto': hermes (<tool_call> JSON "
                        "blocks), llama3_json, pythonic ([f(a=1)]), mistral ([TOOL_CALLS]), qwen3_coder "
                        "(<function=...> XML); auto (default): from the chat template (<function= -> qwen3_coder, "
                        "[TOOL_CALLS] -> mistral, <tool_call> or ChatML -> hermes, Llama 3 -> llama3_json; "
                        "otherwise 'auto' is refused)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="give a thinking model's reasoning (<think>...</think>) apart from its chat answer, as "
                        "message.reasoning / reasoning_content: qwen3 (Qwen3, QwQ: only an output that opens "
                        "<think>) or deepseek_r1 (DeepSeek-R1: reasoning until </think>); default: the text as written. "
                        "Its markers also serve requests' thinking_token_budget")
    g.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help="web pages (origins) whose scripts may call the API from a browser, e.g. "
                        "'[\"http://localhost:3000\"]' or '[\"*\"]' (vLLM's flag; default: none, where vLLM "
                        "allows every origin)")
    g.add_argument("--allowed-methods", default=None, metavar="JSON", help="with --allowed-origins (default [\"*\"])")
    g.add_argument("--allowed-headers", default=None, metavar="JSON", help="with --allowed-origins (default [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true", help="with --allowed-origins: cookies and auth headers")
    g.add_argument("--middleware", action="append", default=[], metavar="MODULE.NAME",
                   help="your ASGI middleware around the API, as vLLM's flag (once per middleware): a class, or an "
                        "async function (request, call_next); outermost, before the API key check "
                        "(cluster/api/user_middleware.py)")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                   help="the most alternatives per position a request may ask for (logprobs, top_logprobs, "
                        "prompt_logprobs; vLLM's flag, default 20; -1: the whole vocabulary)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response ends with its usage chunk, asked for or not (vLLM's flag)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:<id>' for requests that do not say (vLLM's flag)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="leave /docs, /redoc and /openapi.json out (vLLM's flag)")
    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of a chat answer's message (vLLM's flag; default assistant)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (sandboxed, as every template) instead of refusing "
                        "it (vLLM's flag)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load answers the requests in flight in this API process (vLLM's flag; 0 without it)")
    g.add_argument("--enable-weight-updates", action="store_true",
                   help="serve the routes an RL trainer drives between rollouts: POST /pause, /resume, GET /is_paused "
                        "(vLLM's), POST /update_weights_from_disk, GET /get_weight_version (SGLang's), GET "
                        "/weight_info; on with VLLM_SERVER_DEV_MODE=1 too (cluster/api/weight_routes.py)")
    g.add_argument("--weight-staging-dir", default="", metavar="DIR",
                   help="with --enable-weight-updates: where the weights a trainer broadcasts "
                        "(/update_weights_from_distributed) are written as a checkpoint for the workers to read; "
                        "default the system's temporary directory; on a multi-node cluster a directory every node "
                        "sees")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve POST /sleep?level=1|2, /wake_up, GET /is_sleeping (vLLM's) and POST "
                        "/release_memory_occupation, /resume_memory_occupation (SGLang's): idle workers give back the "
                        "KV cache's memory and, at level 2, the weights' (engine/sleep.py; CPU workers)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the client's, else a new one (vLLM's flag)")
    g.add_argument("--metrics-prefix", default="pdcluster", choices=METRIC_PREFIXES,
                   help="/metrics names: pdcluster:* (default), or vllm:* as vLLM names them, for llm-d's endpoint "
                        "picker, KEDA / HPA rules and dashboards written for vLLM")
    g.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                   help="send each request's OpenTelemetry span (vLLM's attributes, and the TTFT's parts) to this OTLP "
                        "collector (vLLM's flag; gRPC, or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); needs "
                        "the otel extra")
    g.add_argument("--collect-detailed-traces", default="", metavar="model|worker|all",
                   help="each span gets children for the queue, prefill, KV transfer, first decode step and decode "
                        "(vLLM's flag; any of its values)")
    g.add_argument("--chat-template", default=None, metavar="TEMPLATE|FILE",
                   help="the Jinja chat template to serve in place of the model's (vLLM's flag): the template itself "
                        "(single-line form, \\n escapes read) or a file holding it; for a base model without one")
    g.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="chat template variables every request gets under its own chat_template_kwargs (vLLM's "
                        "flag), e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is served whenever the tool-call "
                        "parser is known (--tool-call-parser)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where the sampling defaults of requests that leave temperature, top_p, top_k, min_p or "
                        "repetition_penalty out (and chat's max_tokens: max_new_tokens) come from (vLLM's flag): auto "
                        "(default): the model's generation_config.json; vllm: none (temperature 1, no top-k, ...); DIR: "
                        "DIR/generation_config.json")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults over --generation-config's (vLLM's flag), e.g. "
                        "'{\"temperature\": 0.6, \"top_p\": 0.95, \"max_new_tokens\": 1024}'")
    g.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", default=None, metavar="JSON",
                   help="how /v1/embeddings pools the prompt's final hidden states (vLLM's flag): "
                        "'{\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true | false}'; default: a "
                        "sentence-transformers model directory's own pooling, else the last token (an encoder's "
                        "[CLS]), normalised")
    add_http_flags(p)  # --uvicorn-log-level, --root-path, --ssl-*: how the HTTP server listens (vLLM's flags)
    c = p.add_argument_group("cluster")
    c.add_argument("--mode", choices=MODES, default="auto",
                   help="disagg: prefill and decode workers; colocated: both in one worker; local: no Ray; "
                        f"auto (default): disagg with --address, a GPU or at least {MIN_CORES_FOR_DISAGG} cores, "
                        "else colocated")
    c.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="KV transfer transport (disagg)")
    c.add_argument("--kv-events-config", default="", metavar="JSON",
                   help="vLLM's flag: every worker publishes its prefix-cache blocks stored and removed as vLLM's KV "
                        "events over ZeroMQ, for a router outside the cluster (llm-d, Dynamo), e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}' "
                        "(default endpoint tcp://127.0.0.1:5557; worker k takes port + k; GET /kv_event_sources lists "
                        "them)")
    c.add_argument("--kv-transfer-config", default="", metavar="JSON",
                   help="vLLM's flag: this instance is one side of an external proxy's prefill/decode split (vLLM's "
                        "toy proxy, llm-d, Ray Serve LLM), e.g. '{\"kv_connector\": \"NixlConnector\", "
                        "\"kv_role\": \"kv_both\", \"kv_ip\": \"127.0.0.1\", \"kv_port\": 0}': requests with "
                        "kv_transfer_params.do_remote_decode keep their prompt's KV for the decode instance, which pulls "
                        "it (kv_connector_extra_config: advertise_host, hold_timeout_s, fetch_timeout_s); serves "
                        "colocated")
    c.add_argument("--num-prefill", type=int, default=1, help="prefill workers (disagg)")
    c.add_argument("--num-decode", type=int, default=1, help="decode workers")
    c.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks each prefill worker splits the model across (disagg; default: --tensor-parallel-size); "
                        "may differ from the decode workers': the prefill side lays its KV heads out their way")
    c.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks each decode worker splits the model across (default: --tensor-parallel-size)")
    c.add_argument("--router-policy", choices=POLICIES, default="least_loaded",
                   help="where the router places each request (disagg, colocated): kv_aware scores the prompt "
                        "prefix each worker really holds (its KV events: device pool, host and disk tiers) "
                        "against its load; --mode local serves one engine and places nothing")
    c.add_argument("--address", default=None, help="Ray address to join (default: start a local Ray)")
    c.add_argument("--cluster-secret", default=None,
                   help="shared secret of the control and transfer planes (default: $PDCLUSTER_CLUSTER_SECRET)")
    c.add_argument("--max-worker-restarts", type=int, default=3,
                   help="times Ray restarts a crashed worker; the router re-wires it and puts it back in rotation")
    a = p.add_argument_group("autoscaling (disagg and colocated)")
    a.add_argument("--autoscale", action="store_true",
                   help="add and drain workers to hold the SLOs below (cluster/autoscale.py)")
    a.add_argument("--min-prefill", type=int, default=None, help="default: --num-prefill")
    a.add_argument("--max-prefill", type=int, default=None, help="default: --num-prefill")
    a.add_argument("--min-decode", type=int, default=None, help="default: --num-decode")
    a.add_argument("--max-decode", type=int, default=None, help="default: --num-decode")
    a.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="p90 time to first token to hold")
    a.add_argument("--slo-tpot-ms", type=float, default=200.0, help="p90 time per output token to hold")
    p.set_defaults(func=serve_main)
    return p


def _port(value: str) -> int:
    """--port (its default from $PDCLUSTER_PORT goes through here too: argparse converts string defaults)."""
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a port number (from --port or $PDCLUSTER_PORT), got {value!r}") from None


def _api_servers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of processes or auto, got {value!r}") from None


def resolve_api_servers(num_cpus: int, serves_from_gpu: bool) -> int:
    """--api-servers auto: more than one HTTP process where a GPU's steps make tokens faster than one process
    streams them and the machine has cores to spare; one on a CPU (the model needs the cores)."""
    return GPU_API_SERVERS if serves_from_gpu and num_cpus >= MIN_CORES_FOR_API_SERVERS else 1


def _serves_from_gpu(args: argparse.Namespace) -> bool:
    """Whether this machine's engines run on a GPU: --device cuda, or auto with a GPU here. A serve process joining
    a cluster (--address) counts its own machine only (its GPUs may be elsewhere: set --api-servers there)."""
    if args.device == "cpu":
        return False
    import torch  # 1.5 s: only when a server starts

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _check_args(args: argparse.Namespace) -> None:
    """Resolve the env defaults and refuse impossible values, naming the flag."""
    apply_vllm_flags(args, DEFAULT_MODEL)
    # vLLM's variable too: a deployment moved from vLLM keeps its key in VLLM_API_KEY (a Kubernetes secret).
    args.api_key = args.api_key or os.environ.get("PDCLUSTER_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    args.cluster_secret = args.cluster_secret or os.environ.get("PDCLUSTER_CLUSTER_SECRET") or None
    args.admin_key = args.admin_key or os.environ.get("PDCLUSTER_ADMIN_KEY") or None
    if args.served_model_name is None:  # not `or`: an empty name is refused below, not replaced
        args.served_model_name = args.model
    try:  # here, before a model loads or an API process starts
        check_served_names((args.served_model_name, *args.served_model_aliases), parse_lora_modules(args.lora_modules))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: must be in 0..65535, got {args.port}")
    args.http_options = HttpOptions.from_args(args).check()  # before the model loads: a bad TLS file is one line
    if args.api_servers == "auto":
        args.api_servers = resolve_api_servers(os.cpu_count() or 1, _serves_from_gpu(args))
        if args.api_servers > 1:
            print(f"pdcluster serve: --api-servers auto -> {args.api_servers}", file=sys.stderr, flush=True)
    for flag, value in (("--num-prefill", args.num_prefill), ("--num-decode", args.num_decode),
                        ("--max-body-bytes", args.max_body_bytes), ("--api-servers", args.api_servers)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}: must be at least 1, got {value}")
    try:
        args.media_policy = MediaPolicy.from_flags(args.allowed_local_media_path, args.allowed_media_domains,
                                                   args.enable_mm_embeds, args.enable_prompt_embeds)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.mode == "local" and args.router_policy != "least_loaded":
        print(f"pdcluster serve: --router-policy {args.router_policy}: --mode local serves one engine, there is "
              "nothing to place (accepted, no effect)", file=sys.stderr, flush=True)
    if args.autoscale:
        if args.mode == "local":
            raise ConfigError("--autoscale: needs --mode disagg or colocated (local serves one in-process engine)")
        try:
            args.autoscale_config = AutoscaleConfig(
                min_prefill=args.min_prefill if args.min_prefill is not None else args.num_prefill,
                max_prefill=args.max_prefill if args.max_prefill is not None else args.num_prefill,
                min_decode=args.min_decode if args.min_decode is not None else args.num_decode,
                max_decode=args.max_decode if args.max_decode is not None else args.num_decode,
                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if args.device.startswith("cuda") and not args.address:  # a worker would fail the same way, later
        EngineConfig(device=args.device).resolve_device()
    if args.spec == "mtp":  # before any worker starts: one line, not a traceback from every actor
        from pdcluster.engine.models.mtp import find_mtp_checkpoint  # torch: when asked for, not at --help

        find_mtp_checkpoint(args.mtp_checkpoint, args.cache_dir or default_cache_dir(), args.model)
    _check_generation_config(args)
    _check_chat_template(args)
    try:
        check_max_logprobs(args.max_logprobs)
        check_response_role(args.response_role)
        args.cors = CorsPolicy.from_flags(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                          args.allow_credentials)
        if args.middleware:  # imported now, before the model loads: a wrong name is one line
            from pdcluster.cluster.api.user_middleware import load_middleware

            for qualname in args.middleware:
                load_middleware(qualname)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.pooler_config is not None:  # fastapi and the API modules: only when the flag is given
        from pdcluster.cluster.api.embeddings import check_pooler_flag

        check_pooler_flag(args.pooler_config)
    if args.max_worker_restarts < 0:
        raise ConfigError(f"--max-worker-restarts: must be >= 0, got {args.max_worker_restarts}")
    if not args.request_timeout_s > 0:
        raise ConfigError(f"--request-timeout-s: must be > 0, got {args.request_timeout_s}")
    if args.mode != "local" and args.port:  # (--mode local binds before loading the model; 0 = any port)
        # Ray and the workers take a minute to start: a busy port must fail before that, in one line.
        listen(args.host, args.port).close()
    if args.mode == "auto" and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size):
        args.mode = "disagg"  # a split for each role says there are workers of each role
        print("pdcluster serve: --mode auto -> disagg (--prefill/--decode-tensor-parallel-size)", file=sys.stderr,
              flush=True)
    _check_kv_transfer_config(args)
    _check_tracing(args)
    _check_role_splits(args)
    if args.pipeline_parallel_size > 1:
        if args.mode == "disagg":
            raise ConfigError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: --mode disagg moves KV from "
                              "rank 0's cache, which holds its stage's layers only: serve colocated (or local)")
        if args.mode == "auto":
            args.mode = "colocated"
            print("pdcluster serve: --mode auto -> colocated (--pipeline-parallel-size)", file=sys.stderr, flush=True)
    if args.mode == "auto":
        import torch  # 1.5 s: only when a server starts

        args.mode = resolve_auto_mode(args.address, os.cpu_count() or 1,
                                      torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                      max(role_splits(args)))
        print(f"pdcluster serve: --mode auto -> {args.mode}", file=sys.stderr, flush=True)
    most_ranks = max(role_splits(args)) if args.mode == "disagg" else args.tensor_parallel_size
    if args.mode == "disagg" and most_ranks > 1:  # what the workers would refuse, before Ray starts
        from pdcluster.kv_transfer.transports.ranked import check_rank_transport

        try:
            check_rank_transport(args.transport, most_ranks)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if args.device != "cpu" and not args.address:
            import torch

            from pdcluster.engine.tensor_parallel.driver import check_shared_caches

            if args.device.startswith("cuda") or torch.cuda.is_available():
                check_shared_caches(EngineConfig(device="cuda", tensor_parallel_size=most_ranks))


def _check_tracing(args: argparse.Namespace) -> None:
    from pdcluster.cluster.api.tracing import TracingUnavailable, check_tracing_flags

    try:
        check_tracing_flags(args.otlp_traces_endpoint, args.collect_detailed_traces)
    except TracingUnavailable as e:
        raise ConfigError(str(e)) from None


def _check_kv_transfer_config(args: argparse.Namespace) -> None:
    """--kv-transfer-config parses, and the instance serves colocated (its proxy splits prefill from decode)."""
    if not args.kv_transfer_config:
        return
    from pdcluster.wire.external_kv import parse_config

    try:
        parse_config(args.kv_transfer_config)
    except ValueError as e:
        raise ConfigError(f"--kv-transfer-config: {e}") from None
    if args.mode == "disagg":
        raise ConfigError("--kv-transfer-config: an external proxy splits prefill from decode across instances; "
                          "each instance serves --mode colocated or local, not disagg")
    if args.mode == "auto":
        args.mode = "colocated"
        print("pdcluster serve: --mode auto -> colocated (--kv-transfer-config: the proxy disaggregates)",
              file=sys.stderr, flush=True)


def _check_generation_config(args: argparse.Namespace) -> None:
    """--generation-config DIR must hold the file and --override-generation-config be a JSON object of good values:
    said in one line now, not by every API process once the workers are up."""
    try:
        overrides = json_flag("--override-generation-config", args.override_generation_config)
        sampling_defaults(None, "vllm", overrides)
        if args.generation_config not in ("auto", "vllm"):
            sampling_defaults(None, args.generation_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    args.override_generation_config = overrides


def _check_chat_template(args: argparse.Namespace) -> None:
    """--chat-template read (a file, or the template) and compiled, --default-chat-template-kwargs parsed: a bad
    one is one line now. The flags then carry the template's text and the variables' dict."""
    try:
        if args.chat_template is not None:
            from pdcluster.engine.tokenizer import compile_chat_template  # jinja2: only when asked for

            args.chat_template = chat_template_text(args.chat_template)
            compile_chat_template(args.chat_template, "--chat-template")
        if isinstance(args.default_chat_template_kwargs, str):
            kwargs = json_flag("--default-chat-template-kwargs", args.default_chat_template_kwargs)
            args.default_chat_template_kwargs = check_template_kwargs(kwargs, "--default-chat-template-kwargs")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def role_splits(args: argparse.Namespace) -> tuple[int, int]:
    """Ranks of a prefill and of a decode worker."""
    return (args.prefill_tensor_parallel_size or args.tensor_parallel_size,
            args.decode_tensor_parallel_size or args.tensor_parallel_size)


def _check_role_splits(args: argparse.Namespace) -> None:
    """--prefill/--decode-tensor-parallel-size: at least 1, and only where the mode has that role's workers."""
    for role in ("prefill", "decode"):
        value = getattr(args, f"{role}_tensor_parallel_size")
        if value is None:
            continue
        flag = f"--{role}-tensor-parallel-size"
        if value < 1:
            raise ConfigError(f"{flag}: must be at least 1, got {value}")
        if args.mode == "local" or (role == "prefill" and args.mode == "colocated"):
            raise ConfigError(f"{flag}: --mode {args.mode} has no {role} workers of their own; use "
                              "--tensor-parallel-size")


def resolve_auto_mode(address: str | None, num_cpus: int, num_gpus: int, tensor_parallel_size: int = 1) -> str:
    """Disaggregate when each role can have its own device: a cluster to join, two GPUs or more, or
    (without a GPU) enough cores here. One GPU serves colocated by default: prefill and decode would
    share it (``--mode disagg`` does that, each worker asking Ray for half), and one worker batching
    both serves faster there; on a small CPU box one colocated worker with every core serves faster.
    Tensor-parallel workers serve colocated (each worker's ranks take the cores or GPUs a role would have; on GPUs
    their split caches are not transferred yet)."""
    if tensor_parallel_size > 1:
        return "colocated"
    if address or num_gpus >= 2 or (not num_gpus and num_cpus >= MIN_CORES_FOR_DISAGG):
        return "disagg"
    return "colocated"


def serve_main(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.api_key is None and args.host not in LOOPBACK:
        print(f"pdcluster serve: warning: listening on {args.host} without an API key (set --api-key or "
              "PDCLUSTER_API_KEY)", file=sys.stderr, flush=True)
    if args.mode != "local":
        from pdcluster.cluster.launcher import run_cluster  # Ray, torch, the router: see the docstring

        return run_cluster(args)
    return _serve_local(args)


def _serve_local(args: argparse.Namespace) -> int:
    from pdcluster.cluster.api.app import build_app  # torch and the engine: see the docstring
    from pdcluster.cluster.local_router import LocalRouter

    sock = listen(args.host, args.port)  # before loading the model: a busy port fails at once
    try:
        engine_config = engine_config_from_args(args)
        router = LocalRouter(engine_config, request_timeout_s=args.request_timeout_s)
        options = ApiOptions.from_args(args, runtime_lora=engine_config.enable_lora)
    except BaseException:
        sock.close()
        raise
    try:
        if args.api_servers > 1:
            from pdcluster.cluster.frontend.supervisor import ApiServers

            servers = ApiServers(args.api_servers, sock, args.host)
            try:
                return servers.run(router, args.served_model_name, options, http=args.http_options)
            finally:
                servers.close()
        app = build_app(router, args.served_model_name, metrics=Metrics(args.served_model_name,
                                                                        prefix=options.metrics_prefix),
                        **options.app_kwargs())
        return run_server(app, args.host, args.port, args.served_model_name, sock=sock, http=args.http_options)
    finally:
        router.close()
