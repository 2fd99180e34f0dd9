"""Sparse mixture-of-experts MLP as transformers' ``Qwen3MoeSparseMoeBlock`` computes it, run as a fused MoE.

Per token: router logits ``x @ gate.T`` (model dtype), softmax in float32, the top ``num_experts_per_tok``
probabilities (divided by their sum when ``norm_topk_prob``), cast back to the model dtype; the output is
the sum over the chosen experts of ``weight * down(silu(gate(x)) * up(x))``.

How it runs (``SparseMoe.__call__``), with no Python loop over tokens or experts:
1. the T x k (token, expert) pairs are sorted by expert id (stable), so each expert's rows are contiguous;
2. one grouped matmul per projection over all routed rows (``torch._grouped_mm`` with the per-expert row
   offsets against the stacked [E, ...] weights; an expert with no rows is skipped, so decoding one token
   reads only its k routed experts' weights), SiLU-and-mul in between;
3. each row scaled by its routing weight and scatter-added back to its token (``index_add_``: on CPU in
   sorted order, so a token's experts are summed in expert-id order, as transformers' loop does).
Where ``torch._grouped_mm`` cannot run (device/dtype it lacks), and in deterministic mode (issue 24: every
expert matmul through the batch-invariant GEMM of engine/linear.py, one packed weight per expert), step 2
loops over the experts that have rows. Measured on CPU (bench/moe_decode.py: 128 experts, top-8, hidden
1024, width 384, one thread, shared box, medians), grouped_mm / loop: fp32 batch 1 3.75 / 3.66 ms, batch 8
25.4 / 27.6 ms, batch 64 101 / 109 ms; bf16 2.34 / 2.24, 16.2 / 17.9, 40.9 / 45.6 ms. Batch 1 moves 8 experts'
weights (38 MB fp32) in 3.75 ms; all 128 would be 604 MB: only the routed experts are read.

Expert weights are stacked at load into ``gate_up`` [E, 2 * I, H] (gate rows, then up rows) and ``down``
[E, H, I], from either layout a checkpoint has: per expert (``mlp.experts.{e}.gate_proj.weight``, ..., what
Qwen's checkpoints and transformers 5's ``save_pretrained`` write) or fused (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, transformers 5's in-memory names).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.engine.linear import Linear
from pdcluster.kernels import ops

# Config keys of MoE variants this block does not implement: a truthy value is refused at load.
_UNSUPPORTED_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "n_group",
                     "topk_group", "routed_scaling_factor")


@dataclass(frozen=True)
class MoeArch:
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size (each expert's width)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP of width intermediate_size

    @classmethod
    def from_config(cls, cfg: dict, num_layers: int, where: str = "config") -> "MoeArch":
        """Qwen3-MoE's fields (transformers' defaults where a key is absent); ValueError, one line naming
        the field, for what is not supported."""
        for key in _UNSUPPORTED_KEYS:
            if cfg.get(key):
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (MoE without shared experts or "
                                 "group-limited routing only)")
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        top_k = cfg.get("num_experts_per_tok", 8)
        if not 1 <= top_k <= max(num_experts, 1):
            raise ValueError(f"{where}: num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        step = cfg.get("decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"{where}: decoder_sparse_step {step} must be >= 1")
        dense = set(cfg.get("mlp_only_layers") or [])
        # Qwen3MoeDecoderLayer's rule, verbatim.
        sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=cfg.get("moe_intermediate_size", 768),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


def take_expert_weights(weights: dict[str, torch.Tensor], prefix: str, moe: MoeArch,
                        hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) popped from ``weights`` under ``{prefix}.experts.``, stacked
    from per-expert tensors or taken as the checkpoint's fused ones."""
    def pop(name: str) -> torch.Tensor:
        key = f"{prefix}.experts.{name}"
        if key not in weights:
            raise ValueError(f"MoE weights lack {key!r}")
        return weights.pop(key)

    E, I, H = moe.num_experts, moe.intermediate_size, hidden_size
    if f"{prefix}.experts.gate_up_proj" in weights:
        gate_up, down = pop("gate_up_proj"), pop("down_proj")
    else:
        gate_up = torch.stack([torch.cat([pop(f"{e}.gate_proj.weight"), pop(f"{e}.up_proj.weight")])
                               for e in range(E)])
        down = torch.stack([pop(f"{e}.down_proj.weight") for e in range(E)])
    for name, t, shape in (("gate_up", gate_up, (E, 2 * I, H)), ("down", down, (E, H, I))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{prefix}.experts: {name} weights have shape {tuple(t.shape)}, the config says {shape} "
                             "(num_experts, moe_intermediate_size, hidden_size)")
    return gate_up.contiguous(), down.contiguous()


@functools.cache
def grouped_mm_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here for this dtype (checked once on a tiny problem)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(3, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 32, 16, dtype=dtype, device=device_type).transpose(1, 2)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 3], dtype=torch.int32, device=device_type))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class SparseMoe:
    """The MoE MLP of one layer (module docstring); plain tensors, like DecoderLayer."""

    def __init__(self, moe: MoeArch, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 deterministic: bool = False, use_grouped_mm: bool | None = None):
        self.moe = moe
        self.router = Linear(router, deterministic=deterministic)  # [E, H]
        self.gate_up = gate_up  # [E, 2I, H]
        self.down = down  # [E, H, I]
        self._per_expert = None
        if deterministic and gate_up.device.type == "cpu":
            # One batch-invariant packed weight per expert: a row's result does not depend on how many
            # other rows its expert has this step.
            self._per_expert = [(Linear(gate_up[e], deterministic=True), Linear(down[e], deterministic=True))
                                for e in range(moe.num_experts)]
            self.gate_up = self.down = None
        if use_grouped_mm is None:
            use_grouped_mm = grouped_mm_available(gate_up.device.type, gate_up.dtype)
        self.use_grouped_mm = use_grouped_mm and self._per_expert is None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as Qwen3MoeTopKRouter computes them."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.moe.top_k
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within
        token_of_row = order // k
        counts = torch.bincount(flat, minlength=self.moe.num_experts)
        out = self.experts(x[token_of_row], counts)
        out.mul_(weights.reshape(-1)[order].unsqueeze(-1))
        return torch.zeros_like(x).index_add_(0, token_of_row, out)

    def experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's SwiGLU MLP; ``rows`` sorted by expert, ``counts`` [E] per expert."""
        if self.use_grouped_mm:
            offs = counts.cumsum(0).to(torch.int32)
            h = ops.silu_and_mul(torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs))
            return torch._grouped_mm(h, self.down.transpose(1, 2), offs=offs)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            r = rows[start : start + n]
            if self._per_expert is not None:
                gate_up, down = self._per_expert[e]
                out[start : start + n] = down(ops.silu_and_mul(gate_up(r)))
            else:
                out[start : start + n] = F.linear(ops.silu_and_mul(F.linear(r, self.gate_up[e])), self.down[e])
            start += n
        return out
