"""Multi-LoRA serving: adapters named at start-up (``--lora-modules name=path``) or loaded while serving
(``--enable-lora``: runtime.py), picked per request by name (the API's ``model`` field), batched together with
the base model's requests. adapter.py reads and checks a PEFT directory; layers.py wraps the targeted
projections; ``install`` puts them on a loaded model, ``add`` / ``remove`` put one in a slot or empty it.

An adapter changes the KV a prompt makes, so its blocks hash apart from the base model's and other adapters'
(engine/block_manager.py ``block_hash_root``: the root of the chained block hashes, from the adapter's name
and content digest), in every worker's prefix cache, the offload tiers and the router's KV index alike.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

from pdcluster.engine.lora.adapter import LoraAdapter, LoraAdapterError, LoraWeights, load_adapter
from pdcluster.engine.lora.experts import ExpertLora, expert_update, unstack
from pdcluster.engine.lora.layers import LoraLinear, LoraSet, grouped_way, slice_updates

log = logging.getLogger(__name__)

__all__ = ["LoraAdapter", "LoraAdapterError", "LoraSet", "add", "check_fits", "install", "load_adapter", "remove"]


def install(model, adapters: Sequence[LoraAdapter], runtime: bool = False) -> LoraSet:
    """Check each of ``adapters`` (load_adapter's) against ``model`` (its layers, its projections' shapes:
    ``model.lora_targets()``) and wrap the projections they target; sets and returns ``model.lora``. ``runtime``:
    adapters will also come and go while serving (``add`` / ``remove``), so every projection an adapter may target
    is wrapped now, whether or not one of these targets it. On one rank of a split model each adapter is checked
    against the whole model's shapes, then cut to the rank's slice (engine/tensor_parallel/shard_lora.py)."""
    targets = model.lora_targets()
    if targets is None:
        raise LoraAdapterError(f"LoRA adapters are not served on {model.architecture_name} models "
                               "(drop --lora-modules / --enable-lora)")
    adapters = [_fitted(model, adapter) for adapter in adapters]
    lora = LoraSet(adapters, grouped_way(model.device, model.dtype))
    lora.runtime = runtime
    for layer, owner, attr, slices in targets:
        owner, attr = _holder(owner, attr)
        updates = {}
        for slot, adapter in enumerate(adapters):
            update = _update_of(model, adapter, layer, attr, slices)
            if update is not None:
                updates[slot] = update
        if updates or runtime:
            setattr(owner, attr, LoraLinear(getattr(owner, attr), lora, updates, model.dtype, model.device,
                                            model.deterministic))
    for target in model.lora_expert_targets():
        updates = {slot: update for slot, adapter in enumerate(adapters)
                   if (update := expert_update(adapter, target)) is not None}
        if updates or runtime:
            target.experts.lora = ExpertLora(lora, updates, model.dtype, model.device, model.deterministic)
    model.run_unchunked()  # the adapter rows index the whole step
    model.lora = lora
    if adapters:
        log.info("LoRA adapters: %s", ", ".join(f"{a.name} (rank {a.max_rank}, {len(a.modules)} modules)"
                                                for a in adapters))
    return lora


def _holder(owner, attr: str) -> tuple[object, str]:
    """Where the projection ``owner.attr`` itself is held: inside a row-parallel wrapper on a split model (the
    adapter's partial update then joins the projection's partial sum before the wrapper's all-reduce)."""
    from pdcluster.engine.tensor_parallel.layers import RowParallelLinear

    inner = getattr(owner, attr)
    return (inner, "linear") if isinstance(inner, RowParallelLinear) else (owner, attr)


def check_fits(model, adapter: LoraAdapter) -> None:
    """Refuse (LoraAdapterError, naming the module) an adapter whose modules the model does not have or whose
    shapes differ from the model's projections (the whole model's, on a rank of a split one)."""
    from pdcluster.engine.tensor_parallel.shard_lora import full_shape

    world_size = model.tp_shard.world_size if model.tp_shard is not None else 1
    where = {}
    for layer, owner, attr, slices in model.lora_targets():
        holder, inner = _holder(owner, attr)
        in_features = getattr(holder, inner).in_features
        for name, offset, width in slices:
            where[(layer, name)] = full_shape(name, width, in_features, world_size)
    for target in model.lora_expert_targets():
        for name, shape in target.shapes().items():
            where.update(((target.layer, f"experts.{e}.{name}"), shape) for e in range(target.num_experts))
    num_layers = model.lora_num_layers
    for (layer, module), w in adapter.modules.items():
        refuse = f"LoRA adapter {adapter.name!r} ({adapter.path}): layer {layer} {module}: "
        if layer >= num_layers:
            raise LoraAdapterError(f"{refuse}layer {layer} but the base model has {num_layers} layers")
        if world_size > 1 and module.startswith(("experts.", "shared_expert.", "shared_experts.")):
            raise LoraAdapterError(f"{refuse}adapters on a mixture-of-experts layer's experts are served on a whole "
                                   f"model only, not split {world_size} ways (tensor_parallel_size 1)")
        if (layer, module) not in where:
            raise LoraAdapterError(f"{refuse}this layer has no such projection that takes adapters (experts of "
                                   "a mixture-of-experts family whose experts take none, a dense layer's "
                                   "experts, an expert past the layer's count, or another kind of layer)")
        width, in_features = where[(layer, module)]
        if w.a.shape[1] != in_features or w.b.shape[0] != width:
            raise LoraAdapterError(f"{refuse}lora_A {tuple(w.a.shape)} / lora_B {tuple(w.b.shape)} do not fit "
                                   f"the base model's projection [{width}, {in_features}] (an adapter trained "
                                   "for another model?)")


def _fitted(model, adapter: LoraAdapter) -> LoraAdapter:
    """``adapter`` checked against the model (check_fits), as this model runs it: cut to its rank's slice on a
    split model."""
    adapter = unstack(adapter, model.lora_expert_targets(), model.is_whole)
    check_fits(model, adapter)
    if model.is_whole:
        return adapter
    from pdcluster.engine.tensor_parallel.shard_lora import shard_adapter

    return shard_adapter(adapter, model.unsplit_arch, model.tp_shard)


def _update_of(model, adapter: LoraAdapter, layer: int, attr: str, slices):
    """``adapter``'s update of one (possibly fused) projection, None where it targets none of its modules."""
    modules = [(offset, width, _in_layout(model, attr, offset, width, adapter.modules.get((layer, name))))
               for name, offset, width in slices]
    return slice_updates(modules) if any(w is not None for _, _, w in modules) else None


def add(model, adapter: LoraAdapter) -> int:
    """Hold ``adapter`` (checked: ``check_fits``; a rank's slice of it on a split model) on a model installed with
    ``runtime``, under its name; returns its slot. Called between steps. The caller has made sure no other adapter
    has its name."""
    lora = model.lora
    adapter = _fitted(model, adapter)
    slot = lora.free_slot()
    grows = slot == lora.num_slots
    lora.put(slot, adapter)
    for layer, owner, attr, slices in model.lora_targets():
        owner, attr = _holder(owner, attr)
        wrapped = getattr(owner, attr)
        if not isinstance(wrapped, LoraLinear):
            continue
        update = _update_of(model, adapter, layer, attr, slices)
        if update is not None:
            wrapped.set_update(slot, update)
        elif grows and wrapped.slice_updates:
            wrapped.rebuild()  # the grouped layout has a place per slot: one more now
    for target in model.lora_expert_targets():
        update = expert_update(adapter, target)
        if update is not None and isinstance(target.experts.lora, ExpertLora):
            target.experts.lora.set_update(slot, update)
    lora.index[adapter.name] = slot
    log.info("LoRA adapter %s loaded (rank %d, %d modules, slot %d)", adapter.name, adapter.max_rank,
             len(adapter.modules), slot)
    return slot


def remove(model, slot: int) -> None:
    """Empty ``slot`` (no request runs with it any more); called between steps."""
    lora = model.lora
    adapter = lora.adapters[slot]
    for layer in lora.layers:
        layer.set_update(slot, None)
    lora.put(slot, None)
    if adapter is not None and lora.index.get(adapter.name) == slot:
        del lora.index[adapter.name]


def _in_layout(model, attr: str, offset: int, width: int, weights: LoraWeights | None) -> LoraWeights | None:
    """An adapter's update of one output slice with its B rows in the order the model keeps that slice's
    outputs (partial rotary: q and k head dimensions permuted at load, CausalLM.lora_output_rows)."""
    rows = model.lora_output_rows(attr, offset, width) if weights is not None else None
    return weights if rows is None else replace(weights, b=weights.b[rows])
