"""The engine flags every command that builds an engine shares (`pdcluster generate`, `serve`: one set
for every worker), and the EngineConfig they make. Below both the CLI and the Ray launcher, which
rebuilds the config from the parsed `serve` flags."""

from __future__ import annotations

import argparse
import os

from pdcluster.engine.config import DTYPES, KV_CACHE_DTYPES, SPEC_METHODS, ConfigError, EngineConfig

DEFAULT_MODEL = "smollm2"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="built-in name (smollm2, tiny-random), a Hugging Face model directory, or a Hub id "
                        "(owner/name: fetched into the Hugging Face cache, HF_HOME, HF_TOKEN)")
    g.add_argument("--revision", default="", help="the Hub id's branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default="",
                   help="where a Hub id's files go (default: the Hugging Face cache, $HF_HOME/hub)")
    g.add_argument("--tokenizer", default="",
                   help="another tokenizer for the model, as vLLM's: a built-in name, a directory with tokenizer.json "
                        "or a Hub id (its tokenizer and chat template replace the model's; default: the model's own)")
    g.add_argument("--tokenizer-revision", default="", help="the --tokenizer Hub id's branch, tag or commit")
    g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "gguf", "dummy"),
                   help="auto (the same as safetensors and gguf: the checkpoint's safetensors, or its GGUF converted); "
                        "dummy, as vLLM's: random weights in the model's shapes, no weight file read or fetched (a "
                        "Hub id's configs and tokenizer only), for benchmarks: real step times and memory, noise "
                        "for tokens")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA where torch sees a GPU: in a cluster, the GPU Ray gave the worker), cpu, cuda "
                        "or cuda:N")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto = the checkpoint's dtype (bfloat16 for smollm2: prepacked bf16 GEMMs on CPU)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 halve a "
                        "16-bit cache's bytes a token: twice the tokens in the pool, half the bytes a KV transfer "
                        "moves")
    g.add_argument("--hf-overrides", default="", metavar="JSON",
                   help="keys set over the model's config.json, as vLLM's (e.g. '{\"architectures\": "
                        "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                        "\"method\": \"from_2_way_softmax\"}' serves Qwen3-Reranker as a cross-encoder)")
    g.add_argument("--max-model-len", type=int, default=0, help="0 = the model's limit, capped at 4096")
    g.add_argument("--limit-mm-per-prompt", default="", metavar="JSON",
                   help="how many images one prompt may hold, as vLLM's flag: '{\"image\": 4}' (default 16); "
                        "'{\"image\": 0}' serves a LLaVA as a text model without loading its vision tower")
    g.add_argument("--mm-processor-kwargs", default="", metavar="JSON",
                   help="image processor settings, as vLLM's flag: Qwen-VL's '{\"max_pixels\": 1003520}' (and "
                        "min_pixels: the pixel budget an image is resized within, so its placeholders), Gemma 3's "
                        "do_pan_and_scan (false only)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="0 = size the pool from --kv-cache-memory-gib")
    g.add_argument("--kv-cache-memory-gib", type=float, default=0.0,
                   help="KV pool size per worker; 0 = automatic: on a GPU what --gpu-memory-utilization leaves after "
                        "the weights and a step's activations, on a CPU 1 GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory a worker may use in all (workers sharing one GPU split it)")
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help="most requests running at once; 0 = the device's default (128 on a CPU, 256 on a GPU, 1024 on "
                        "one of 70 GiB or more other than an A100: vLLM's serving defaults; 64 for a hybrid)")
    g.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="token budget of one step; 0 = the device's default (2048 on a CPU and smaller GPUs, 8192 on "
                        "an H100/H200, 16384 from 160 GiB)")
    g.add_argument("--prefill-chunk-size", type=int, default=0,
                   help="at most this many prompt tokens of one request per step (chunked prefill); 0 = up to the "
                        "step's whole --max-num-batched-tokens, as vLLM")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's spelling: --no-enable-prefix-caching is --no-prefix-caching (on by default)")
    g.add_argument("--kv-offload-host-gib", type=float, default=0.0,
                   help="host memory for KV blocks the device pool evicts (pinned on a GPU); a prompt whose prefix "
                        "is there is loaded back instead of recomputed (0 = off)")
    g.add_argument("--kv-offload-disk-dir", default="",
                   help="local directory for KV blocks pushed out of host memory (or out of the device pool "
                        "without a host tier), checksummed per block; in a cluster each worker uses a "
                        "subdirectory named after its id (needs --kv-offload-disk-gib)")
    g.add_argument("--kv-offload-disk-gib", type=float, default=0.0,
                   help="how much of --kv-offload-disk-dir each worker may fill")
    g.add_argument("--kv-offload-shared-dir", default="",
                   help="a directory every worker sees (a node's disk, an NFS export, a volume every pod mounts): "
                        "each worker writes the KV blocks it caches there for all of them, and a prefix found there "
                        "is loaded by whichever worker serves it (needs --kv-offload-shared-gib)")
    g.add_argument("--kv-offload-shared-gib", type=float, default=0.0,
                   help="how much of --kv-offload-shared-dir the workers may fill together")
    g.add_argument("--no-decode-prefix-reuse", action="store_true",
                   help="disagg: a decode worker receives a prompt's whole KV even when its own prefix cache "
                        "holds the start of it (default: it asks the prefill worker only for the rest)")
    g.add_argument("--spec", default="none", choices=SPEC_METHODS, help="speculative decoding method")
    g.add_argument("--num-spec-tokens", type=int, default=0, help="draft tokens per step (k)")
    g.add_argument("--mtp-checkpoint", default="",
                   help="MTP head for --spec mtp: a safetensors file from bench/train_mtp.py (default: the one "
                        "trained for --model in the cache dir; refused when there is none), an EAGLE draft's "
                        "directory (EAGLE-1 or HASS, as vLLM's method eagle), or 'random'")
    g.add_argument("--draft-model", default="",
                   help="the draft for --spec draft_model: a smaller causal LM with the model's tokenizer and KV "
                        "shape (KV heads x head size), as a directory, a Hub id or a built-in name")
    g.add_argument("--speculative-config", action=SpeculativeConfig, metavar="JSON",
                   help="vLLM's form of the flags above, e.g. '{\"method\": \"eagle\", \"model\": DIR, "
                        "\"num_speculative_tokens\": 3}': method ngram (prompt_lookup_min / _max), eagle or eagle3 "
                        "(model: the draft's directory), mtp or deepseek_mtp (the model's own MTP layers, or model: "
                        "a head), draft_model (model: the draft model; the method when only a model is given)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of through CUDA graphs (vLLM's --enforce-eager)")
    g.add_argument("--mixed-cuda-graph-tokens", type=int, default=0, metavar="N",
                   help="on a GPU, prefill and mixed steps of up to N tokens through piecewise CUDA graphs (the "
                        "forward between attention calls captured per token-count bucket, attention eager between; "
                        "dense attention models). Default 0: such steps run eagerly (not yet measured on a GPU)")
    g.add_argument("--max-cudagraph-capture-size", dest="max_cuda_graph_batch", type=int, default=512, metavar="N",
                   help="on a GPU, the largest decode batch run as a CUDA graph (vLLM's flag; default 512): buckets "
                        "1, 2, 4, 8, then every 16 up to it, each captured at start-up; larger batches run eagerly")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step n+1 while step n runs and, without speculation, penalties or grammars, queue "
                        "it on the device before step n's tokens are read (vLLM's --async-scheduling). In a "
                        "cluster the decode workers launch ahead; prefill workers finish each step first (their KV "
                        "sends run inside the step). Default: on where the engine runs on CUDA, off on a CPU, where "
                        "both threads share the cores")
    g.add_argument("--no-skinny-gemm", action="store_true",
                   help="CUDA: keep cuBLAS for decode steps of up to 128 rows instead of the weight-streaming "
                        "Triton matmuls, which is otherwise used for the shapes where it measured faster at start-up")
    g.add_argument("--no-skinny-epilogues", action="store_true",
                   help="CUDA: run the rotary embedding, KV write and RMSNorms after the weight-streaming matmuls as "
                        "kernels of their own instead of in the kernel that sums the matmul's partial results")
    g.add_argument("--no-pdl", action="store_true",
                   help="CUDA (Hopper and later): launch the decode graphs' Triton kernels one after another instead "
                        "of with programmatic dependent launch (each placed, and loading its weights, while the one "
                        "before it finishes)")
    g.add_argument("--num-threads", type=int, default=0,
                   help="torch threads of each worker (of each rank with tensor parallelism); 0: a share of the cores")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (GPUs cuda:0..n-1 of a worker, or processes sharing its "
                        "CPU cores), vLLM's tensor parallelism: the Llama family and its Mixtral / Qwen-MoE / GraniteMoe models")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="cut the model's layers into this many consecutive stages, a rank each (GPUs cuda:0..n-1 of a "
                        "worker, or processes sharing its CPU cores), vLLM's pipeline parallelism: a model too large "
                        "for one device, the Llama family (dense and MoE); each rank holds its layers' weights and KV")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a request's tokens and logprobs are bitwise the same whatever the "
                        "batch, chunking, speculation, placement or recovery (on by default on CPU, --no-deterministic for the "
                        "library GEMMs and, on hybrids, the chunked Mamba scan; off by default on CUDA, where it "
                        "costs 2.9x in prefill; see README)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cache-dir", default="", help="where converted models live (default ~/.cache/pdcluster)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served beside the base model; a request picks one by its "
                        "name in the API's 'model' field. Every worker loads them all")
    g.add_argument("--max-lora-rank", type=int, default=64, help="refuse adapters of a higher rank")
    g.add_argument("--enable-lora", action="store_true",
                   help="adapters may also be loaded and unloaded while serving (POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter, vLLM's routes; on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true too)")
    g.add_argument("--max-loras", type=int, default=16, help="how many LoRA adapters are held at once")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="requests may give their prompt as embeddings (vLLM's prompt_embeds on /v1/completions, "
                        "SGLang's input_embeds on /generate; offline {\"prompt_embeds\": tensor})")


class SpeculativeConfig(argparse.Action):
    """``--speculative-config JSON`` (vLLM's flag), set as --spec, --num-spec-tokens and --mtp-checkpoint or
    --draft-model (and the n-gram lookup's bounds) as it is parsed, so every command reads one set of fields. What
    this engine does not draft with (medusa, suffix, ...) and keys it does not know are refused by name (exit 2)."""

    METHODS = {"ngram": "ngram", "eagle": "mtp", "eagle3": "mtp", "mtp": "mtp", "deepseek_mtp": "mtp",
               "draft_model": "draft_model"}
    KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")

    def __call__(self, parser, namespace, values, option_string=None):
        import json

        try:
            config = json.loads(values)
        except json.JSONDecodeError as e:
            parser.error(f"{option_string}: not JSON ({e})")
        if not isinstance(config, dict):
            parser.error(f"{option_string}: want a JSON object, got {values!r}")
        unknown = sorted(set(config) - set(self.KEYS))
        if unknown:
            parser.error(f"{option_string}: unknown key {unknown[0]!r} (this engine reads {', '.join(self.KEYS)})")
        method = config.get("method")
        if method is None and config.get("model"):
            method = "draft_model"  # vLLM's rule: a model with no method is a draft model
        if method not in self.METHODS:
            parser.error(f"{option_string}: method {method!r} is not served (use one of "
                         f"{', '.join(self.METHODS)})")
        model = config.get("model") or ""
        if not isinstance(model, str) or (method in ("eagle", "eagle3", "draft_model") and not model):
            parser.error(f"{option_string}: method {method!r} needs \"model\": the draft's directory")
        if method == "ngram" and model:
            parser.error(f"{option_string}: method 'ngram' drafts from the prompt; it takes no \"model\"")
        k = config.get("num_speculative_tokens", 0)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            parser.error(f"{option_string}: num_speculative_tokens must be a non-negative integer, got {k!r}")
        namespace.spec, namespace.num_spec_tokens = self.METHODS[method], k
        namespace.mtp_checkpoint, namespace.draft_model = ("", model) if method == "draft_model" else (model, "")
        for key, field in (("prompt_lookup_min", "ngram_min"), ("prompt_lookup_max", "ngram_max")):
            if key in config:
                if method != "ngram" or not isinstance(config[key], int) or isinstance(config[key], bool):
                    parser.error(f"{option_string}: {key} is an integer for method 'ngram'")
                setattr(namespace, field, config[key])


# Flags whose dest is the EngineConfig field of the same name (the others are mapped by hand below).
SAME_NAMED_FLAGS = (
    "model", "dtype", "kv_cache_dtype", "device", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory_gib",
    "gpu_memory_utilization",
    "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "kv_offload_host_gib", "kv_offload_disk_dir",
    "kv_offload_shared_dir", "kv_offload_shared_gib",
    "kv_offload_disk_gib", "mtp_checkpoint", "draft_model", "num_threads", "seed", "cache_dir", "revision", "download_dir",
    "tokenizer", "tokenizer_revision", "max_lora_rank",
    "enable_lora", "max_loras", "mixed_cuda_graph_tokens", "hf_overrides", "tensor_parallel_size",
    "pipeline_parallel_size",
    "limit_mm_per_prompt", "mm_processor_kwargs", "max_cuda_graph_batch", "enable_prompt_embeds",
)


def runtime_lora_env() -> bool:
    """vLLM's switch for its runtime LoRA routes, honoured as --enable-lora (a vLLM deployment's env carries it)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")


def _prefix_caching(args: argparse.Namespace) -> bool:
    vllm_spelling = getattr(args, "enable_prefix_caching", None)
    if vllm_spelling and args.no_prefix_caching:
        raise ConfigError("--enable-prefix-caching and --no-prefix-caching: give one")
    return not args.no_prefix_caching if vllm_spelling is None else vllm_spelling


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    num_spec = args.num_spec_tokens
    if args.spec != "none" and num_spec == 0:
        num_spec = 3
    return EngineConfig(
        **{name: getattr(args, name) for name in SAME_NAMED_FLAGS if name != "enable_lora"},
        enable_lora=args.enable_lora or runtime_lora_env(),
        enable_prefix_caching=_prefix_caching(args),
        load_format="dummy" if args.load_format == "dummy" else "auto",  # safetensors, gguf: what auto reads
        decode_prefix_reuse=not args.no_decode_prefix_reuse,
        cuda_graphs=not args.no_cuda_graphs,
        skinny_gemm=not args.no_skinny_gemm,
        pdl=not args.no_pdl,
        skinny_epilogues=not args.no_skinny_epilogues,
        async_scheduling=args.async_scheduling,
        spec_method=args.spec,
        num_spec_tokens=num_spec,
        lora_modules=tuple(args.lora_modules),
        kv_transfer_config=getattr(args, "kv_transfer_config", ""),  # serve's flag
        kv_events_config=getattr(args, "kv_events_config", ""),  # serve's flag
        **({} if getattr(args, "deterministic", None) is None else {"deterministic": args.deterministic}),
        # --speculative-config's n-gram bounds (no flags of their own).
        **{field: getattr(args, field) for field in ("ngram_min", "ngram_max") if hasattr(args, field)},
    )
