"""NemotronH's blocks (engine/models/nemotron_h.py): one mixer each, "M" Mamba2 (engine/models/mamba_mixer.py), "*"
attention without rotary embedding, "-" relu2 MLP, "E" MoE (engine/models/nemotron_moe.py), built from
transformers' weight names and run as ``x = x + mixer(RMSNorm(x))``. The model's layers and the checkpoint's own
MTP layers (engine/models/nemotron_mtp.py) are both lists of these blocks.

Granite 4.0 hybrids (GraniteMoeHybrid) are these blocks too: each of their layers is a Mamba or attention block (its
attention with RoPE when the config asks) followed by a "G" block, Granite's sparse MoE (engine/models/moe.py) plus
its shared SwiGLU MLP, and every block's output is multiplied by ``residual_multiplier`` before its residual add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from pdcluster.engine.attention import AttentionMetadata, attend
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.mamba_mixer import Mamba2Mixer, MambaStepPlan
from pdcluster.engine.models.moe import SparseMoe, SwiGLU, take_expert_weights
from pdcluster.engine.models.nemotron_moe import NemotronHMoE
from pdcluster.kernels import ops

if TYPE_CHECKING:
    from pdcluster.engine.models.llama import RotaryEmbedding
    from pdcluster.engine.models.nemotron_h import HybridArch

MAMBA, ATTENTION, MLP, MOE, GRANITE_MLP = "M", "*", "-", "E", "G"
TYPE_NAMES = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe",  # in our error messages
              GRANITE_MLP: "granite moe"}

MLP_CHUNK_TOKENS = 1024


class AttentionMixer:
    """NemotronH attention: fused q/k/v projection, paged attention, o_proj; no rotary embedding."""

    def __init__(self, arch: HybridArch, w: Callable[[str], torch.Tensor], deterministic: bool = False):
        self.arch = arch
        self.qkv_proj = Linear(torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")]),
                               deterministic=deterministic)
        self.o_proj = Linear(w("o_proj.weight"), deterministic=deterministic)
        self.q_size = arch.num_heads * arch.head_dim
        self.deterministic = deterministic

    def qkv(self, x: torch.Tensor, positions: torch.Tensor | None = None,
            rope: RotaryEmbedding | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, D], k and v [n, kv_heads, D] (views of one projection); q and k rotated in place by
        ``rope`` at ``positions`` when given (Granite's; NemotronH's attention has no positional encoding)."""
        a = self.arch
        qkv = self.qkv_proj(x).view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        if rope is not None:
            rope.rotate_(qkv[:, : a.num_heads + a.num_kv_heads], positions)
        return (qkv[:, : a.num_heads], qkv[:, a.num_heads : a.num_heads + a.num_kv_heads],
                qkv[:, a.num_heads + a.num_kv_heads :])

    def __call__(self, x: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                 positions: torch.Tensor | None = None, rope: RotaryEmbedding | None = None) -> torch.Tensor:
        o = attend(*self.qkv(x, positions, rope), layer_cache, meta, batch_invariant=self.deterministic)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLPMixer:
    """``down(relu(up(x)) ** 2)`` (NemotronH's relu2, no gate)."""

    def __init__(self, w: Callable[[str], torch.Tensor], w_opt: Callable[[str], torch.Tensor | None],
                 deterministic: bool = False):
        self.up_proj = Linear(w("up_proj.weight"), deterministic=deterministic)
        self.up_bias = w_opt("up_proj.bias")
        self.down_proj = Linear(w("down_proj.weight"), deterministic=deterministic)
        self.down_bias = w_opt("down_proj.bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.up_bias is not None:
            h = h + self.up_bias
        h = torch.relu(h).square_()
        out = self.down_proj(h)
        return out + self.down_bias if self.down_bias is not None else out


class TokenChunked:
    """A per-token mixer (MLP, MoE) run over a long prefill in chunks of MLP_CHUNK_TOKENS tokens, so its
    intermediate-wide buffers stay small (as llama.py does)."""

    def __init__(self, mixer: Callable[[torch.Tensor], torch.Tensor]):
        self.mixer = mixer
        self.chunked = True  # False: one call over all tokens (LoRA: an adapter's rows index the whole step)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MLP_CHUNK_TOKENS or not self.chunked:
            return self.mixer(x)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], MLP_CHUNK_TOKENS):
            out[start : start + MLP_CHUNK_TOKENS] = self.mixer(x[start : start + MLP_CHUNK_TOKENS])
        return out


class GraniteMlp:
    """A Granite hybrid layer's MLP half: its sparse MoE (None without experts) plus the shared SwiGLU MLP every
    token runs (``shared_mlp.input_linear``: gate rows, then up rows; ``output_linear``), summed as transformers'
    GraniteMoeHybridDecoderLayer adds them (routed + shared)."""

    def __init__(self, moe: SparseMoe | None, w: Callable[[str], torch.Tensor], deterministic: bool = False):
        self.moe = moe
        self.shared = SwiGLU(w("shared_mlp.input_linear.weight"), w("shared_mlp.output_linear.weight"), deterministic)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        return shared if self.moe is None else self.moe(x).add_(shared)


def _granite_mlp(arch: HybridArch, weights: dict[str, torch.Tensor], prefix: str, w: Callable[[str], torch.Tensor],
                 deterministic: bool) -> GraniteMlp:
    moe = None
    if arch.granite.moe is not None:
        gate_up, down = take_expert_weights(weights, f"{prefix}.mixer", arch.granite.moe, arch.hidden_size)
        moe = SparseMoe(arch.granite.moe, w(arch.granite.moe.router_weight), gate_up, down, deterministic)
    return GraniteMlp(moe, w, deterministic)


def _moe_mixer(arch: HybridArch, weights: dict[str, torch.Tensor], prefix: str, w: Callable[[str], torch.Tensor],
               w_opt: Callable[[str], torch.Tensor | None], deterministic: bool) -> NemotronHMoE:
    """Layer ``prefix``'s MoE mixer, its shared expert a NemotronH MLP under ``mixer.shared_experts.``."""
    shared = MLPMixer(lambda name: w(f"shared_experts.{name}"), lambda name: w_opt(f"shared_experts.{name}"),
                      deterministic)
    return NemotronHMoE(arch.routed_experts, arch.hidden_size, w, w_opt, shared, weights, f"{prefix}.mixer",
                        deterministic)


@dataclass
class HybridBlock:
    kind: str  # MAMBA, ATTENTION, MLP, MOE or GRANITE_MLP
    norm: torch.Tensor
    mixer: object
    cache_index: int  # attention ordinal (KV-cache layer) for ATTENTION, Mamba ordinal for MAMBA, else -1
    multiplier: float = 1.0  # Granite's residual_multiplier: the mixer's output times this before the residual add


def build_blocks(arch: HybridArch, layer_types: tuple[str, ...], prefix: str, weights: dict[str, torch.Tensor],
                 take: Callable[[str, str], torch.Tensor], deterministic: bool) -> list[HybridBlock]:
    """Blocks ``{prefix}.{i}`` of ``layer_types`` (the model's layers, or an MTP step's: nemotron_mtp.py), their
    weights popped from ``weights``; ``take(key, kind)`` pops a required one. Attention blocks count from KV-cache
    layer 0 and Mamba blocks from state 0, in order."""
    blocks: list[HybridBlock] = []
    counts = {ATTENTION: 0, MAMBA: 0}
    for i, kind in enumerate(layer_types):
        p = f"{prefix}.{i}"

        def w(name: str, p: str = p, kind: str = kind) -> torch.Tensor:
            return take(f"{p}.mixer.{name}", kind)

        def w_opt(name: str, p: str = p) -> torch.Tensor | None:
            return weights.pop(f"{p}.mixer.{name}", None)

        norm = take(f"{p}.norm.weight", kind)
        if kind == ATTENTION:
            mixer, index = AttentionMixer(arch, w, deterministic), counts[ATTENTION]
        elif kind == MAMBA:
            mixer, index = Mamba2Mixer(arch, w, w_opt, counts[MAMBA], deterministic), counts[MAMBA]
        elif kind == MOE:
            mixer, index = TokenChunked(_moe_mixer(arch, weights, p, w, w_opt, deterministic)), -1
        elif kind == GRANITE_MLP:
            mixer, index = TokenChunked(_granite_mlp(arch, weights, p, w, deterministic)), -1
        else:
            mixer, index = TokenChunked(MLPMixer(w, w_opt, deterministic)), -1
        if kind in counts:
            counts[kind] += 1
        multiplier = arch.granite.residual_multiplier if arch.granite is not None else 1.0
        blocks.append(HybridBlock(kind, norm, mixer, index, multiplier))
    return blocks


def run_blocks(blocks: list[HybridBlock], hidden: torch.Tensor, kv_layers: torch.Tensor, meta: AttentionMetadata,
               final_norm: torch.Tensor, eps: float, plan: MambaStepPlan | None = None,
               on_layer_done: Callable[[int], None] | None = None, positions: torch.Tensor | None = None,
               rope: RotaryEmbedding | None = None) -> torch.Tensor:
    """``x = x + mixer(RMSNorm(x))`` for each block (attention block i on ``kv_layers[i]``, rotated by ``rope`` at
    ``positions`` when given), then ``final_norm`` of the sum: the residual add fused into each norm, as
    transformers' and vLLM's blocks do it."""
    residual = None
    for layer in blocks:
        if residual is None:
            residual = hidden.clone()
            x = ops.rms_norm(hidden, layer.norm, eps)
        else:
            x = ops.rms_norm(hidden, layer.norm, eps, residual=residual)
        if layer.kind == ATTENTION:
            hidden = layer.mixer(x, kv_layers[layer.cache_index], meta, positions, rope)
            if on_layer_done is not None:
                on_layer_done(layer.cache_index)
        elif layer.kind == MAMBA:
            hidden = layer.mixer(x, meta.mamba, plan)
        else:
            hidden = layer.mixer(x)
        if layer.multiplier != 1.0:
            hidden.mul_(layer.multiplier)
    return ops.rms_norm(hidden, final_norm, eps, residual=residual)
