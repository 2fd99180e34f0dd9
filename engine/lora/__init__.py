"""Multi-LoRA serving: adapters named at start-up (``--lora-modules name=path``), picked per request by name
(the API's ``model`` field), batched together with the base model's requests. adapter.py reads and checks a
PEFT directory; layers.py wraps the targeted projections; ``install`` puts them on a loaded model.

An adapter changes the KV a prompt makes, so its blocks hash apart from the base model's and other adapters'
(engine/block_manager.py ``lora_hash_root``: the root of the chained block hashes), in every worker's prefix
cache, the offload tiers and the router's KV index alike.
"""

from __future__ import annotations

import logging

from pdcluster.engine.lora.adapter import TARGETS, LoraAdapter, LoraAdapterError, load_adapter
from pdcluster.engine.lora.layers import LoraLinear, LoraSet, slice_updates

log = logging.getLogger(__name__)

__all__ = ["LoraAdapter", "LoraAdapterError", "LoraSet", "install"]


def install(model, lora_modules: dict[str, str], max_rank: int) -> LoraSet:
    """Load every adapter of ``lora_modules`` ({name: path}) and wrap the projections they target on
    ``model`` (a LlamaModel: Llama family, Qwen3); sets and returns ``model.lora``."""
    from pdcluster.engine.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        raise LoraAdapterError(f"LoRA adapters run on Llama-family and Qwen3 models; {type(model).__name__} "
                               "is not one (drop --lora-modules)")
    adapters = [load_adapter(name, path, model.arch, max_rank) for name, path in lora_modules.items()]
    lora = LoraSet(adapters)
    arch = model.arch
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    # Each fused projection's modules as (HF name, output offset, width).
    layout = {"qkv_proj": (("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)),
              "o_proj": (("o_proj", 0, arch.hidden_size),),
              "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter)),
              "down_proj": (("down_proj", 0, arch.hidden_size),)}
    assert set(TARGETS.values()) == set(layout)
    for layer_index, layer in enumerate(model.layers):
        for attr, modules in layout.items():
            updates = {}
            for adapter_index, adapter in enumerate(adapters):
                slices = [(offset, width, adapter.modules.get((layer_index, name))) for name, offset, width in modules]
                if all(w is None for _, _, w in slices):
                    continue
                base = getattr(layer, attr, None)
                if base is None:  # an MoE layer has experts, not gate_up_proj / down_proj
                    raise LoraAdapterError(f"LoRA adapter {adapter.name!r} ({adapter.path}): layer {layer_index} "
                                           "is a mixture-of-experts layer; adapters on experts are not supported")
                updates[adapter_index] = slice_updates(slices)
            if updates:
                setattr(layer, attr, LoraLinear(getattr(layer, attr), lora, updates, model.dtype, model.device,
                                                model.deterministic))
        # The MLP runs over the step's rows at once: the adapter rows index the whole step.
        layer.chunked_mlp = False
    model.lora = lora
    log.info("LoRA adapters: %s", ", ".join(f"{a.name} (rank {a.max_rank}, {len(a.modules)} modules)"
                                            for a in adapters))
    return lora
