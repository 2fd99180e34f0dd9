"""The first stages of an engine: the model (weights, tokenizer, architecture) and its paged KV cache.

A KV connector needs the cache (its transport reads or shares that memory), and the scheduler and
runner need the connector: so a worker loads these first, builds its connector on ``kv_cache``, and
then the engine (engine/llm_engine.py) with both. Nothing is patched onto an engine afterwards.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.draft_model import check_draft_model, load_draft_model
from pdcluster.engine.kv_budget import CPU_DEFAULT_GIB, cuda_kv_pool_bytes
from pdcluster.engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_dtype, kv_planes, num_blocks_for_budget
from pdcluster.engine.linear import DeterministicUnavailable, check_deterministic_available
from pdcluster.engine.mamba_state import MambaStateShape
from pdcluster.engine.mamba_state_blocks import num_state_blocks
from pdcluster.engine.memory import keep_freed_memory
from pdcluster.engine.models.architectures import (arch_from_dir, is_encoder, is_hybrid, load_model, max_model_len_for,
                                                   model_class_of)
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.tokenizer_overlay import check_tokenizer_fits
from pdcluster.engine.multimodal.attach import attach_image_encoder
from pdcluster.engine.multimodal.spec import ImageSpec
from pdcluster.engine.proposers import num_draft_layers as proposer_draft_layers
from pdcluster.engine.tensor_parallel.driver import (TensorParallelDriver, check_engine_config, check_shared_caches,
                                                     check_speculation)
from pdcluster.engine.tensor_parallel.layers import Shard
from pdcluster.engine.tensor_parallel.shard import check_shardable
from pdcluster.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    config: EngineConfig  # resolved: the device, prefix caching (off for hybrids), deterministic mode
    model_dir: Path
    tokenizer: Tokenizer
    arch: object  # the architecture read from the model directory (engine/models/architectures.py)
    is_hybrid: bool
    max_model_len: int
    dtype_name: str
    deterministic: bool
    model: torch.nn.Module
    kv_spec: KVCacheSpec
    kv_cache: torch.Tensor
    # Hybrids in a KV transfer: the Mamba state rides in ``num_state_blocks`` blocks after the prompt's
    # (engine/mamba_state_blocks.py). None / 0 for attention-only models.
    state_shape: MambaStateShape | None
    num_state_blocks: int
    eos_token_ids: frozenset[int]
    # Tensor parallelism under a KV transport or the KV offload tiers: every rank's cache, rank 0's (kv_cache) first,
    # the others mapped here from shared memory (tensor_parallel/shared_cache.py). Empty otherwise.
    rank_kv_caches: tuple[torch.Tensor, ...] = ()
    # spec_method "draft_model": the draft (engine/draft_model.py), its layers' KV in ``kv_cache`` after the target's.
    draft_model: object | None = None

    @classmethod
    def load(cls, config: EngineConfig, progress: bool = True, kv_cache_allocator=None,
             share_rank_caches: bool = False, rank_cache_allocator=None) -> LoadedModel:
        """``kv_cache_allocator(shape, dtype, device)`` lets a KV transport provide the cache memory
        (e.g. shared memory a same-host sender writes into directly). ``share_rank_caches``: a KV transport will move
        this worker's cache; with tensor parallelism rank 0 then holds every rank's (``rank_kv_caches``), each made by
        ``rank_cache_allocator(kv_spec) -> (cache, descriptor for the rank)`` where given (the transport's shared
        memory), else as tensor_parallel/shared_cache.py makes it."""
        if config.device != (device := config.resolve_device()):
            config = replace(config, device=device)
        config = replace(config, async_scheduling=config.resolve_async_scheduling(config.device))
        if torch.device(config.device).index is not None:
            # Triton launches on torch's current device, not its tensors': an engine on cuda:1 makes it current
            # (the runner's worker thread does the same, engine/async_scheduler.py).
            torch.cuda.set_device(torch.device(config.device))
        config = check_engine_config(config)  # tensor parallelism's limits and per-rank threads (no-op for 1)
        # The KV offload tiers, too, read and write every rank's cache from rank 0 (kv_offload/block_columns.py).
        share_rank_caches = (share_rank_caches or config.offload_config().enabled) and config.tensor_parallel_size > 1
        if share_rank_caches:
            check_shared_caches(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()
        model_dir: Path = resolve_model(config.model, cache_dir=config.cache_dir or None, progress=progress,
                                       hf_overrides=config.hf_overrides, revision=config.revision,
                                       download_dir=config.download_dir, tokenizer=config.tokenizer,
                                       tokenizer_revision=config.tokenizer_revision, load_format=config.load_format)
        tokenizer = Tokenizer(model_dir)
        arch = arch_from_dir(model_dir)
        if config.tokenizer:
            check_tokenizer_fits(tokenizer, arch, config.tokenizer)
        hybrid = is_hybrid(arch)
        step_given = bool(config.max_num_batched_tokens)
        config = config.resolve_batch_limits(config.device, hybrid)  # 0 = this device's defaults
        if hybrid and config.offload_config().enabled:
            raise ValueError(f"kv_offload_*: model {config.model} is a hybrid (Mamba): it has no prefix cache (no "
                             "recurrent state at block boundaries), so nothing to offload; drop the --kv-offload-* flags")
        if hybrid and config.kv_transfer_config:
            raise ValueError(f"kv_transfer_config: model {config.model} is a hybrid (Mamba): its recurrent state is not "
                             "in blocks a prefix hit can take, so it cannot decode from another instance's prefill; "
                             "serve it without --kv-transfer-config")
        if hybrid and config.enable_prefix_caching:
            # A cached block holds KV but no Mamba state for its boundary: a hit would resume the
            # recurrence from nothing. Hybrids compute every prompt (vLLM's default for Mamba too).
            log.info("prefix caching is off for hybrid model %s (no recurrent state at block boundaries)",
                     config.model)
            config = replace(config, enable_prefix_caching=False)
        max_model_len = max_model_len_for(arch, config.max_model_len)
        encoder = is_encoder(arch)
        if encoder:
            config = encoder_config(config, max_model_len, step_given)
        dtype_name = config.resolve_dtype(json.loads((model_dir / "config.json").read_text()))
        dtype = DTYPES[dtype_name]
        # Deterministic mode (issue 24): batch-invariant kernels on CPU. CUDA has none yet (cuBLAS and the
        # Triton kernels keep their batch-dependent choices): said once, not refused.
        deterministic = _resolve_deterministic(config)
        config = replace(config, deterministic=deterministic)
        max_positions = max_model_len + config.num_spec_steps + 1
        # The adapters named at start-up, read before any weight (a bad one is refused at once); the other ranks of a
        # split model read the same files and check they hold these contents (WorkerSpec.lora_digests).
        adapters = []
        if config.serves_lora:
            from pdcluster.engine.lora import install, load_adapter

            adapters = [load_adapter(name, path, config.max_lora_rank) for name, path in config.lora_paths().items()]
        driver = shard = None
        try:
            spec = ImageSpec.from_dir(model_dir, config.image_processor_kwargs())
        except ValueError as e:
            raise ValueError(f"{config.model}: --mm-processor-kwargs: {e}") from None
        if spec is None and config.image_processor_kwargs():
            raise ValueError(f"{config.model}: --mm-processor-kwargs {config.mm_processor_kwargs} given, but this "
                             "model takes no images")
        if spec is not None and spec.patches is not None and config.tensor_parallel_size > 1 and \
                config.max_images_per_prompt() > 0:  # the other ranks' rotary tables would need the image rows too
            raise ValueError(f"{config.model}: images on a tensor-parallel split of an M-RoPE model (Qwen2-VL) are not "
                             "supported: serve it with --tensor-parallel-size 1, or for text with "
                             "--limit-mm-per-prompt '{\"image\": 0}'")
        draft_found = None
        if config.spec_method == "draft_model":  # before any weight is read: (its directory, its arch)
            draft_found = check_draft_model(config, arch, tokenizer, progress)
        stage = None
        if config.pipeline_parallel_size > 1:  # the other stages load their layers while this one loads its own
            from pdcluster.engine.pipeline_parallel import check_model, stage_of

            check_model(model_class_of(model_dir), arch, config.pipeline_parallel_size,
                        spec is not None and config.max_images_per_prompt() > 0)
            driver = TensorParallelDriver.start(config, str(model_dir), dtype_name, max_positions, max_model_len,
                                                deterministic)
            stage = stage_of(0, config.pipeline_parallel_size, arch.num_layers)
        if config.tensor_parallel_size > 1:  # the other ranks load their slices while this one loads its own
            check_shardable(model_class_of(model_dir), arch, config.tensor_parallel_size)
            draft = check_speculation(config, arch)
            driver = TensorParallelDriver.start(config, str(model_dir), dtype_name, max_positions, max_model_len,
                                                deterministic, draft=draft,
                                                lora_digests={a.name: a.digest for a in adapters})
            shard = Shard(0, config.tensor_parallel_size)
        try:
            model = load_model(model_dir, dtype, max_positions, config.device, deterministic=deterministic,
                               max_model_len=max_model_len, shard=shard, group=driver and driver.group, stage=stage)
            if config.serves_lora:
                install(model, adapters, runtime=config.enable_lora)
            if spec is not None:
                if config.max_images_per_prompt() == 0:
                    log.info("%s takes images, but --limit-mm-per-prompt allows none: served for text, its vision "
                             "tower not loaded", config.model)
                else:  # on rank 0 of a split: the other ranks get the embeddings with each forward
                    attach_image_encoder(model, spec, model_dir, config, dtype, deterministic)
        except BaseException:
            if driver is not None:
                driver.close()
            raise
        arch = model.arch  # as this engine serves it (longrope's table follows max_model_len)
        # (no tensor-parallel driver to close on failure: check_draft_model refused a split)
        draft_model = load_draft_model(config, *draft_found, dtype, max_positions, deterministic) if draft_found else None
        # MTP's or a draft model's layers after the target's (S2)
        num_draft_layers = proposer_draft_layers(config, arch, draft_model)
        # A pipeline stage's cache holds its layers (rank 0's: the first ones); the pool is sized for the largest
        # stage's, which every rank then holds (engine/pipeline_parallel.py).
        num_layers = arch.num_layers if stage is None else -(-arch.num_layers // config.pipeline_parallel_size)
        budget_probe = KVCacheSpec(num_layers + num_draft_layers, num_draft_layers, 1, config.block_size,
                                   arch.num_kv_heads, arch.head_dim, kv_cache_dtype(config.kv_cache_dtype, dtype, arch),
                                   num_planes=kv_planes(arch))
        if stage is not None:
            num_layers = len(stage.layers)
        probe = KVCacheSpec(num_layers + num_draft_layers, num_draft_layers, 1, config.block_size,
                            arch.num_kv_heads, arch.head_dim, kv_cache_dtype(config.kv_cache_dtype, dtype, arch),
                            num_planes=kv_planes(arch))
        if encoder:  # nothing is cached: the blocks only count each running prompt's tokens, one small plane each
            probe = KVCacheSpec(1, 0, 1, config.block_size, 1, 1, dtype)
        num_blocks = config.num_kv_blocks or (
            config.max_num_seqs * -(-(max_model_len + 1) // config.block_size) + 1 if encoder
            else _num_kv_blocks(model, config, budget_probe.bytes_per_block, hybrid, max_model_len))
        kv_spec = replace(probe, num_blocks=num_blocks)
        allocate = kv_cache_allocator or (lambda shape, dtype, device: allocate_kv_cache(kv_spec, device))
        kv_cache = allocate(kv_spec.shape, kv_spec.dtype, config.device)
        rank_kv_caches = ()
        if driver is not None:
            try:
                others = driver.allocate_cache(kv_spec, shared=share_rank_caches, allocator=rank_cache_allocator)
                rank_kv_caches = (kv_cache, *others) if share_rank_caches else ()
            except BaseException:
                driver.close()
                raise
            model.tp_driver = driver
        log.info("KV cache: %d blocks of %d tokens (%d tokens), %s, %.2f GiB on %s", num_blocks, kv_spec.block_size,
                 num_blocks * kv_spec.block_size, str(kv_spec.dtype).removeprefix("torch."),
                 num_blocks * kv_spec.bytes_per_block / (1 << 30), config.device)
        state_shape = arch.mamba_state_shape() if hybrid else None
        return cls(
            config=config, model_dir=model_dir, tokenizer=tokenizer, arch=arch, is_hybrid=hybrid,
            max_model_len=max_model_len, dtype_name=dtype_name, deterministic=deterministic, model=model,
            kv_spec=kv_spec, kv_cache=kv_cache, state_shape=state_shape,
            num_state_blocks=num_state_blocks(state_shape, kv_spec.bytes_per_block) if hybrid else 0,
            eos_token_ids=frozenset(arch.eos_token_ids) | frozenset(tokenizer.stop_token_ids),
            rank_kv_caches=rank_kv_caches, draft_model=draft_model,
        )


def encoder_config(config: EngineConfig, max_model_len: int, step_given: bool = True) -> EngineConfig:
    """An encoder-only model's engine config (engine/models/bert.py): each prompt in one step, nothing cached, no
    CUDA graph (its steps are prompts); what it cannot do refused in one line. ``step_given``: whether the user set
    max_num_batched_tokens; where not, a step grows to hold a whole prompt of the model's context (vLLM's rule for
    models that do not chunk prompts: ModernBERT's 8,192 tokens over a CPU's default 2,048)."""
    refused = [what for what, on in (("speculative decoding (--spec)", config.spec_method != "none"),
                                     ("LoRA adapters", config.serves_lora),
                                     ("tensor parallelism", config.tensor_parallel_size > 1),
                                     ("KV offloading (--kv-offload-*)", config.offload_config().enabled)) if on]
    if refused:
        raise ValueError(f"{config.model} is an encoder-only model (it pools prompts and generates nothing): "
                         f"{', '.join(refused)} not supported for it")
    room = config.prefill_chunk_tokens
    if max_model_len > room and not step_given and not config.prefill_chunk_size:
        log.info("encoder-only model %s: a step holds %d tokens (its context; the default was %d)", config.model,
                 max_model_len, room)
        config, room = replace(config, max_num_batched_tokens=max_model_len), max_model_len
    if max_model_len > room:
        raise ValueError(f"{config.model}: an encoder computes each prompt in one step, but a step holds {room} prompt "
                         f"tokens and max_model_len is {max_model_len}: raise --max-num-batched-tokens (and "
                         f"--long-prefill-token-threshold, where set) to {max_model_len}, or lower --max-model-len")
    if config.enable_prefix_caching:
        log.info("prefix caching is off for encoder-only model %s (a prompt's tokens attend to later ones)",
                 config.model)
    return replace(config, enable_prefix_caching=False, cuda_graphs=False)


def _num_kv_blocks(model, config: EngineConfig, bytes_per_block: int, hybrid: bool, max_model_len: int) -> int:
    """Blocks of the KV pool: kv_cache_memory_gib's, or (0, auto) on a GPU what gpu_memory_utilization leaves
    (engine/kv_budget.py), on a CPU 1 GiB's."""
    if config.kv_cache_memory_gib:
        return num_blocks_for_budget(bytes_per_block, config.kv_cache_memory_gib)
    device = torch.device(config.device)
    if device.type != "cuda":
        return num_blocks_for_budget(bytes_per_block, CPU_DEFAULT_GIB)
    return max(1, cuda_kv_pool_bytes(model, config, hybrid, device, max_model_len) // bytes_per_block)


def _resolve_deterministic(config: EngineConfig) -> bool:
    """Deterministic mode where its batch-invariant kernels run: the CPU with the C GEMM, CUDA with
    Triton (kernels/triton_matmul_bi.py and the fixed-tile attention). Asked for where they cannot:
    an error; as the default: the fast mode there, with a warning.

    On CUDA deterministic mode is asked for, not the default: there it costs 2.9x in prefill and 1.2-1.5x
    in decode (bench/results/gpu_check_h100.json: the Triton batch-invariant matmul against cuBLAS, the
    fixed attention tiles against the fast ones), beyond the 5% that makes it the CPU's default."""
    wanted, asked = config.resolve_deterministic()
    if not wanted:
        return False
    if config.device.startswith("cuda") and not asked:
        log.info("CUDA: the fast mode (cuBLAS, wide attention tiles); --deterministic for batch-invariant results")
        return False
    try:
        check_deterministic_available("cuda" if config.device.startswith("cuda") else "cpu")
    except DeterministicUnavailable as e:
        if asked:
            raise
        log.warning("%s: running in the fast mode (results may depend on the batch)", e)
        return False
    return True
