"""LoRA on a mixture-of-experts layer's routed experts (engine/models/moe.py ``FusedExperts``), as vLLM serves
adapters trained on Qwen3-MoE, Qwen2-MoE, Mixtral or NemotronH with every expert's projections targeted.

An adapter holds, for some experts e of a layer, low-rank updates of each expert's up projection (gate and up
stacked, as the fused weight keeps them) and down projection. Per adapter slot and projection they are kept as two
expert stacks, ``a`` [E, R, in] (each expert's A matrices stacked, zero-padded to the layer's largest rank R; zeros
for experts the adapter leaves alone) and ``b`` [E, out, R] (block-diagonal over gate and up, the lora_alpha / r
scale folded in), each a ``GroupedLinear`` like the experts' own weights. The routed rows are sorted by expert with
their offsets already (FusedExperts), so a slot's update of every routed row is two grouped matmuls over those same
offsets; a row of another slot (or of the base model) has its low-rank product zeroed between the two, so it gets
exact zeros. The grouped matmuls are the experts' own kernels (batch-invariant on CPU and in Triton), so a row's
update depends on that row alone: deterministic mode and the batch-invariance tests hold with adapters on experts.

Which rows run: on CPU (the grouped way) each adapter of the step over its own rows only (picked out, with offsets
of their own), so an adapter reads only the A and B of the experts its rows were routed to; elsewhere (CUDA) every
slot that has an update of this layer over every routed row, masked, so that a decode step's shapes follow its
number of tokens alone and the CUDA graphs capture it (``LoraSet.token_slot`` is their static buffer there). Either
way a row gets its own adapter's update computed from that row alone, so both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pdcluster.engine.lora.adapter import LoraAdapter, LoraAdapterError, LoraWeights, lora_scale

# A projection of every expert: its output slices (Hugging Face module name, offset, width) and its in_features.
ExpertSlices = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ExpertTarget:
    """Where an adapter may add to one MoE layer's routed experts: the checkpoint's layer, the ``FusedExperts``, the
    up projection's slices (gate then up, or up alone) and the down projection's name."""

    layer: int
    experts: object  # engine/models/moe.py FusedExperts
    up: ExpertSlices
    down: str
    # transformers 5's names of the experts' stacked parameters (up, down): what PEFT's target_parameters name
    params: tuple[str, str] = ("gate_up_proj", "down_proj")

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Each expert module's [out, in] by its name under ``experts.{e}.``."""
        up, down = self.experts.up, self.experts.down
        out = {name: (width, up.in_features) for name, _, width in self.up}
        out[self.down] = (down.out_features, down.in_features)
        return out


def unstack(adapter: LoraAdapter, targets: list[ExpertTarget], whole: bool) -> LoraAdapter:
    """``adapter`` with PEFT's target_parameters form of experts (``adapter.stacked``: one A and B per expert-stack
    parameter, what PEFT >= 0.17 writes for transformers 5's fused experts) turned into per-expert modules, as the
    per-expert form names them. Which parameter a pair adapts is read from its shapes (the up projection's
    [in, out] differs from the down projection's); its rank is its rows over the layer's number of experts, its
    lora_alpha the config's for ``{module}.{parameter}`` (PEFT doubles a fused gate/up parameter's rank and alpha
    through rank_pattern / alpha_pattern). LoraAdapterError for a layer whose experts take no adapters here."""
    if not adapter.stacked:
        return adapter
    by_layer = {t.layer: t for t in targets}
    modules = dict(adapter.modules)
    for (layer, _), stacked in sorted(adapter.stacked.items()):
        refuse = f"LoRA adapter {adapter.name!r} ({adapter.path}): layer {layer} experts: "
        target = by_layer.get(layer)
        if target is None:
            raise LoraAdapterError(refuse + ("adapters on a mixture-of-experts layer's experts are served on a whole "
                                             "model only, not split (tensor_parallel_size 1)" if not whole else
                                             "this layer has no experts that take adapters"))
        num_experts, (rows, in_features), out_features = target.num_experts, stacked.a.shape, stacked.b.shape[0]
        up, down = target.experts.up, target.experts.down
        if (in_features, out_features) == (up.in_features, up.out_features):
            param, slices = target.params[0], target.up
        elif (in_features, out_features) == (down.in_features, down.out_features):
            param, slices = target.params[1], ((target.down, 0, down.out_features),)
        else:
            raise LoraAdapterError(f"{refuse}lora_A {tuple(stacked.a.shape)} / lora_B {tuple(stacked.b.shape)} fit "
                                   f"neither expert projection of the base model (up [{up.out_features}, "
                                   f"{up.in_features}], down [{down.out_features}, {down.in_features}] for each of "
                                   f"{num_experts} experts)")
        if rows % num_experts:
            raise LoraAdapterError(f"{refuse}lora_A's {rows} rows are not a rank for each of {num_experts} experts")
        rank = rows // num_experts
        if adapter.rank_limit and rank > adapter.rank_limit:
            raise LoraAdapterError(f"{refuse}{param}: rank {rank} exceeds max_lora_rank {adapter.rank_limit} (raise "
                                   "--max-lora-rank)")
        scale = lora_scale(adapter.alphas.of(f"{stacked.path}.{param}"), rank, adapter.rslora)
        a = stacked.a.reshape(num_experts, rank, in_features)
        b = stacked.b.reshape(out_features, rank, num_experts)
        for e in range(num_experts):
            for name, offset, width in slices:
                key = (layer, f"experts.{e}.{name}")
                if key in modules:
                    raise LoraAdapterError(f"{refuse}expert {e} {name} is adapted twice (per expert and stacked)")
                modules[key] = LoraWeights(a[e].contiguous(), b[offset : offset + width, :, e].contiguous(), scale)
    return replace(adapter, modules=modules, stacked={})


# One adapter's update of one layer's experts, float32 on the CPU: per projection ("up", "down") the expert stacks
# (a [E, R, in], b [E, out, R] with the scale folded in), or None where it targets no expert's projection of that kind.
ExpertUpdate = dict[str, tuple[torch.Tensor, torch.Tensor] | None]


def expert_update(adapter: LoraAdapter, target: ExpertTarget) -> ExpertUpdate | None:
    """``adapter``'s update of ``target``'s experts, None where it targets none of them."""
    def stack(slices: ExpertSlices, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        per_expert: list[list[tuple[int, LoraWeights]]] = [
            [(offset, w) for name, offset, _ in slices
             if (w := adapter.modules.get((target.layer, f"experts.{e}.{name}"))) is not None]
            for e in range(target.num_experts)]
        rank = max((sum(w.rank for _, w in ws) for ws in per_expert), default=0)
        if rank == 0:
            return None
        a = torch.zeros(target.num_experts, rank, in_features)
        b = torch.zeros(target.num_experts, out_features, rank)
        for e, ws in enumerate(per_expert):
            col = 0
            for offset, w in ws:
                a[e, col : col + w.rank] = w.a
                b[e, offset : offset + w.b.shape[0], col : col + w.rank] = w.b * w.scale
                col += w.rank
        return a, b

    up, down = target.experts.up, target.experts.down
    update = {"up": stack(target.up, up.out_features, up.in_features),
              "down": stack(((target.down, 0, down.out_features),), down.out_features, down.in_features)}
    return update if any(v is not None for v in update.values()) else None


class ExpertLora:
    """The adapters' updates of one MoE layer's experts; ``FusedExperts`` calls ``add`` after each projection."""

    def __init__(self, lora, updates: dict[int, ExpertUpdate], dtype: torch.dtype, device: torch.device,
                 deterministic: bool):
        """``lora``: the model's LoraSet; ``updates``: slot -> its update, for the adapters that target these experts
        (none yet: experts wrapped for adapters loaded later)."""
        self.lora = lora
        self.dtype, self.device, self.deterministic = dtype, device, deterministic
        self.updates: dict[int, ExpertUpdate] = dict(updates)  # float32, on the CPU: what ``rebuild`` packs
        self.grouped: dict[int, dict[str, tuple[object, object] | None]] = {}
        self.rebuild()
        lora.layers.append(self)

    def set_update(self, slot: int, update: ExpertUpdate | None) -> None:
        """Slot ``slot``'s update from now on (None: it has none); called between steps."""
        if update is None and slot not in self.updates:
            return
        if update is None:
            del self.updates[slot]
        else:
            self.updates[slot] = update
        self.rebuild()

    def rebuild(self) -> None:
        from pdcluster.engine.models.moe import GroupedLinear  # the model imports the LoRA layers, not the reverse

        def grouped(pair):
            if pair is None:
                return None
            return tuple(GroupedLinear(t.to(self.dtype).to(self.device).contiguous(), self.deterministic)
                         for t in pair)

        self.grouped = {slot: {proj: grouped(pair) for proj, pair in update.items()}
                        for slot, update in sorted(self.updates.items())}
        self.lora.changed()

    def plan(self, offs: torch.Tensor, order: torch.Tensor, experts: torch.Tensor, top_k: int) -> list | None:
        """For one call of the experts (``experts`` [T * k] each (token, slot) pair's expert, ``order`` those pairs
        sorted by expert: the routed rows, ``offs`` [E + 1] each expert's), which rows each adapter updates, shared
        by the up and the down projection: [(slot, its rows or a mask of the others', their offsets)]; None: no
        adapter row in the step."""
        token_slot = self.lora.token_slot
        if token_slot is None or not self.grouped:
            return None
        row_slot = token_slot[order // top_k]
        if not self.lora.grouped:  # CUDA: every slot over every row, masked (shapes fixed for the graphs)
            return [(slot, row_slot != slot, offs) for slot in self.grouped]
        row_experts = experts[order]
        plan = []  # CPU: each adapter of the step over its own rows (its experts' A and B read alone)
        for slot in sorted(self.lora.step_slots & self.grouped.keys()):
            picked = (row_slot == slot).nonzero().squeeze(1)
            if picked.numel():
                counts = torch.bincount(row_experts[picked], minlength=len(offs) - 1)
                plan.append((slot, picked, torch.cat([counts.new_zeros(1), counts.cumsum(0)])))
        return plan

    def add(self, out: torch.Tensor, rows: torch.Tensor, plan: list, proj: str) -> None:
        """``out`` [R, N] (projection ``proj`` of the routed ``rows`` [R, K]) plus each row's adapter update, in place,
        as ``plan`` says."""
        for slot, picked, offs in plan:
            pair = self.grouped[slot][proj]
            if pair is None:
                continue
            a, b = pair
            if picked.dtype == torch.bool:  # a mask of the rows of other slots
                low = a(rows, offs)
                out.add_(b(low.masked_fill_(picked.unsqueeze(1), 0), offs))
            else:
                out.index_add_(0, picked, b(a(rows[picked], offs), offs))
