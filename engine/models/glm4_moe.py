"""GLM-4.5 / GLM-4.6 (transformers ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama-shaped layers
(engine/models/llama.py: pre-norms, q/k/v biases, optional per-head q/k norms, half of each head rotated NeoX-style)
whose MLPs from ``first_k_dense_replace`` on are this MoE.

Per token x (the layer's normed input), as transformers' ``Glm4MoeMoE``:
- router: DeepSeek-V3's, the one NemotronH's MoE runs (engine/models/nemotron_moe.py ``SigmoidGroupRouter``): float32
  logits, sigmoid scores, experts chosen by ``scores + e_score_correction_bias`` among the best ``topk_group`` of
  ``n_group`` groups, weights the chosen scores (normalised when ``norm_topk_prob``) times ``routed_scaling_factor``;
- experts: SwiGLU, ``down(silu(gate(x)) * up(x))``, on the fused MoE core (engine/models/moe.py);
- plus the shared experts, one SwiGLU MLP ``moe_intermediate_size * n_shared_experts`` wide.
Weights under ``model.layers.{i}.mlp.``: ``gate.weight``, ``gate.e_score_correction_bias``, ``experts.{e}.gate_proj /
up_proj / down_proj`` (or fused), ``shared_experts.gate_proj / up_proj / down_proj``. The checkpoint's MTP layer
(``model.layers.{num_hidden_layers}``) is not loaded.
"""

from __future__ import annotations

import torch

from pdcluster.engine.models.moe import FusedExperts, MoeArch, SwiGLU, take_expert_weights
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch, SigmoidGroupRouter
from pdcluster.kernels import ops

ARCHITECTURE = "Glm4MoeForCausalLM"


def glm4_moe_arch(cfg: dict, num_layers: int, where: str) -> tuple[MoeArch, NemotronMoeArch]:
    """(the layout DecoderLayer builds from: which layers are sparse, the experts' shape; the router's fields), with
    Glm4MoeConfig's defaults where a key is absent; ValueError, one line, for what is not served."""
    get = lambda key, default: default if cfg.get(key) is None else cfg[key]  # noqa: E731
    num_experts = get("n_routed_experts", get("num_local_experts", 128))
    width, num_shared = get("moe_intermediate_size", 1408), get("n_shared_experts", 1)
    router = NemotronMoeArch.from_config({
        "n_routed_experts": num_experts, "num_experts_per_tok": get("num_experts_per_tok", 8),
        "moe_intermediate_size": width, "moe_shared_expert_intermediate_size": width * max(num_shared, 1),
        "n_group": get("n_group", 1), "topk_group": get("topk_group", 1),
        "norm_topk_prob": get("norm_topk_prob", True), "routed_scaling_factor": get("routed_scaling_factor", 1.0)},
        where)
    if num_shared < 1:
        raise ValueError(f"{where}: n_shared_experts {num_shared} is not supported (at least 1)")
    first_dense = get("first_k_dense_replace", 1)
    layout = MoeArch(num_experts=num_experts, top_k=router.top_k, intermediate_size=width,
                     norm_topk_prob=router.norm_topk_prob,
                     sparse_layers=tuple(i >= first_dense for i in range(num_layers)), layout="glm4_moe",
                     shared_expert_intermediate_size=width * num_shared)
    return layout, router


class Glm4Moe:
    """One sparse MLP (module docstring); plain tensors, like DecoderLayer."""

    def __init__(self, layout: MoeArch, router_arch: NemotronMoeArch, weights: dict[str, torch.Tensor], prefix: str,
                 hidden_size: int, deterministic: bool = False, router=None):
        """``router``: another router over the same experts (DeepSeek-V2's softmax one), which then owns
        ``gate.weight``; None: DeepSeek-V3's sigmoid router, built from ``router_arch``."""
        def pop(name: str) -> torch.Tensor:
            if f"{prefix}.{name}" not in weights:
                raise ValueError(f"GLM-4 MoE weights lack {prefix}.{name}")
            return weights.pop(f"{prefix}.{name}")

        self.router = router if router is not None else SigmoidGroupRouter(
            router_arch, pop("gate.weight"), weights.pop(f"{prefix}.gate.e_score_correction_bias", None), deterministic)
        gate_up, down = take_expert_weights(weights, prefix, layout, hidden_size)
        self.experts = FusedExperts(gate_up, down, ops.silu_and_mul, deterministic)
        self.shared = SwiGLU(torch.cat([pop("shared_experts.gate_proj.weight"), pop("shared_experts.up_proj.weight")]),
                             pop("shared_experts.down_proj.weight"), deterministic)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(x)
        return self.experts(x, weights, experts).add_(self.shared(x))
