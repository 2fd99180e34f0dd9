"""The fused mixture-of-experts core, and Qwen3-MoE's, Qwen2-MoE's and Mixtral's sparse MLP (transformers'
``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``) on it.
NemotronH's MoE (sigmoid group routing, relu2 experts, latent projection, shared expert) is
engine/models/nemotron_moe.py, on the same core.

A router gives every token k (routing weight, expert id) pairs. ``FusedExperts`` then runs them with no
Python loop over tokens or experts:
1. the T x k pairs are sorted by expert id (stable), so each expert's rows are contiguous, ``offs`` [E + 1]
   their row offsets (device ops only: no host sync, so CUDA graphs capture it);
2. one grouped matmul per projection over all routed rows (``GroupedLinear``), the activation in between
   (SwiGLU for Qwen3, relu2 for NemotronH). An expert with no rows is skipped, so decoding one token reads only
   its k routed experts' weights;
3. each row times its routing weight (in the weight's dtype: Qwen3 rounds it to the model dtype first,
   NemotronH keeps float32), put back in (token, slot) order and summed over the k slots in float32, rounded
   once to the model dtype: transformers' grouped_mm path (its default) in the same order of operations.

``GroupedLinear`` holds [E, N, K] weights as the backend wants them: on CPU (float32, bfloat16) packed for the
C kernel kernels/csrc/grouped_gemm_bi.c, which is batch-invariant (a row's result does not depend on how many
rows its expert got: deterministic mode needs nothing else here); on CUDA the Triton kernel
kernels/triton_grouped_mm.py (fixed tiles: batch-invariant too); elsewhere ``torch._grouped_mm``.
Measured on CPU by bench/moe_decode.py (figures in bench/results/moe_decode.json).

Qwen3-MoE: router logits ``x @ gate.T`` (model dtype), softmax in float32, the top ``num_experts_per_tok``
probabilities (divided by their sum when ``norm_topk_prob``), experts ``down(silu(gate(x)) * up(x))``. Expert
weights are stacked at load into ``gate_up`` [E, 2I, H] (gate rows, then up rows) and ``down`` [E, H, I] from
either layout a checkpoint has: per expert (``mlp.experts.{e}.gate_proj.weight``, ..., what Qwen's checkpoints
and transformers 5's ``save_pretrained`` write) or fused (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
Qwen3-VL-MoE's language model (Qwen3-VL-30B-A3B, 235B-A22B) is Qwen3-MoE whose router always renormalises, its
experts fused as the Hub's checkpoints keep them, ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H], transposed
at load (as transformers' conversion does).

Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen3-MoE's router and experts (other config defaults), plus a
shared expert every token runs: a dense SwiGLU MLP of width ``shared_expert_intermediate_size``
(``mlp.shared_expert.gate_proj/up_proj/down_proj``) times ``sigmoid(x @ mlp.shared_expert_gate.weight.T)``, one
scalar per token, added to the routed output in the model dtype (transformers' order: routed + gated shared).

gpt-oss (openai/gpt-oss-20b, -120b): router logits ``x @ mlp.router.weight.T + mlp.router.bias`` (model dtype), the
top ``num_experts_per_tok`` logits, softmax over those (model dtype); experts with biases on both projections and
a clamped SwiGLU, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)`` (alpha 1.702,
L 7.0: ``swiglu_alpha`` / ``swiglu_limit``). The checkpoint stores them as transformers' GptOssExperts parameters:
``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up columns interleaved (gate at even ones), its bias [E, 2I]
alike, ``down_proj`` [E, I, H] and its bias [E, H] (MXFP4 releases: engine/models/mxfp4.py dequantizes them to
that first). The loader transposes them to [E, out, in] and puts the gate rows first.

Llama 4 (Scout, Maverick): router logits ``x @ feed_forward.router.weight.T`` (model dtype), the top
``num_experts_per_tok`` (1) logits, each token's input to an expert scaled by the sigmoid of its logit (the input,
not the output: ``down(silu(gate(s x)) * up(s x))``), beside a shared SwiGLU expert of the experts' width every token
runs; experts stored as transformers' Llama4TextExperts parameters, ``gate_up_proj`` [E, H, 2I] (gate columns, then
up) and ``down_proj`` [E, I, H]. Its checkpoints say ``feed_forward`` where the others say ``mlp``.

GraniteMoe (granite-3.x-1b-a400m, 3b-a800m): router logits ``x @ block_sparse_moe.router.layer.weight.T`` (model
dtype, then float32), the top ``num_experts_per_tok`` logits, softmax over those (rounded to the model dtype);
experts stored stacked as ``input_linear`` [E, 2I, H] (gate rows, then up rows) and ``output_linear`` [E, H, I].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from pdcluster.engine.linear import DeterministicUnavailable, Linear, check_deterministic_available
from pdcluster.kernels import cpu_grouped_mm, ops

# Config keys of Qwen-MoE variants this block does not implement: a truthy value is refused at load
# (shared_expert_intermediate_size is Qwen2-MoE's own, refused on Qwen3-MoE only).
_UNSUPPORTED_KEYS = ("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "routed_scaling_factor")
# transformers' defaults for the keys a config may omit (Qwen3MoeConfig, Qwen2MoeConfig).
_DEFAULTS = {
    "qwen3": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632),
    "qwen3_vl_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408),  # Qwen3VLMoeTextConfig
}


# ---------------------------------------------------------------------------------------------------
# Expert weights


def take_stacked_experts(weights: dict[str, torch.Tensor], prefix: str, fused_name: str,
                         per_expert_names: tuple[str, ...], num_experts: int) -> torch.Tensor:
    """One projection of every expert, [E, out, in], popped from ``weights``: the checkpoint's fused tensor
    ``{prefix}.experts.{fused_name}`` when it has one, else ``{prefix}.experts.{e}.{name}.weight`` stacked over
    e (several names are concatenated along the output rows, e.g. Qwen3's gate_proj then up_proj)."""
    def pop(key: str) -> torch.Tensor:
        if key not in weights:
            raise ValueError(f"MoE weights lack {key!r}")
        return weights.pop(key)

    fused = f"{prefix}.experts.{fused_name}"
    if fused in weights:
        return weights.pop(fused).contiguous()
    return torch.stack([torch.cat([pop(f"{prefix}.experts.{e}.{name}.weight") for name in per_expert_names])
                        for e in range(num_experts)])


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], fields: str) -> None:
    """ValueError, one line, when a loaded tensor's shape is not the one the config's ``fields`` give."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the config says {shape} ({fields})")


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


class GroupedLinear:
    """``y[r] = rows[r] @ weight[e].T`` for the rows ``offs[e]:offs[e + 1]`` of expert e, over E weights
    [E, out, in] kept in the layout of the backend that runs them (module docstring): "c" (CPU float32 /
    bfloat16: packed, the only copy), "triton" (CUDA) or "torch" (``torch._grouped_mm``; ``backend="torch"``
    asks for it, for comparisons)."""

    def __init__(self, weight: torch.Tensor, deterministic: bool = False, backend: str = "auto"):
        self.num_experts, self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor | None = weight
        self._packed = None
        device = weight.device.type
        if deterministic:
            check_deterministic_available(device)  # one line saying why not, when the kernels are missing
        if backend == "auto" and device == "cpu" and cpu_grouped_mm.available():
            self._packed = cpu_grouped_mm.pack_experts(weight)
        if self._packed is not None:
            self.backend, self.weight = "c", None
        elif backend == "auto" and weight.is_cuda and ops.triton_available():
            self.backend = "triton"
        elif deterministic:  # torch._grouped_mm's result for a row may change with its group's size
            raise DeterministicUnavailable(f"deterministic mode needs a batch-invariant grouped matmul for "
                                           f"{weight.dtype} experts on {device} (kernels/csrc/grouped_gemm_bi.c on "
                                           "CPU float32/bfloat16, Triton on CUDA); run with --no-deterministic")
        elif backend in ("auto", "torch") and grouped_mm_available(device, weight.dtype):
            self.backend = "torch"
        else:
            raise ValueError(f"no grouped matmul for {weight.dtype} expert weights on {device} "
                             f"(backend {backend!r}): the C kernels (CPU float32/bfloat16) need a C compiler, "
                             "Triton needs CUDA, torch._grouped_mm needs a newer torch")

    def __call__(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.backend == "c":
            out = cpu_grouped_mm.grouped_linear_bi(rows, self._packed, offs)
            assert out is not None, f"grouped_linear_bi took no {rows.dtype} rows for {self._packed.dtype} weights"
            return out
        if self.backend == "triton":
            from pdcluster.kernels.triton_grouped_mm import grouped_mm_triton  # triton only where CUDA is

            return grouped_mm_triton(rows, self.weight, offs)
        return torch._grouped_mm(rows, self.weight.transpose(1, 2), offs=offs[1:].to(torch.int32))


def relu2(x: torch.Tensor) -> torch.Tensor:
    """NemotronH's ``relu2``: relu(x) squared (in place on the fresh projection output)."""
    return torch.relu_(x).square_()


class FusedExperts:
    """E experts ``down(act(up(x)))`` applied to routed tokens (module docstring, steps 1-3)."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                 deterministic: bool = False, backend: str = "auto", up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, scale_inputs: bool = False):
        """``up_bias`` [E, I or 2I] / ``down_bias`` [E, H]: per-expert biases (gpt-oss), added to each routed row
        after its projection (the grouped matmuls take none). ``scale_inputs`` (Llama 4): the routing weight scales
        each routed row before the experts instead of after."""
        self.num_experts = up.shape[0]
        self.up = GroupedLinear(up, deterministic, backend)  # [E, I or 2I, H]
        self.down = GroupedLinear(down, deterministic, backend)  # [E, H, I]
        self.activation = activation
        self.up_bias, self.down_bias = up_bias, down_bias
        self.scale_inputs = scale_inputs
        self.lora = None  # LoRA adapters' updates of these experts (engine/lora/experts.py ExpertLora), if any

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H]; ``weights`` [T, k] (float32, or the dtype the products are rounded to); ``experts``
        [T, k] ids. Returns [T, H] in x's dtype."""
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        rows_in = x[order // k]
        if self.scale_inputs:
            rows_in = rows_in * weights.reshape(-1)[order].unsqueeze(-1)
        plan = self.lora.plan(offs, order, flat, k) if self.lora is not None else None
        if plan is not None:  # a step with adapter rows (engine/lora/experts.py)
            up = self.up(rows_in, offs)
            self.lora.add(up, rows_in, plan, "up")
            hidden = self.activation(up)
            rows = self.down(hidden, offs)
            self.lora.add(rows, hidden, plan, "down")
        elif self.up_bias is None:
            rows = self.down(self.activation(self.up(rows_in, offs)), offs)
        else:  # each row's expert, in the sorted order: its bias row
            row_experts = flat[order]
            hidden = self.activation(self.up(rows_in, offs).add_(self.up_bias[row_experts]))
            rows = self.down(hidden, offs).add_(self.down_bias[row_experts])
        if not self.scale_inputs:
            rows = rows * weights.reshape(-1)[order].unsqueeze(-1)
        by_slot = torch.empty_like(rows)
        by_slot[order] = rows  # back to (token, slot) order: the k rows of a token are adjacent
        return by_slot.view(num_tokens, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Qwen3-MoE, Qwen2-MoE, Mixtral


@dataclass(frozen=True)
class MoeArch:
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size (each expert's width)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP of width intermediate_size
    # "qwen3": mlp.gate + mlp.experts.{e}.gate_proj/up_proj/down_proj, routing weights rounded to the model dtype;
    # "qwen2_moe": the same, and the gated shared expert (module docstring);
    # "qwen3_vl_moe": Qwen3-VL-MoE's language model: "qwen3"'s router (always renormalised) and experts, stored fused
    # as mlp.experts.gate_up_proj [E, H, 2I] (gate columns, then up) and down_proj [E, I, H];
    # "mixtral": block_sparse_moe.gate + block_sparse_moe.experts.{e}.w1/w3/w2, weights kept float32 (as
    # transformers' MixtralExperts multiplies);
    # "granitemoe": block_sparse_moe.router.layer + input_linear / output_linear, softmax over the top-k logits;
    # "gpt_oss": mlp.router (weight and bias) + mlp.experts' stacked parameters with biases, softmax over the top-k
    # logits, the clamped SwiGLU (module docstring).
    layout: str = "qwen3"
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the shared expert's width (0: no shared expert)
    swiglu_alpha: float = 0.0  # gpt-oss: the clamped SwiGLU's sigmoid gain and clamp (module docstring)
    swiglu_limit: float = 0.0

    @classmethod
    def _every_layer_sparse(cls, num_layers: int, where: str, layout: str, num_experts: int, top_k: int,
                            intermediate_size: int, **extra) -> "MoeArch":
        """A MoE in every layer, its top-k weights a distribution (renormalised, or a softmax over the top k)."""
        if not 1 <= top_k <= max(num_experts, 1):
            raise ValueError(f"{where}: num_experts_per_tok {top_k} must be in 1..num_local_experts ({num_experts})")
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate_size, norm_topk_prob=True,
                   sparse_layers=(True,) * num_layers, layout=layout, **extra)

    @classmethod
    def gpt_oss(cls, cfg: dict, num_layers: int, where: str = "config") -> "MoeArch":
        """gpt-oss's: every layer sparse, experts of width intermediate_size (GptOssConfig's defaults)."""
        return cls._every_layer_sparse(num_layers, where, "gpt_oss", cfg.get("num_local_experts") or 128,
                                       cfg.get("num_experts_per_tok") or 4, cfg.get("intermediate_size") or 2880,
                                       swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
                                       swiglu_limit=float(cfg.get("swiglu_limit") or 7.0))

    @classmethod
    def llama4(cls, cfg: dict, num_layers: int, where: str = "config") -> "MoeArch":
        """Llama 4's: the layers ``moe_layers`` names (default: every ``interleave_moe_layer_step``-th), experts and
        the shared expert of width intermediate_size (Llama4TextConfig's defaults)."""
        step = cfg.get("interleave_moe_layer_step") or 1
        moe_layers = cfg.get("moe_layers")
        moe_layers = set(range(step - 1, num_layers, step) if moe_layers is None else moe_layers)
        width = cfg.get("intermediate_size") or 8192
        arch = cls._every_layer_sparse(num_layers, where, "llama4", cfg.get("num_local_experts") or 16,
                                       cfg.get("num_experts_per_tok") or 1, width,
                                       shared_expert_intermediate_size=width)
        return replace(arch, sparse_layers=tuple(i in moe_layers for i in range(num_layers)))

    @classmethod
    def mixtral(cls, cfg: dict, num_layers: int, where: str = "config") -> "MoeArch":
        """Mixtral's MoE: every layer sparse, experts of width intermediate_size, top-k always renormalised."""
        return cls._every_layer_sparse(num_layers, where, "mixtral", cfg.get("num_local_experts", 8),
                                       cfg.get("num_experts_per_tok", 2), cfg["intermediate_size"])

    @classmethod
    def granitemoe(cls, cfg: dict, num_layers: int, where: str = "config") -> "MoeArch":
        """GraniteMoe's: every layer sparse, experts of width intermediate_size (GraniteMoeConfig's defaults)."""
        return cls._every_layer_sparse(num_layers, where, "granitemoe", cfg.get("num_local_experts") or 8,
                                       cfg.get("num_experts_per_tok") or 2, cfg.get("intermediate_size") or 11008)

    @property
    def block(self) -> str:
        """The MoE block's name under a layer."""
        return "block_sparse_moe" if self.layout in ("mixtral", "granitemoe") else "mlp"

    @property
    def router_weight(self) -> str:
        """The router's weight under the MoE block."""
        return {"granitemoe": "router.layer.weight", "gpt_oss": "router.weight",
                "llama4": "router.weight"}.get(self.layout, "gate.weight")

    @classmethod
    def from_config(cls, cfg: dict, num_layers: int, where: str = "config", layout: str = "qwen3") -> "MoeArch":
        """Qwen3-MoE's (``layout="qwen3"``) or Qwen2-MoE's (``"qwen2_moe"``) fields, transformers' defaults where a
        key is absent; ValueError, one line naming the field, for what is not supported."""
        defaults = _DEFAULTS[layout]
        refused = _UNSUPPORTED_KEYS + (() if layout == "qwen2_moe" else ("shared_expert_intermediate_size",))
        for key in refused:
            if cfg.get(key):
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (MoE without group-limited routing, "
                                 "and with a shared expert on Qwen2-MoE only)")
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", defaults["num_experts"]))
        top_k = cfg.get("num_experts_per_tok", defaults["num_experts_per_tok"])
        if not 1 <= top_k <= max(num_experts, 1):
            raise ValueError(f"{where}: num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        step = cfg.get("decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"{where}: decoder_sparse_step {step} must be >= 1")
        dense = set(cfg.get("mlp_only_layers") or [])
        # Qwen3MoeDecoderLayer's rule, verbatim (Qwen2MoeDecoderLayer's is the same).
        sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        shared = 0
        if layout == "qwen2_moe":
            shared = cfg.get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])
            if not shared or shared < 1:
                raise ValueError(f"{where}: shared_expert_intermediate_size {shared!r} must be >= 1")
        return cls(num_experts=num_experts, top_k=top_k,
                   intermediate_size=cfg.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse, layout=layout,
                   shared_expert_intermediate_size=shared)


def take_expert_weights(weights: dict[str, torch.Tensor], prefix: str, moe: MoeArch,
                        hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) popped from ``weights`` under ``{prefix}.experts.``, in the
    checkpoint's layout (Qwen3's gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2)."""
    E, I, H = moe.num_experts, moe.intermediate_size, hidden_size
    if moe.layout == "qwen3_vl_moe":
        gate_up, down = (_pop(weights, f"{prefix}.experts.{name}") for name in ("gate_up_proj", "down_proj"))
        # The Hub's checkpoints keep [E, H, 2I] and [E, I, H] (transformers transposes them at load); a checkpoint
        # in transformers' own layout, [E, 2I, H] and [E, H, I], is taken as it is.
        if tuple(gate_up.shape) == (E, H, 2 * I):
            gate_up = gate_up.transpose(1, 2)
        if tuple(down.shape) == (E, I, H):
            down = down.transpose(1, 2)
        gate_up, down = gate_up.contiguous(), down.contiguous()
    elif moe.layout in ("gpt_oss", "llama4"):  # transformers' [E, in, out] parameters
        gate_up, down = (_pop(weights, f"{prefix}.experts.{name}") for name in ("gate_up_proj", "down_proj"))
        check_shape(f"{prefix}.experts.gate_up_proj", gate_up, (E, H, 2 * I), "num_local_experts, hidden_size, "
                    "intermediate_size")
        check_shape(f"{prefix}.experts.down_proj", down, (E, I, H), "num_local_experts, intermediate_size, hidden_size")
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2).contiguous()
        # gpt-oss interleaves gate and up columns; Llama 4 has its gate columns first already
        gate_up = gate_first(gate_up) if moe.layout == "gpt_oss" else gate_up.contiguous()
    elif moe.layout == "granitemoe":  # stacked in the checkpoint, beside the experts (not under .experts)
        for name in ("input_linear", "output_linear"):
            if f"{prefix}.{name}.weight" not in weights:
                raise ValueError(f"MoE weights lack {prefix}.{name}.weight")
        gate_up, down = weights.pop(f"{prefix}.input_linear.weight"), weights.pop(f"{prefix}.output_linear.weight")
    else:
        gate, up, down_name = ("w1", "w3", "w2") if moe.layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        gate_up = take_stacked_experts(weights, prefix, "gate_up_proj", (gate, up), E)
        down = take_stacked_experts(weights, prefix, "down_proj", (down_name,), E)
    fields = "num_experts, moe_intermediate_size, hidden_size"
    check_shape(f"{prefix}.experts gate_up", gate_up, (E, 2 * I, H), fields)
    check_shape(f"{prefix}.experts down", down, (E, H, I), fields)
    return gate_up, down


def _pop(weights: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in weights:
        raise ValueError(f"MoE weights lack {key!r}")
    return weights.pop(key)


def gate_first(interleaved: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up rows (dim 1 of [E, 2I, ...]) interleaved, gate at even indices, as [E, 2I, ...] with the
    I gate rows first, then the up rows: the layout FusedExperts' activations split in halves."""
    return torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1).contiguous()


def take_expert_biases(weights: dict[str, torch.Tensor], prefix: str, moe: MoeArch,
                       hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's expert biases (gate_up [E, 2I] gate first, down [E, H]) popped from under ``{prefix}.experts.``."""
    E, I = moe.num_experts, moe.intermediate_size
    gate_up = _pop(weights, f"{prefix}.experts.gate_up_proj_bias")
    down = _pop(weights, f"{prefix}.experts.down_proj_bias")
    check_shape(f"{prefix}.experts.gate_up_proj_bias", gate_up, (E, 2 * I), "num_local_experts, intermediate_size")
    check_shape(f"{prefix}.experts.down_proj_bias", down, (E, hidden_size), "num_local_experts, hidden_size")
    return gate_first(gate_up), down


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss's activation over [rows, 2I] (gate half, then up half): ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha
    * g)``, ``g = clamp(gate, max=L)``, in transformers' op order. Elementwise, so a row's bits never depend on its
    batch; torch ops, so CUDA graphs capture it."""
    def activation(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    return activation


def batch_invariant_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) as softmax over (x, 0): within an ulp of torch.sigmoid, and batch-invariant. torch.sigmoid on
    CPU runs the vectorised part of a tensor and its tail through code that rounds differently, so a token's
    value would depend on how many tokens share the tensor; softmax over the last dim runs each row alike.
    NemotronH's router scores and Qwen2-MoE's shared-expert gate."""
    return torch.softmax(torch.stack([logits, torch.zeros_like(logits)], dim=-1), dim=-1)[..., 0]


class SwiGLU:
    """``down(silu(gate(x)) * up(x))`` with gate and up stored as one projection: the shared experts beside routed
    ones (Qwen2-MoE's, GLM-4.5's, Granite 4.0's shared MLP)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, deterministic: bool = False):
        self.gate_up_proj = Linear(gate_up, deterministic=deterministic)  # [2S, H]: gate rows, then up rows
        self.down_proj = Linear(down, deterministic=deterministic)  # [H, S]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class SharedExpert(SwiGLU):
    """Qwen2-MoE's shared expert (module docstring): ``sigmoid(x @ gate.T) * down(silu(gate_proj(x)) * up(x))``."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor, deterministic: bool = False):
        super().__init__(gate_up, down, deterministic)
        self.gate = Linear(gate, deterministic=deterministic)  # [1, H]: one gate logit per token

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = super().__call__(x)
        # transformers: F.sigmoid on the model-dtype logit (computed in float32, rounded once), then the product.
        return out.mul_(batch_invariant_sigmoid(self.gate(x).float()).to(x.dtype))


def take_shared_expert(weights: dict[str, torch.Tensor], prefix: str, moe: MoeArch, hidden_size: int,
                       deterministic: bool = False) -> SwiGLU:
    """The shared expert popped from ``weights`` under ``{prefix}.shared_expert.`` / ``{prefix}.shared_expert_gate``
    (Llama 4's has no gate: a plain SwiGLU)."""
    def pop(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        key = f"{prefix}.{name}.weight"
        if key not in weights:
            raise ValueError(f"MoE weights lack {key!r}")
        check_shape(key, weights[key], shape, "shared_expert_intermediate_size, hidden_size")
        return weights.pop(key)

    S, H = moe.shared_expert_intermediate_size, hidden_size
    gate_up = torch.cat([pop("shared_expert.gate_proj", (S, H)), pop("shared_expert.up_proj", (S, H))])
    if moe.layout == "llama4":
        return SwiGLU(gate_up, pop("shared_expert.down_proj", (H, S)), deterministic)
    return SharedExpert(gate_up, pop("shared_expert.down_proj", (H, S)), pop("shared_expert_gate", (1, H)),
                        deterministic)


class SparseMoe:
    """The MoE MLP of one Qwen3-MoE / Qwen2-MoE / Mixtral layer (module docstring); plain tensors, like DecoderLayer.
    ``shared``: Qwen2-MoE's shared expert, added to the routed output."""

    def __init__(self, moe: MoeArch, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 deterministic: bool = False, backend: str = "auto", shared: SwiGLU | None = None,
                 router_bias: torch.Tensor | None = None,
                 expert_biases: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``router_bias`` [E] and ``expert_biases`` (gate_up [E, 2I], down [E, H]): gpt-oss's."""
        self.moe = moe
        self.router = Linear(router, deterministic=deterministic)  # [E, H]
        self.router_bias = router_bias
        activation = (clamped_swiglu(moe.swiglu_alpha, moe.swiglu_limit) if moe.layout == "gpt_oss"
                      else ops.silu_and_mul)
        up_bias, down_bias = expert_biases or (None, None)
        self.experts = FusedExperts(gate_up, down, activation, deterministic, backend, up_bias, down_bias,
                                    scale_inputs=moe.layout == "llama4")
        self.shared = shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as Qwen3MoeTopKRouter computes them (GraniteMoe's
        GraniteMoeTopKRouter: softmax over the top-k logits)."""
        if self.moe.layout == "granitemoe":
            logits, experts = torch.topk(self.router(x).float(), self.moe.top_k, dim=-1)
            return torch.softmax(logits, dim=-1).to(x.dtype), experts
        if self.moe.layout == "gpt_oss":  # GptOssTopKRouter: biased logits, softmax over the top k in the model dtype
            logits, experts = torch.topk(self.router(x).add_(self.router_bias), self.moe.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), experts
        if self.moe.layout == "llama4":  # Llama4Router: the sigmoid of each top-k logit, in float32, then the dtype
            logits, experts = torch.topk(self.router(x), self.moe.top_k, dim=-1)
            return batch_invariant_sigmoid(logits.float()).to(x.dtype), experts
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.layout == "mixtral" else weights.to(x.dtype)), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        return out if self.shared is None else out.add_(self.shared(x))
