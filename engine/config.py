"""Engine configuration. Validation errors name the field, the bad value and what is allowed."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from pdcluster.engine.kv_offload.config import OffloadConfig
from pdcluster.wire.external_kv import parse_config as parse_external_kv
from pdcluster.wire.kv_events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from pdcluster.engine.models.hf_overrides import parse_hf_overrides
from pdcluster.engine.pipeline_checks import pipeline_refusals
from pdcluster.engine.multimodal.limits import image_processor_kwargs, max_images_per_prompt

# vLLM's --load-format values served: auto (the checkpoint's safetensors, a GGUF converted) and dummy (random weights).
LOAD_FORMATS = ("auto", "dummy")


class ConfigError(ValueError):
    pass


DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's element type (vLLM's --kv-cache-dtype): "auto" = the model's dtype; "fp8" = "fp8_e4m3" (float8_e4m3fn:
# half the bytes of a 16-bit cache a token, so twice the tokens in the pool and half on the wire), "fp8_e5m2".
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" too: one GPU of several


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are fast only with avx512_bf16 or AMX; on an AVX2-only CPU oneDNN emulates them,
    ~5x slower than fp32 (measured on a Zen 3 EPYC: 7 vs 33 GFLOP/s)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
SPEC_METHODS = ("none", "ngram", "mtp", "draft_model")


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``name=path`` strings (vLLM's ``--lora-modules`` form) as {name: path}; a malformed one or a
    repeated name is a ValueError saying which."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {spec!r} is not of the form name=path")
        if name in out:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out[name] = path
    return out
DETERMINISTIC_ENV = "PDCLUSTER_DETERMINISTIC"  # "0"/"1": the default of EngineConfig.deterministic


def default_deterministic() -> bool:
    """EngineConfig.deterministic when not given: $PDCLUSTER_DETERMINISTIC ("0" or "1") if set, else
    DETERMINISTIC_DEFAULT. The variable reaches engines built by code that takes no flag (profile's
    co-run child process, the planner's served check)."""
    value = os.environ.get(DETERMINISTIC_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ConfigError(f"{DETERMINISTIC_ENV}: {value!r} is not 0 or 1")
    return DETERMINISTIC_DEFAULT


# On: it costs nothing measurable on bench/vs_vllm.py's offline measures (smollm2 bf16, a quiet box,
# bench/results/deterministic_cost.json: 2 threads prefill -3.5%, decode +12%, TTFT +9%, TPOT 1.56x;
# 1 thread +5%, +2%, +4%, 1.69x), and it is what makes the token-exact promises hold in bf16.
DETERMINISTIC_DEFAULT = True


@dataclass
class EngineConfig:
    model: str = "smollm2"
    # "auto": the model's own dtype (config.json torch_dtype), as vLLM does; see resolve_dtype().
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # "auto": CUDA when torch sees a GPU (in a Ray actor: the one Ray gave it), else the CPU.
    device: str = "cpu"
    # 0 = the model's max_position_embeddings, capped at 4096.
    max_model_len: int = 0
    block_size: int = 16
    # Size of the paged KV pool: an explicit block count wins over a memory budget, a budget in GiB over the
    # automatic one (0): on a GPU what gpu_memory_utilization of it leaves after the weights and a step's
    # activations (engine/kv_budget.py, as vLLM sizes it), on a CPU 1 GiB.
    num_kv_blocks: int = 0
    kv_cache_memory_gib: float = 0.0
    gpu_memory_utilization: float = 0.9
    # The cap on running requests and the token budget of one step (all requests together); 0 = the device's
    # default (engine/batch_limits.py, as vLLM's: 1,024 and 8,192 on an H100/H200, 128 and 2,048 on a CPU), resolved
    # where the engine loads (resolve_batch_limits).
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # Chunked prefill: at most this many prompt tokens of one request per step; 0 = the step's whole budget (vLLM's
    # long_prefill_token_threshold 0, its default). A cap costs a CPU one more pass over the weights per chunk: an
    # 850-token prompt took 337 ms as two 512-token chunks, 316 ms as one (bench/results/
    # vs_vllm_850_token_prompts_s77.json), against vLLM's 284.
    prefill_chunk_size: int = 0
    enable_prefix_caching: bool = True
    # vLLM's --kv-transfer-config (wire/external_kv.py): this instance takes part in an external proxy's
    # prefill/decode split (a request's kv_transfer_params). "" = off.
    kv_transfer_config: str = ""
    # KV offload tiers (engine/kv_offload/): blocks the device pool evicts move to host memory, then to a
    # disk directory, and come back on a prefix hit. 0 / "" = that tier off.
    kv_offload_host_gib: float = 0.0
    kv_offload_disk_dir: str = ""
    kv_offload_disk_gib: float = 0.0
    # A tier below them that every worker shares (engine/kv_offload/shared_tier.py): a folder they all see (a node's
    # disk, an NFS export, a volume every pod mounts) holding the blocks any of them cached, for all of them.
    kv_offload_shared_dir: str = ""
    kv_offload_shared_gib: float = 0.0
    # vLLM's --kv-events-config (wire/kv_events.py): each worker publishes its prefix-cache blocks stored and
    # removed over ZeroMQ, for a router outside the cluster. "" = off. ``kv_events_rank``: the worker's place in
    # the cluster's start order (its endpoint's port offset, the batches' data_parallel_rank), set by the launcher.
    kv_events_config: str = ""
    kv_events_rank: int = 0
    # Decode side of a KV transfer: take the prompt's prefix from this worker's own prefix cache and ask
    # the prefill worker only for the rest (engine/remote_admission.py). False: every block is sent.
    decode_prefix_reuse: bool = True
    spec_method: str = "none"
    num_spec_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    # "" = the model's own MTP layers when its config declares them (NemotronH), else our trained head from
    # the cache dir (refused when there is none); a path; or "random" (tests).
    mtp_checkpoint: str = ""
    # spec_method "draft_model": a separate, smaller causal LM of the same tokenizer that drafts (vLLM's and SGLang's
    # draft-model speculation): a model name, directory or Hub id as ``model`` takes (engine/draft_model.py).
    draft_model: str = ""
    # Schedule step n+1 while step n runs (engine/async_scheduler.py). None: on where the engine runs on
    # CUDA (as vLLM does), off on a CPU, where the scheduler's thread and the model share the cores; an H100
    # decode step of a 1.1B model took 1.56 / 2.71 / 3.24 ms async against 2.16 / 3.22 / 5.42 ms synchronous
    # at batch 1 / 32 / 128 (bench/results/gpu_check_h100.json). See resolve_async_scheduling.
    async_scheduling: bool | None = None
    # CUDA graphs for uniform decode batches on a GPU (engine/cuda_graphs.py); False = eager (vLLM's
    # --enforce-eager).
    cuda_graphs: bool = True
    # Capture every decode bucket at start-up (vLLM does), so no first step at a new batch size while serving stalls
    # on its capture; False: each bucket at its first use (a faster start, for benchmarks that build many engines).
    cuda_graph_capture_at_start: bool = True
    # The largest decode batch captured (vLLM's --max-cudagraph-capture-size, default 512 there too): each bucket up
    # to it is a capture at start-up and a graph's memory; a larger batch runs eager.
    max_cuda_graph_batch: int = 512
    # Prefill and mixed steps of up to this many tokens through piecewise CUDA graphs (engine/piecewise_graphs.py:
    # the forward between attention calls captured per token-count bucket, attention eager between); 0 = eager.
    # Off by default until it has run on a GPU: the H200 run of s51 had such steps at ~10.7 ms of host time.
    mixed_cuda_graph_tokens: int = 0
    # Up to 128 rows of a 16-bit matmul in a CUDA graph may run a weight-streaming Triton kernel where it measured
    # faster than cuBLAS on this GPU (engine/skinny_linear.py: timed at a decode bucket's warm-up); False: cuBLAS.
    skinny_gemm: bool = True
    # A CUDA graph's Triton kernels launch with programmatic dependent launch on Hopper and later GPUs: each may be
    # placed and load its weights while the kernel before it finishes (kernels/launch_pdl.py); False: plain launches.
    pdl: bool = True
    # Where the weight-streaming kernel runs a Llama block's qkv, output or down projection, what follows it (the
    # rotary embedding and KV write, the residual add and next RMSNorm) runs in the kernel that adds its partial
    # sums (kernels/triton_skinny_epilogues.py): three kernels a layer fewer; False: those kernels apart.
    skinny_epilogues: bool = True
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model split over this many ranks, each a process with its
    # slice of every layer and of the KV cache, on its own GPU (cuda:0 .. n-1) or its share of the CPU cores
    # (engine/tensor_parallel/). 1: the whole model in this process.
    tensor_parallel_size: int = 1
    # Pipeline parallelism (vLLM's --pipeline-parallel-size): the model's layers cut into this many consecutive
    # stages, each a rank (a process: its own GPU cuda:0 .. n-1, or its share of the CPU cores) holding its layers and
    # their KV cache; rank 0 also the embedding, the head, the scheduler (engine/pipeline_parallel.py). 1: whole.
    pipeline_parallel_size: int = 1
    # Batch-invariant kernels (issue 24): each request's tokens and logprobs are bitwise the same whatever
    # the batch, the prefill chunking, speculation, placement or a recovery re-prefill (CPU: the C GEMM;
    # CUDA: the Triton matmul and fixed-tile attention, bitwise among workers with the same GPU model; see README).
    # None: default_deterministic() (the engine resolves it; see resolve_deterministic).
    deterministic: bool | None = None
    seed: int = 0
    cache_dir: str = ""
    # A Hugging Face Hub id's revision (branch, tag or commit; "" for main) and where its files go ("": the Hugging
    # Face cache), vLLM's --revision and --download-dir (engine/models/hub.py).
    revision: str = ""
    download_dir: str = ""
    # vLLM's --hf-overrides: JSON keys set over the model's config.json (engine/models/hf_overrides.py: an overlay
    # directory), e.g. a causal reranker served as a classifier; "" for none.
    hf_overrides: str = ""
    # vLLM's --tokenizer / --tokenizer-revision: another directory's, built-in model's or Hub repository's tokenizer
    # (and chat template) for the model (engine/models/tokenizer_overlay.py); "" for the model's own.
    tokenizer: str = ""
    tokenizer_revision: str = ""
    # vLLM's --load-format: "auto" reads the checkpoint; "dummy" serves random weights in its shapes and reads none
    # (engine/models/dummy_weights.py), for benchmarks.
    load_format: str = "auto"
    # LoRA adapters served beside the base model (engine/lora/), as ``name=path`` (a PEFT directory); a
    # request picks one by name (SamplingParams.lora_name, the API's ``model`` field). Every adapter is loaded
    # at start-up and kept; ``max_lora_rank`` refuses larger ones (vLLM's --max-lora-rank).
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 64
    # Adapters may also be loaded and unloaded while serving (vLLM's --enable-lora with runtime updating:
    # LLMEngine.load_lora / unload_lora, POST /v1/load_lora_adapter): every projection an adapter may target is
    # wrapped from the start. ``max_loras``: how many adapters are held at once (all of them can share a batch).
    enable_lora: bool = False
    max_loras: int = 16
    # vLLM's --limit-mm-per-prompt, its JSON ('{"image": 4}'): the images one prompt may hold (engine/multimodal/
    # limits.py); "" = 16. '{"image": 0}' serves a LLaVA as a text model, its vision tower not loaded.
    limit_mm_per_prompt: str = ""
    # vLLM's --mm-processor-kwargs, its JSON: settings of the image processor that change what an image becomes
    # (Qwen-VL's '{"min_pixels": ..., "max_pixels": ...}': the pixel budget, so the placeholders an image takes;
    # Gemma 3's '{"do_pan_and_scan": false}'). Each model takes its own keys (engine/multimodal/spec.py); "" = none.
    mm_processor_kwargs: str = ""
    # vLLM's --enable-prompt-embeds: requests may give their prompt as embeddings (engine/prompt_embeds.py). Off by
    # default as vLLM's: a step then looks for such rows, and a client's tensor is read from its bytes.
    enable_prompt_embeds: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not supported; choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: {self.device!r} is not supported; choose one of {', '.join(DEVICES)} "
                              "(or cuda:N)")
        if self.spec_method not in SPEC_METHODS:
            raise ConfigError(
                f"spec_method: {self.spec_method!r} is unknown; choose one of {', '.join(SPEC_METHODS)}"
            )
        positive = ("block_size", "tensor_parallel_size", "pipeline_parallel_size", "max_cuda_graph_batch")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_spec_tokens", "num_threads", "mixed_cuda_graph_tokens",
                     "prefill_chunk_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}: must be a non-negative integer, got {value!r}")
        if self.kv_cache_memory_gib < 0:
            raise ConfigError(f"kv_cache_memory_gib: must be >= 0 (0 = sized automatically), got "
                              f"{self.kv_cache_memory_gib!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.spec_method == "none" and self.num_spec_tokens:
            raise ConfigError(
                f"num_spec_tokens: {self.num_spec_tokens} given but spec_method is 'none'; "
                "set spec_method to 'ngram', 'mtp' or 'draft_model'"
            )
        if self.spec_method != "none" and self.num_spec_tokens == 0:
            raise ConfigError(f"num_spec_tokens: must be >= 1 with spec_method={self.spec_method!r}")
        if (self.spec_method == "draft_model") != bool(self.draft_model):
            raise ConfigError("draft_model: spec_method 'draft_model' drafts with a separate model: name it (a "
                              "directory, a Hub id or a built-in name)" if not self.draft_model else
                              f"draft_model: {self.draft_model!r} given but spec_method is {self.spec_method!r}; "
                              "set spec_method to 'draft_model'")
        try:
            self.offload_config().validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.offload_config().enabled and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_*: the offload tiers keep prefix-cache blocks; turn prefix caching on "
                              "(drop --no-prefix-caching) or the tiers off")
        try:
            external = parse_external_kv(self.kv_transfer_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if external is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_transfer_config: a decode instance takes the pulled blocks as a prefix-cache hit; "
                              "turn prefix caching on (drop --no-enable-prefix-caching)")
        try:
            kv_events = self.kv_events()
        except KVEventsConfigError as e:
            raise ConfigError(str(e)) from None
        if kv_events is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_events_config: KV events tell the prefix cache's blocks; turn prefix caching on "
                              "(drop --no-enable-prefix-caching) or the events off")
        try:
            parse_hf_overrides(self.hf_overrides)
        except ValueError as e:  # json.JSONDecodeError is one
            raise ConfigError(f"hf_overrides: {e}") from None
        if self.pipeline_parallel_size > 1 and pipeline_refusals(self):
            raise ConfigError(f"pipeline_parallel_size {self.pipeline_parallel_size}: " + "; ".join(
                pipeline_refusals(self)))
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format {self.load_format!r}: give one of {', '.join(LOAD_FORMATS)}")
        if self.tokenizer_revision and not self.tokenizer:
            raise ConfigError(f"tokenizer_revision {self.tokenizer_revision!r}: the revision of a --tokenizer Hub id; "
                              "the model's own tokenizer comes at the model's --revision")
        try:
            self.max_images_per_prompt()
        except ValueError as e:
            raise ConfigError(f"limit_mm_per_prompt: {e}") from None
        try:
            self.image_processor_kwargs()
        except ValueError as e:
            raise ConfigError(f"mm_processor_kwargs: {e}") from None
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank <= 0:
            raise ConfigError(f"max_lora_rank: must be a positive integer, got {self.max_lora_rank!r}")
        if not isinstance(self.max_loras, int) or self.max_loras <= 0:
            raise ConfigError(f"max_loras: must be a positive integer, got {self.max_loras!r}")
        self.lora_modules = tuple(self.lora_modules)
        try:
            num_adapters = len(self.lora_paths())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if num_adapters > self.max_loras:
            raise ConfigError(f"lora_modules: {num_adapters} adapters but max_loras is {self.max_loras} (raise "
                              "--max-loras)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"ngram_min/ngram_max: need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")

    def lora_paths(self) -> dict[str, str]:
        """``lora_modules`` as {adapter name: directory}."""
        return parse_lora_modules(self.lora_modules)

    def max_images_per_prompt(self) -> int:
        """The images one prompt may hold (``limit_mm_per_prompt``; 0: images are off)."""
        return max_images_per_prompt(self.limit_mm_per_prompt)

    def image_processor_kwargs(self) -> dict:
        """``mm_processor_kwargs`` parsed (not to be changed: the same dict for the same text)."""
        return image_processor_kwargs(self.mm_processor_kwargs)

    def offload_config(self) -> OffloadConfig:
        return OffloadConfig(self.kv_offload_host_gib, self.kv_offload_disk_dir, self.kv_offload_disk_gib,
                             self.kv_offload_shared_dir, self.kv_offload_shared_gib)

    def kv_events(self) -> KVEventsConfig | None:
        """``kv_events_config`` parsed (checked when the config was made); None where no events are published."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def serves_lora(self) -> bool:
        """Adapters named at start-up, or loaded while serving (--enable-lora)."""
        return bool(self.lora_modules or self.enable_lora)

    def resolve_deterministic(self) -> tuple[bool, bool]:
        """(wanted, asked): whether deterministic mode is wanted, and whether someone asked for it
        (the field or $PDCLUSTER_DETERMINISTIC) rather than it being the built-in default. Asked for
        where it cannot run is an error; the default quietly steps back there."""
        if self.deterministic is not None:
            return bool(self.deterministic), True
        return default_deterministic(), bool(os.environ.get(DETERMINISTIC_ENV, "").strip())

    def resolve_device(self) -> str:
        """The device to run on: "auto" becomes "cuda" where torch sees a GPU, else "cpu"; asking for
        CUDA where there is none is a ConfigError naming what torch sees."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
                raise ConfigError(f"device: {self.device!r} but torch {torch.__version__} ({build}) sees no CUDA "
                                  "device; use --device cpu (or auto)")
            index = torch.device(self.device).index
            if index is not None and index >= torch.cuda.device_count():
                raise ConfigError(f"device: {self.device!r} but there are {torch.cuda.device_count()} CUDA devices")
        return self.device

    def resolve_async_scheduling(self, device: str) -> bool:
        """``async_scheduling`` itself when given, else whether ``device`` (resolved) is a GPU."""
        if self.async_scheduling is not None:
            return bool(self.async_scheduling)
        return device.startswith("cuda")

    def resolve_batch_limits(self, device: str, hybrid: bool = False) -> EngineConfig:
        """This config with ``max_num_seqs`` and ``max_num_batched_tokens`` filled in where 0: the defaults of
        ``device`` (resolved: "cpu", "cuda" or "cuda:N"; engine/batch_limits.py); a hybrid's request cap stays
        HYBRID_MAX_NUM_SEQS. Values given are kept."""
        from pdcluster.engine.batch_limits import CPU_LIMITS, HYBRID_MAX_NUM_SEQS, cuda_batch_limits

        if self.max_num_seqs and self.max_num_batched_tokens:
            return self
        limits = cuda_batch_limits(device) if device.startswith("cuda") else CPU_LIMITS
        seqs = min(limits.max_num_seqs, HYBRID_MAX_NUM_SEQS) if hybrid else limits.max_num_seqs
        return replace(self, max_num_seqs=self.max_num_seqs or seqs,
                       max_num_batched_tokens=self.max_num_batched_tokens or limits.max_num_batched_tokens)

    def require_batch_limits(self) -> None:
        """ConfigError unless the batch limits are resolved (a scheduler or the chunk size needs them)."""
        if not (self.max_num_seqs and self.max_num_batched_tokens):
            raise ConfigError("max_num_seqs / max_num_batched_tokens are 0 (the device's default): resolve them "
                              "for a device first (EngineConfig.resolve_batch_limits)")

    def resolve_dtype(self, model_config: dict) -> str:
        """The dtype name to run in: ``dtype`` itself unless "auto"; for "auto", the checkpoint's
        ``torch_dtype`` (``dtype`` in newer configs) with float16 run as bfloat16 on CPU (the CPU
        has bf16 GEMMs and no fast fp16 ones), float32 when the config says nothing, and float32 for a
        bf16/fp16 checkpoint on a CPU without fast bf16 (cpu_has_fast_bf16)."""
        if self.dtype != "auto":
            return self.dtype
        name = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32").removeprefix("torch.")
        if name in ("float16", "bfloat16") and self.device == "cpu":
            return "bfloat16" if cpu_has_fast_bf16() else "float32"
        return name if name in DTYPES else "float32"

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens of one request a step computes: ``prefill_chunk_size``, or the step's budget."""
        if not self.max_num_batched_tokens:
            self.require_batch_limits()
        return min(self.prefill_chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @property
    def num_spec_steps(self) -> int:
        return self.num_spec_tokens if self.spec_method != "none" else 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
