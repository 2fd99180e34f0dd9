"""Multi-LoRA serving: adapters named at start-up (``--lora-modules name=path``), picked per request by name
(the API's ``model`` field), batched together with the base model's requests. adapter.py reads and checks a
PEFT directory; layers.py wraps the targeted projections; ``install`` puts them on a loaded model.

An adapter changes the KV a prompt makes, so its blocks hash apart from the base model's and other adapters'
(engine/block_manager.py ``block_hash_root``: the root of the chained block hashes), in every worker's prefix
cache, the offload tiers and the router's KV index alike.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pdcluster.engine.lora.adapter import LoraAdapter, LoraAdapterError, LoraWeights, load_adapter
from pdcluster.engine.lora.layers import LoraLinear, LoraSet, grouped_way, slice_updates

log = logging.getLogger(__name__)

__all__ = ["LoraAdapter", "LoraAdapterError", "LoraSet", "install"]


def install(model, lora_modules: dict[str, str], max_rank: int) -> LoraSet:
    """Load every adapter of ``lora_modules`` ({name: path}), check each against ``model`` (its layers, its
    projections' shapes: ``model.lora_targets()``), and wrap the projections they target; sets and returns
    ``model.lora``."""
    targets = model.lora_targets()
    if targets is None:
        raise LoraAdapterError(f"LoRA adapters are not served on {model.architecture_name} models "
                               "(drop --lora-modules)")
    adapters = [load_adapter(name, path, max_rank) for name, path in lora_modules.items()]
    where = {(layer, name): (offset, width, getattr(owner, attr).in_features)
             for layer, owner, attr, slices in targets for name, offset, width in slices}
    num_layers = len(model.layers)
    for adapter in adapters:
        for (layer, module), w in adapter.modules.items():
            refuse = f"LoRA adapter {adapter.name!r} ({adapter.path}): layer {layer} {module}: "
            if layer >= num_layers:
                raise LoraAdapterError(f"{refuse}layer {layer} but the base model has {num_layers} layers")
            if (layer, module) not in where:
                raise LoraAdapterError(f"{refuse}this layer has no such projection that takes adapters (a "
                                       "mixture-of-experts layer, or another kind of layer)")
            _, width, in_features = where[(layer, module)]
            if w.a.shape[1] != in_features or w.b.shape[0] != width:
                raise LoraAdapterError(f"{refuse}lora_A {tuple(w.a.shape)} / lora_B {tuple(w.b.shape)} do not fit "
                                       f"the base model's projection [{width}, {in_features}] (an adapter trained "
                                       "for another model?)")
    lora = LoraSet(adapters, grouped_way(model.device, model.dtype))
    for layer, owner, attr, slices in targets:
        updates = {}
        for adapter_index, adapter in enumerate(adapters):
            modules = [(offset, width, _in_layout(model, attr, offset, width, adapter.modules.get((layer, name))))
                       for name, offset, width in slices]
            if any(w is not None for _, _, w in modules):
                updates[adapter_index] = slice_updates(modules)
        if updates:
            setattr(owner, attr, LoraLinear(getattr(owner, attr), lora, updates, model.dtype, model.device,
                                            model.deterministic))
    model.run_unchunked()  # the adapter rows index the whole step
    model.lora = lora
    log.info("LoRA adapters: %s", ", ".join(f"{a.name} (rank {a.max_rank}, {len(a.modules)} modules)"
                                            for a in adapters))
    return lora


def _in_layout(model, attr: str, offset: int, width: int, weights: LoraWeights | None) -> LoraWeights | None:
    """An adapter's update of one output slice with its B rows in the order the model keeps that slice's
    outputs (partial rotary: q and k head dimensions permuted at load, CausalLM.lora_output_rows)."""
    rows = model.lora_output_rows(attr, offset, width) if weights is not None else None
    return weights if rows is None else replace(weights, b=weights.b[rows])
