"""What pipeline parallelism (EngineConfig.pipeline_parallel_size, engine/pipeline_parallel.py) does not combine with,
read off the engine's settings before a weight is read (torch-free: EngineConfig checks it). Each refusal says what to
do instead; what depends on the model (its family, images) is checked where it loads (pipeline_parallel.py)."""

from __future__ import annotations


def pipeline_refusals(config) -> list[str]:
    """One line per setting that a pipeline-parallel engine refuses (empty: none)."""
    n = config.pipeline_parallel_size
    out = []
    if config.tensor_parallel_size > 1:
        out.append(f"tensor_parallel_size {config.tensor_parallel_size} with pipeline_parallel_size {n}: split a "
                   "model one way (--tensor-parallel-size within a node, --pipeline-parallel-size for layers)")
    if config.spec_method not in ("none", "ngram"):
        out.append(f"spec_method {config.spec_method!r}: a draft's layers read the target's last hidden states on "
                   "rank 0 only; n-gram speculation runs with pipeline parallelism")
    if config.serves_lora:
        out.append("LoRA adapters: not with pipeline parallelism yet (each stage would hold its layers' slices)")
    if config.offload_config().enabled:
        out.append("the KV offload tiers (--kv-offload-*): they copy rank 0's cache, which holds its stage's layers "
                   "only")
    if config.kv_transfer_config:
        out.append("kv_transfer_config: a KV transfer sends rank 0's cache, which holds its stage's layers only")
    return out
