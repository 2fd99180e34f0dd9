"""`vllm serve` command lines, run as they are: the model as a positional argument (``serve Qwen/Qwen3-0.6B``) and
vLLM's flags that have no flag of ours. A deployment's manifest carries them, and "unrecognized arguments" would fail
its first start for nothing. Each is one of three kinds:

- accepted without effect, with one line saying why (``NO_OP_FLAGS``, ``NO_OP_VALUE_FLAGS``): what they tune does not
  exist here or is always done;
- mapped onto ours (``--enforce-eager`` = ``--no-cuda-graphs``, ``--kv-offloading-size`` = ``--kv-offload-host-gib``,
  ``--data-parallel-size N`` = N workers, ...): ``apply_vllm_flags``;
- refused in one line naming what to do instead (``REFUSED_FLAGS``, and values of the others that would change what a
  user gets: ``--tokenizer-mode mistral``, ``--cpu-offload-gb 8``): accepting them would serve something else.

Flags with a meaning of their own are real flags elsewhere (``--enable-prefix-caching``: cluster/engine_args.py;
``--chat-template``, ``--generation-config``, the HTTP server's: serve_cli.py).
"""

from __future__ import annotations

import argparse
import sys

from pdcluster.engine.config import ConfigError

# Reasons several flags share.
_CHUNKED = "prompts are prefilled in chunks of --prefill-chunk-size beside decodes"
_XGRAMMAR = "structured output is always compiled by xgrammar; the answers follow the same schema"
_NO_IMAGE_CACHE = "images are processed once per request, with no cache to size or turn off"
_RAY_PLACES = "engines are placed by Ray across machines (--address): use --num-prefill/--num-decode"

# dest -> (flag, why it changes nothing here): switches.
NO_OP_FLAGS = {
    "trust_remote_code": ("--trust-remote-code", "no model code is downloaded or run: an architecture served here is "
                                                 "built in, any other is refused by name"),
    "disable_log_requests": ("--disable-log-requests", "requests are not logged one by one"),
    "enable_log_requests": ("--enable-log-requests", "requests are not logged one by one (the /metrics histograms "
                                                     "and each request's id in the workers' logs are)"),
    "enable_log_outputs": ("--enable-log-outputs", "outputs are not logged"),
    "disable_log_stats": ("--disable-log-stats", "engine statistics are served on /metrics, not logged"),
    "enable_chunked_prefill": ("--enable-chunked-prefill", "prompts are always prefilled in chunks "
                                                           "(--prefill-chunk-size)"),
    "enable_prompt_tokens_details": ("--enable-prompt-tokens-details", "usage always gives "
                                                                       "prompt_tokens_details.cached_tokens"),
    "disable_custom_all_reduce": ("--disable-custom-all-reduce", "tensor-parallel ranks reduce with torch.distributed "
                                                                 "(NCCL on GPUs, gloo on CPUs)"),
    "disable_frontend_multiprocessing": ("--disable-frontend-multiprocessing",
                                         "the HTTP server runs in the serving process unless --api-servers asks for "
                                         "more"),
    "enable_expert_parallel": ("--enable-expert-parallel", "a MoE layer's experts are split by "
                                                           "--tensor-parallel-size (each expert's rows, as vLLM's "
                                                           "tensor-parallel MoE); the answers are the same"),
    "ray_workers_use_nsight": ("--ray-workers-use-nsight", "profile with `pdcluster profile` or nsys around the "
                                                           "worker instead"),
    "disable_mm_preprocessor_cache": ("--disable-mm-preprocessor-cache", _NO_IMAGE_CACHE),
}

# dest -> (flags, why it changes nothing here, the values accepted or None for any): flags with a value.
NO_OP_VALUE_FLAGS = {
    "swap_space": (("--swap-space",), "a preempted request's KV is recomputed or kept in the offload tiers "
                                      "(--kv-offload-host-gib), never swapped to a fixed CPU space", None),
    "distributed_executor_backend": (("--distributed-executor-backend",), "workers are Ray actors across machines "
                                                                          "and processes on one", None),
    "compilation_config": (("--compilation-config", "-O"), "no torch.compile: the kernels are written out, and "
                                                            "decode steps are CUDA graphs on a GPU", None),
    "max_seq_len_to_capture": (("--max-seq-len-to-capture",), "CUDA graphs capture decode batches, whatever the "
                                                              "sequence length", None),
    "prefix_caching_hash_algo": (("--prefix-caching-hash-algo",), "blocks are named by a 64-bit BLAKE2b chain of "
                                                                  "their tokens, the same in every process", None),
    "long_prefill_token_threshold": (("--long-prefill-token-threshold",), _CHUNKED, None),
    "max_num_partial_prefills": (("--max-num-partial-prefills",), _CHUNKED, None),
    "max_long_partial_prefills": (("--max-long-partial-prefills",), _CHUNKED, None),
    "num_scheduler_steps": (("--num-scheduler-steps",), "every step is scheduled (vLLM's V1 engine dropped the "
                                                        "flag); --async-scheduling overlaps them", None),
    "guided_decoding_backend": (("--guided-decoding-backend",), _XGRAMMAR, None),
    "structured_outputs_config": (("--structured-outputs-config",), _XGRAMMAR, None),
    "lora_dtype": (("--lora-dtype",), "adapters run in the model's dtype", ("auto", "bfloat16", "float16", "float32")),
    "code_revision": (("--code-revision",), "no model code is downloaded or run", None),
    "tokenizer_mode": (("--tokenizer-mode",), "the model's tokenizer.json is read by the tokenizers library",
                       ("auto", "hf", "slow")),
    "quantization": (("--quantization", "-q"), "a quantized checkpoint's method is read from its config.json (FP8, "
                                               "INT8, AWQ, GPTQ and MXFP4 weights are dequantized at load); a bf16 "
                                               "checkpoint is not quantized on the fly", None),
    "mm_processor_cache_gb": (("--mm-processor-cache-gb",), _NO_IMAGE_CACHE, None),
    "max_log_len": (("--max-log-len",), "prompts are not logged", None),
    "max_parallel_loading_workers": (("--max-parallel-loading-workers",), "each worker loads its own shard", None),
    "model_impl": (("--model-impl",), "every model is this project's own implementation", None),
    "scheduling_policy": (("--scheduling-policy",), "requests are ordered by their priority field, lower first, "
                                                    "first come first served among equals (no priority: 0)",
                          ("fcfs", "priority")),
    "chat_template_content_format": (("--chat-template-content-format",), "a message's text parts reach the template "
                                                                          "as one string", ("auto", "string")),
    "h11_max_incomplete_event_size": (("--h11-max-incomplete-event-size",), "the server parses HTTP with httptools",
                                      None),
}

# dest -> (flag, nargs, what to do instead): refused in one line, whatever the value.
REFUSED_FLAGS = {
    "logits_processors": ("--logits-processors", "+", "no code is imported into the engine by name (requests' "
                                                      "logit_bias, bad_words and allowed_token_ids are served)"),
    "tool_parser_plugin": ("--tool-parser-plugin", 1, "no code is imported into the server by name; "
                                                      "--tool-call-parser names the built-in parsers"),
    "headless": ("--headless", 0, "a machine joins a cluster as a Ray node (`ray start --address`), not as a "
                                  "headless data-parallel engine"),
    "data_parallel_address": ("--data-parallel-address", 1, _RAY_PLACES),
    "data_parallel_rpc_port": ("--data-parallel-rpc-port", 1, _RAY_PLACES),
    "data_parallel_size_local": ("--data-parallel-size-local", 1, _RAY_PLACES),
}

def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="vLLM's config file: a YAML mapping of flag names to values, under the flags typed here "
                             "(cli/config_file.py)")
    g = parser.add_argument_group("vLLM flags mapped onto ours")
    g.add_argument("--enforce-eager", action="store_true", help="the same as --no-cuda-graphs")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="vLLM's CPU KV offloading buffer: the same as --kv-offload-host-gib")
    g.add_argument("--kv-offloading-backend", default="native", choices=("native", "lmcache"),
                   help="native (the host tier); lmcache is refused")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="GIB",
                   help="0 only: weights are not offloaded to CPU memory")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="N engines, each the whole model: N colocated workers (with --mode disagg: --num-prefill N "
                        "--num-decode N)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="the largest is --max-cudagraph-capture-size (the buckets below it are ours: 1, 2, 4, 8, "
                        "then every 16)")
    g = parser.add_argument_group("vLLM flags accepted without effect (each says why when given)")
    for dest, (flag, why) in NO_OP_FLAGS.items():
        g.add_argument(flag, dest=dest, action="store_true", help=why)
    for dest, (flags, why, values) in NO_OP_VALUE_FLAGS.items():
        metavar = "JSON" if dest in ("compilation_config", "structured_outputs_config") else "VALUE"
        g.add_argument(*flags, dest=dest, default=None, metavar=metavar,
                       help=why + ("" if values is None else f" ({', '.join(values)})"))
    g = parser.add_argument_group("vLLM flags refused (each says what to do instead)")
    for dest, (flag, nargs, why) in REFUSED_FLAGS.items():
        if nargs == 0:
            g.add_argument(flag, dest=dest, action="store_true", help=why)
        else:
            g.add_argument(flag, dest=dest, default=None, nargs=None if nargs == 1 else nargs, help=why)


def _say(flag: str, why: str) -> None:
    print(f"pdcluster serve: {flag}: accepted, no effect ({why})", file=sys.stderr, flush=True)


def apply_vllm_flags(args: argparse.Namespace, default_model: str) -> None:
    """The positional model into --model (given twice, differently: a ConfigError); vLLM's flags mapped onto ours; a
    line for each no-op; a ConfigError for a refused flag or value."""
    if args.model_tag is not None:
        if args.model not in (default_model, args.model_tag):
            raise ConfigError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}: give it "
                              "once")
        args.model = args.model_tag
    for dest, (flag, _, why) in REFUSED_FLAGS.items():
        if getattr(args, dest, None) not in (None, False):
            raise ConfigError(f"{flag}: not supported here: {why}")
    _apply_mapped(args)
    for dest, (flag, why) in NO_OP_FLAGS.items():
        if getattr(args, dest, False):
            _say(flag, why)
    for dest, (flags, why, values) in NO_OP_VALUE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if values is not None and value not in values:
            raise ConfigError(f"{flags[0]} {value}: not served here ({why}): give one of {', '.join(values)}")
        _say(flags[0], why)


def _apply_data_parallel(args: argparse.Namespace) -> None:
    """vLLM's ``--data-parallel-size N``: N engine replicas behind one API, each holding the whole model (split by
    --tensor-parallel-size). Here those are N workers placed by Ray and fed by the router: N colocated workers (mode
    auto serves colocated, as vLLM's replicas each prefill and decode), or with --mode disagg N of each role."""
    size = args.data_parallel_size
    if size == 1:
        return
    if size < 1:
        raise ConfigError(f"--data-parallel-size: must be at least 1, got {size}")
    if args.mode == "local":
        raise ConfigError(f"--data-parallel-size {size}: --mode local serves one in-process engine; give --mode "
                          f"colocated (or leave --mode out) for {size} engines")
    roles = [("--num-decode", "num_decode")] + ([("--num-prefill", "num_prefill")] if args.mode == "disagg" else [])
    for flag, dest in roles:
        if getattr(args, dest) not in (1, size):  # 1: the flag's default
            raise ConfigError(f"--data-parallel-size {size} and {flag} {getattr(args, dest)}: the same setting "
                              "twice; give one")
        setattr(args, dest, size)
    if args.mode == "auto":
        args.mode = "colocated"
    what = "prefill and decode workers each" if args.mode == "disagg" else "colocated workers"
    print(f"pdcluster serve: --data-parallel-size {size}: {size} {what}, placed by Ray, fed by the router",
          file=sys.stderr, flush=True)


def _apply_mapped(args: argparse.Namespace) -> None:
    if args.cuda_graph_sizes is not None:
        top = max(args.cuda_graph_sizes)
        if top < 1:
            raise ConfigError(f"--cuda-graph-sizes: want positive batch sizes, got {args.cuda_graph_sizes}")
        if args.max_cuda_graph_batch not in (512, top):  # 512: --max-cudagraph-capture-size's default
            raise ConfigError(f"--cuda-graph-sizes up to {top} and --max-cudagraph-capture-size "
                              f"{args.max_cuda_graph_batch}: the same setting twice; give one")
        args.max_cuda_graph_batch = top
        print(f"pdcluster serve: --cuda-graph-sizes: decode batches up to {top} run as CUDA graphs (buckets 1, 2, 4, "
              "8, then every 16)", file=sys.stderr, flush=True)
    if args.enforce_eager:
        args.no_cuda_graphs = True
        args.mixed_cuda_graph_tokens = 0
    if args.kv_offloading_backend == "lmcache":
        raise ConfigError("--kv-offloading-backend lmcache: not supported here: the native host tier "
                          "(--kv-offloading-size GIB, or --kv-offload-host-gib with --kv-offload-disk-dir for a disk "
                          "tier) offloads evicted KV blocks")
    if args.kv_offloading_size is not None:
        if not args.kv_offloading_size > 0:
            raise ConfigError(f"--kv-offloading-size: must be > 0 GiB, got {args.kv_offloading_size}")
        if args.kv_offload_host_gib and args.kv_offload_host_gib != args.kv_offloading_size:
            raise ConfigError(f"--kv-offloading-size {args.kv_offloading_size} and --kv-offload-host-gib "
                              f"{args.kv_offload_host_gib}: the same setting twice; give one")
        args.kv_offload_host_gib = args.kv_offloading_size
    if args.cpu_offload_gb != 0:
        raise ConfigError(f"--cpu-offload-gb {args.cpu_offload_gb:g}: not supported here: weights stay on the device "
                          "(a model too large for one is split by --tensor-parallel-size)")
    _apply_data_parallel(args)
    if args.tokenizer and args.tokenizer.rstrip("/") == args.model.rstrip("/"):
        args.tokenizer = ""  # the model's own, as a vLLM line often spells it out
    if args.tokenizer_revision and not args.tokenizer and args.tokenizer_revision == (args.revision or "main"):
        args.tokenizer_revision = ""  # the model's own revision, spelled out (any other: EngineConfig refuses it)
