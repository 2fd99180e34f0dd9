"""NemotronH's MoE layer (layer type "moe", "E" in the pattern) as transformers 5's ``NemotronHMoE`` computes it,
on the fused MoE core of engine/models/moe.py.

Per token x (the block's normed input, [T, H]):
- router (``NemotronHTopkRouter``, DeepSeek-V3's "noaux_tc"): logits ``x @ gate.T`` in float32 (the router
  weight and ``e_score_correction_bias`` are float32 in transformers), ``scores = sigmoid(logits)``; experts are
  *chosen* by ``scores + bias``: the experts are cut into ``n_group`` groups, a group scores the sum of its top
  two, only the best ``topk_group`` groups stay, then the top ``num_experts_per_tok`` experts of those; the
  routing *weights* are the chosen experts' ``scores`` without the bias, divided by their sum (+1e-20) when
  ``norm_topk_prob``, times ``routed_scaling_factor``, kept in float32;
- latent projection (``moe_latent_size`` L, when set): the experts run in L dims, ``fc1_latent_proj`` [L, H]
  before them and ``fc2_latent_proj`` [H, L] after the weighted sum (rounded to the model dtype in between);
- experts: ``down(relu2(up(x)))`` (no gate), ``up`` [E, I, L or H], ``down`` [E, L or H, I];
- plus the shared expert, a NemotronH MLP of width ``moe_shared_expert_intermediate_size`` on x.

Weights (transformers' names under ``model.layers.{i}.mixer.``): ``gate.weight``, ``gate.e_score_correction_bias``
(zeros when absent, as transformers initialises a missing buffer), ``experts.{e}.up_proj.weight`` /
``experts.{e}.down_proj.weight`` (what NVIDIA's checkpoints and ``save_pretrained`` write) or the fused
``experts.up_proj`` / ``experts.down_proj``, ``fc1_latent_proj.*``, ``fc2_latent_proj.*``, ``shared_experts.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdcluster.engine.linear import Linear
from pdcluster.engine.models.moe import (FusedExperts, batch_invariant_sigmoid, check_shape, relu2,
                                         take_stacked_experts)


@dataclass(frozen=True)
class NemotronMoeArch:
    """The MoE fields of a NemotronH config (transformers' NemotronHConfig defaults where a key is absent)."""

    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size (each routed expert's width)
    shared_intermediate_size: int  # moe_shared_expert_intermediate_size
    latent_size: int | None  # moe_latent_size: None = the experts run in hidden_size dims
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config") -> "NemotronMoeArch":
        """ValueError, one line naming the field and its value, for a configuration transformers cannot run
        or we do not implement."""
        def positive(key: str, default: int) -> int:
            value = cfg.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {key} {value!r} must be a positive integer")
            return value

        num_experts = positive("n_routed_experts", 8)
        top_k = positive("num_experts_per_tok", 2)
        n_group, topk_group = positive("n_group", 1), positive("topk_group", 1)
        latent = cfg.get("moe_latent_size")
        arch = cls(num_experts=num_experts, top_k=top_k, intermediate_size=positive("moe_intermediate_size", 7688),
                   shared_intermediate_size=positive("moe_shared_expert_intermediate_size", 7688),
                   latent_size=None if latent is None else positive("moe_latent_size", 0),
                   n_group=n_group, topk_group=topk_group, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
        if num_experts % n_group:
            raise ValueError(f"{where}: n_group {n_group} does not divide n_routed_experts {num_experts}")
        if num_experts // n_group < 2:
            raise ValueError(f"{where}: n_group {n_group} leaves {num_experts // n_group} expert per group of "
                             f"n_routed_experts {num_experts}; a group's score is the sum of its top 2 experts")
        if topk_group > n_group:
            raise ValueError(f"{where}: topk_group {topk_group} must be in 1..n_group ({n_group})")
        per_group = num_experts // n_group
        if top_k > topk_group * per_group:
            raise ValueError(f"{where}: num_experts_per_tok {top_k} is more than the {topk_group * per_group} experts "
                             f"of topk_group {topk_group} groups of {per_group}")
        return arch


class SigmoidGroupRouter:
    """``NemotronHTopkRouter`` (module docstring): (weights float32 [T, k], expert ids [T, k])."""

    def __init__(self, moe: NemotronMoeArch, weight: torch.Tensor, bias: torch.Tensor | None,
                 deterministic: bool = False):
        self.moe = moe
        self.proj = Linear(weight.float(), deterministic=deterministic)  # [E, H], float32 as transformers keeps it
        self.bias = bias.float() if bias is not None else torch.zeros(moe.num_experts, device=weight.device)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        scores = batch_invariant_sigmoid(self.proj(x.float()))
        choice = scores + self.bias
        if m.topk_group < m.n_group:  # all groups kept otherwise: the mask would change nothing
            groups = choice.view(-1, m.n_group, m.num_experts // m.n_group)
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(m.topk_group, dim=-1, sorted=False).indices, True)
            choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, m.num_experts)
        experts = choice.topk(m.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * m.routed_scaling_factor, experts


class NemotronHMoE:
    """One MoE mixer (module docstring). ``w(name)`` / ``w_opt(name)`` take the layer's ``mixer.{name}``
    tensors (required / optional); ``shared`` is the shared-expert MLP, built by the caller."""

    def __init__(self, moe: NemotronMoeArch, hidden_size: int, w: Callable[[str], torch.Tensor],
                 w_opt: Callable[[str], torch.Tensor | None], shared: Callable[[torch.Tensor], torch.Tensor],
                 weights: dict[str, torch.Tensor], prefix: str, deterministic: bool = False,
                 backend: str = "auto"):
        E, I = moe.num_experts, moe.intermediate_size
        inner = moe.latent_size or hidden_size
        router = w("gate.weight")
        check_shape(f"{prefix}.gate.weight", router, (E, hidden_size), "n_routed_experts, hidden_size")
        self.router = SigmoidGroupRouter(moe, router, w_opt("gate.e_score_correction_bias"), deterministic)
        self.fc1 = self.fc2 = None
        if moe.latent_size is not None:
            self.fc1 = _BiasedLinear(w("fc1_latent_proj.weight"), w_opt("fc1_latent_proj.bias"), deterministic)
            self.fc2 = _BiasedLinear(w("fc2_latent_proj.weight"), w_opt("fc2_latent_proj.bias"), deterministic)
        up = take_stacked_experts(weights, prefix, "up_proj", ("up_proj",), E)
        down = take_stacked_experts(weights, prefix, "down_proj", ("down_proj",), E)
        fields = "n_routed_experts, moe_intermediate_size, moe_latent_size or hidden_size"
        check_shape(f"{prefix}.experts up_proj", up, (E, I, inner), fields)
        check_shape(f"{prefix}.experts down_proj", down, (E, inner, I), fields)
        self.experts = FusedExperts(up, down, relu2, deterministic, backend)
        self.shared = shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(x)
        h = self.fc1(x) if self.fc1 is not None else x
        h = self.experts(h, weights, experts)
        if self.fc2 is not None:
            h = self.fc2(h)
        return h + self.shared(x)


class _BiasedLinear:
    """``x @ weight.T (+ bias)``: the latent projections (biased when the config's mlp_bias is)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, deterministic: bool):
        self.proj = Linear(weight, deterministic=deterministic)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.proj(x)
        return out + self.bias if self.bias is not None else out
