"""Llama-family decoder over packed (varlen) token batches with a paged KV cache (the checkpoint's shape:
engine/models/llama_arch.py).

Weights use Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...); q/k/v and gate/up are
fused at load time so a layer is four matmuls (engine/linear.py: prepacked for the CPU GEMM in bf16).
Around them a layer is four more kernel calls (kernels/ops.py): residual add fused into RMSNorm,
RoPE in place on the q and k heads of the qkv output, paged attention reading the cache directly,
SiLU-and-mul. On CPU those are C kernels; on CUDA, Triton attention and torch for the rest.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata, attend
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.causal_lm import CausalLM, embedding_and_lm_head
from pdcluster.engine.models.glm4_moe import Glm4Moe
from pdcluster.engine.models.llama_arch import ModelArch
from pdcluster.engine.models.moe import SparseMoe, take_expert_biases, take_expert_weights, take_shared_expert
from pdcluster.engine.models.rope import RopeScaling, inv_freq_and_scale
from pdcluster.kernels import ops

__all__ = ["DecoderLayer", "LlamaModel", "ModelArch", "RotaryEmbedding", "rms_norm"]

def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm over the last dim (mean-centred, no bias), in float32 as transformers' CohereLayerNorm;
    ``weight`` [..., D] broadcasts (a per-head q/k norm's is [heads, D]). torch's row means on a CPU reduce each row
    on one thread alike whatever the row count (below 32,768 elements a row), so a row's bits do not depend on its
    batch; on CUDA deterministic mode does not cover this norm yet."""
    x32 = x.float()
    centred = x32 - x32.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's LlamaRMSNorm (normalise in fp32, cast back, then scale) so fp32 runs
    # match it bit for bit where possible.
    if x.is_cuda and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # On a GPU torch's mean may split one row's sum by the batch's shape: the Triton kernel
        # (same op order) reduces each row alone, so the MTP head stays batch-invariant. On a CPU torch's
        # row reduction is per row already; training needs autograd (torch).
        return ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", scaling: RopeScaling | None = None, rotary_dim: int = 0):
        """``scaling``: the checkpoint's RoPE variant (engine/models/rope.py); its attention factor (yarn,
        longrope) multiplies cos and sin, as transformers applies it, so every kernel reading the table gets it.
        ``rotary_dim`` (0: head_dim): partial rotary, the table in the permuted layout the loader gives q and k
        (ModelArch.qk_order): the pairs past the rotated ones get cos 1 and sin 0, which leave them as they are."""
        rotary_dim = rotary_dim or head_dim
        inv_freq, scale = inv_freq_and_scale(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        passed = (head_dim - rotary_dim) // 2
        if passed:
            cos = torch.cat((cos, torch.ones(max_positions, passed)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_positions, passed)), dim=-1)
        # [max_positions, head_dim], HF's rotate_half layout (the torch path below, the MTP head's training).
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype).to(device)
        self.sin = torch.cat((sin, sin), dim=-1).to(dtype).to(device)
        # float32 [max_positions, head_dim]: cos of each frequency, then sin (what ops.rotary reads).
        self.cos_sin = torch.cat((cos, sin), dim=-1).contiguous().to(device)

    def rotate_(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """In place on [num_tokens, num_heads, head_dim] (heads may be a strided view)."""
        ops.rotary(x, positions, self.cos_sin_on(x.device))

    def cos_sin_on(self, device: torch.device) -> torch.Tensor:
        if self.cos_sin.device != device:
            self.cos_sin = self.cos_sin.to(device)
        return self.cos_sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; HF's rotate_half convention.
        return rope_dense(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


def rope_dense(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on a dense [..., head_dim] tensor with ``cos`` / ``sin`` broadcast to it
    (RotaryEmbedding's reference form, the draft heads' training forms)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def permute_qk_rows(rows: torch.Tensor, arch: ModelArch, qk_order: torch.Tensor | None) -> torch.Tensor:
    """A fused q/k/v projection's output rows (weight [out, in], bias [out] or a LoRA B [out, rank]) with each q
    and k head's dimensions in the kernels' partial-rotary layout (ModelArch.qk_order); v's rows as they are."""
    if qk_order is None:
        return rows
    num_qk_rows = (arch.num_heads + arch.num_kv_heads) * arch.head_dim
    qk = rows[:num_qk_rows].reshape(arch.num_heads + arch.num_kv_heads, arch.head_dim, *rows.shape[1:])
    return torch.cat((qk[:, qk_order].reshape(num_qk_rows, *rows.shape[1:]), rows[num_qk_rows:]))


MLP_CHUNK_TOKENS = 1024
# On a GPU the chunks are the size of a whole big prefill step: GEMMs of 1,024 rows leave tensor cores
# idle in their tails, and HBM holds the intermediate buffers.
MLP_CHUNK_TOKENS_CUDA = 16384


class DecoderLayer:
    """One Llama block; holds plain tensors (no nn.Module machinery on the hot path)."""

    # False: the MLP runs over all of a step's tokens at once (LoRA: an adapter's rows index the whole step).
    chunked_mlp = True
    # A q/k norm over all of a token's heads on a model split over ranks (OLMo 2): ``split_norm(heads, weight, eps)``
    # sums the squares over the ranks (engine/tensor_parallel/layers.py SplitWidthNorm). None: computed here.
    split_norm = None

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], prefix: str, deterministic: bool = False,
                 layer_index: int | None = None):
        """``layer_index``: this layer's index in the model, for the MoE layout (None: a dense MLP, as the
        MTP head's layer has). q_norm / k_norm are taken when the weights have them (LlamaModel checks a
        Qwen3 has them all)."""
        # Taken out of the dict: once fused and packed, the loaded tensors are freed layer by layer
        # (peak memory at load ~ one copy of the weights, not three).
        w = lambda name: weights.pop(f"{prefix}.{name}")  # noqa: E731
        self.arch = arch
        layout = getattr(arch, "norm_layout", "pre")  # an MTP layer's HybridArch: pre
        # "pre": input_norm before attention, post_norm before the MLP. "post" (OLMo 2): attn_out_norm after
        # attention, ff_norm after the MLP, none before. "sandwich" (GLM-4): all four.
        self.norm_layout = layout
        if layout == "post":
            self.input_norm = self.post_norm = None
            self.attn_out_norm = w("post_attention_layernorm.weight")
            self.ff_norm = w("post_feedforward_layernorm.weight")
        elif layout == "parallel":  # Cohere: one norm, attention and the MLP both read it
            self.input_norm = w("input_layernorm.weight")
            self.post_norm = self.attn_out_norm = self.ff_norm = None
        else:
            self.input_norm, self.post_norm = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
            sandwich = layout == "sandwich"
            self.attn_out_norm = w("post_self_attn_layernorm.weight") if sandwich else None
            self.ff_norm = w("post_mlp_layernorm.weight") if sandwich else None
        det = {"deterministic": deterministic}  # engine/linear.py: the batch-invariant GEMM (issue 24)
        self.deterministic = deterministic  # ... and the fixed attention tiles (kernels/triton_paged_attention.py)
        fused = getattr(arch, "fused_checkpoint", False)
        fused_gate_up = fused or getattr(arch, "fused_gate_up", False)
        qkv_weight = w("self_attn.qkv_proj.weight") if fused else torch.cat(
            [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
        qk_order = arch.qk_order() if hasattr(arch, "qk_order") else None  # an MTP layer's HybridArch: none
        self.qkv_proj = Linear(permute_qk_rows(qkv_weight, arch, qk_order), **det)
        self.o_proj = Linear(w("self_attn.o_proj.weight"), **det)
        # Biases are added after the matmul (the batch-invariant GEMMs take none); an adapter's update
        # (engine/lora) lands before them, an fp rounding order of no consequence.
        self.qkv_bias = (permute_qk_rows(torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                                    w("self_attn.v_proj.bias")]), arch, qk_order)
                         if getattr(arch, "qkv_bias", False) else None)
        self.o_bias = w("self_attn.o_proj.bias") if getattr(arch, "o_bias", False) else None
        # gpt-oss's attention sinks: float32 for the kernels' softmax (which runs in float32).
        self.sinks = w("self_attn.sinks").float() if getattr(arch, "attention_sinks", False) else None
        self.q_norm = weights.pop(f"{prefix}.self_attn.q_norm.weight", None)
        self.k_norm = weights.pop(f"{prefix}.self_attn.k_norm.weight", None)
        if qk_order is not None and self.q_norm is not None:  # per-head norms ([D] or Cohere's [heads, D]) follow
            self.q_norm, self.k_norm = self.q_norm[..., qk_order], self.k_norm[..., qk_order]
        self.moe = None
        moe = getattr(arch, "moe", None)  # an MTP layer on a hybrid target gets a HybridArch (no .moe)
        sparse = moe is not None and layer_index is not None and moe.sparse_layers[layer_index]
        if sparse and moe.layout == "glm4_moe":
            self.moe = Glm4Moe(moe, arch.group_router, weights, f"{prefix}.mlp", arch.hidden_size, deterministic)
        elif sparse:
            block = f"{prefix}.{moe.block}"
            gate_up, down = take_expert_weights(weights, block, moe, arch.hidden_size)
            shared = (take_shared_expert(weights, block, moe, arch.hidden_size, deterministic)
                      if moe.shared_expert_intermediate_size else None)
            gpt_oss = moe.layout == "gpt_oss"  # biases on the router and the experts
            self.moe = SparseMoe(moe, w(f"{moe.block}.{moe.router_weight}"), gate_up, down, deterministic,
                                 shared=shared, router_bias=w(f"{moe.block}.router.bias") if gpt_oss else None,
                                 expert_biases=take_expert_biases(weights, block, moe, arch.hidden_size)
                                 if gpt_oss else None)
        else:
            self.gate_up_proj = Linear(w("mlp.gate_up_proj.weight") if fused_gate_up else torch.cat(
                [w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), **det)
            self.down_proj = Linear(w("mlp.down_proj.weight"), **det)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        window_of = getattr(arch, "window_of", None)  # an MTP layer on a hybrid target: HybridArch has none
        # Fields a Llama arch has and an MTP layer's HybridArch (a NemotronH target) has not.
        self.residual_multiplier = getattr(arch, "residual_multiplier", 1.0)
        self.query_scale_beta = getattr(arch, "query_scale_beta", 0.0)
        nope_layers = getattr(arch, "nope_layers", ())
        self.rope_on = not (layer_index is not None and nope_layers and nope_layers[layer_index])  # SmolLM3's NoPE
        self.window = window_of(layer_index) if window_of is not None else 0
        # Llama 4: chunked attention, q/k L2-normed after RoPE (RoPE layers), the NoPE layers' query temperature.
        self.chunk = arch.chunk_of(layer_index) if hasattr(arch, "chunk_of") else 0
        self.l2_weight = (torch.ones(arch.head_dim, dtype=qkv_weight.dtype, device=qkv_weight.device)
                          if getattr(arch, "qk_l2_norm", False) and self.rope_on else None)  # RMSNorm with no weight
        temperature = getattr(arch, "query_temperature", None)
        self.query_temperature = temperature if not self.rope_on else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """The qkv matmul's output as [num_tokens, heads, head_dim]: q's heads, then k's, then v's."""
        a = self.arch
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        return qkv.view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)

    def _split(self, qkv: torch.Tensor):
        """q, k, v views of ``_heads``' output."""
        a = self.arch
        num_qk = a.num_heads + a.num_kv_heads
        return qkv[:, : a.num_heads], qkv[:, a.num_heads : num_qk], qkv[:, num_qk:]

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """q, k, v views [num_tokens, heads, head_dim] of one qkv matmul, q and k rotated in place."""
        a = self.arch
        qkv = self._heads(x)
        if self.q_norm is None:
            if self.rope_on:
                rope.rotate_(qkv[:, : a.num_heads + a.num_kv_heads], positions)
            return self._split(qkv)
        # Qwen3: RMSNorm over each head's head_dim (the norm kernel's last dim), OLMo 2 over all of q's (k's) heads
        # at once; then RoPE on the result.
        q = self._head_norm(qkv[:, : a.num_heads], self.q_norm)
        k = self._head_norm(qkv[:, a.num_heads : a.num_heads + a.num_kv_heads], self.k_norm)
        if self.rope_on:
            rope.rotate_(q, positions)
            rope.rotate_(k, positions)
        return q, k, qkv[:, a.num_heads + a.num_kv_heads :]

    def _head_norm(self, heads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] normalised over ``weight``'s width (one head, or all of a token's heads; Cohere:
        a LayerNorm per head with its own weights), as a new contiguous tensor."""
        if self.split_norm is not None:  # all of a token's heads, which tensor parallelism split over ranks
            return self.split_norm(heads, weight, self.arch.rms_norm_eps)
        if self.arch.layer_norm:
            return layer_norm(heads, weight, self.arch.rms_norm_eps).contiguous()
        rows = heads.reshape(-1, weight.shape[0])  # a copy: the heads are a strided view of qkv
        return ops.rms_norm(rows, weight, self.arch.rms_norm_eps).view(heads.shape)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the skip connection carried separately (vLLM's convention): returns
        (this block's output, residual); the next norm adds them. ``residual`` is updated in place."""
        a = self.arch
        if self.norm_layout == "parallel":
            return self._forward_parallel(hidden, residual, positions, rope, layer_cache, meta)
        if self.ff_norm is not None:
            return self._forward_post_norms(hidden, residual, positions, rope, layer_cache, meta)
        if residual is None:
            residual = hidden.clone()
            x = ops.rms_norm(hidden, self.input_norm, a.rms_norm_eps)
        else:
            x = ops.rms_norm(hidden, self.input_norm, a.rms_norm_eps, residual=residual)
        return self._chunked_mlp(self._attention_block(x, residual, positions, rope, layer_cache, meta)), residual

    def fuses_norms(self) -> bool:
        """Whether this block may run as :meth:`forward_normed` (a pre-norm block whose output projections feed the
        residual adds directly: Llama's)."""
        return (type(self) is DecoderLayer and self.norm_layout == "pre" and self.ff_norm is None
                and self.attn_out_norm is None and self.residual_multiplier == 1.0 and self.o_bias is None
                and not getattr(self.arch, "layer_norm", False))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                       layer_cache: torch.Tensor, meta: AttentionMetadata,
                       next_norm: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` cut at the norms instead of the residual adds (LlamaModel.forward, for blocks that
        ``fuses_norms``): from this block's normed input ``x`` to the next block's, ``rms_norm(residual + out,
        next_norm)`` (or the final norm's), ``residual`` updated in place. The same operations in the same order;
        each norm then follows the matmul before it, whose skinny kernel may run it (Linear.then_rms_norm)."""
        x = self._attention_block(x, residual, positions, rope, layer_cache, meta)
        return self._chunked_mlp(x, next_norm=next_norm, residual=residual)

    def _attention_block(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                         rope: RotaryEmbedding, layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A pre-norm block's attention half: from the normed input to the MLP's normed input (``residual`` updated
        in place)."""
        a = self.arch
        if not self.rope_on:  # a NoPE layer: attend writes K and V as they are
            (q, k, v), kv_written = self._split(self._heads(x)), False
        elif self.l2_weight is not None:  # Llama 4: RoPE, then the L2 norm (K is cached normed)
            qkv = self._heads(x)
            rope.rotate_(qkv[:, : a.num_heads + a.num_kv_heads], positions)
            q, k, v = self._split(qkv)
            q, k, kv_written = self._head_norm(q, self.l2_weight), self._head_norm(k, self.l2_weight), False
        elif self.q_norm is None and (qkv := self._rotated_heads(x, positions, rope, layer_cache, meta)) is not None:
            (q, k, v), kv_written = self._split(qkv), True  # rotated and written in the qkv matmul's epilogue
        elif self.q_norm is None:
            qkv = self._heads(x)
            q, k, v = self._split(qkv)
            # On CUDA one kernel rotates q and k and writes K and V into the cache; elsewhere apart.
            kv_written = ops.rotary_write_kv(q, k, v, positions, rope.cos_sin_on(x.device), layer_cache,
                                             meta.slot_mapping)
            if not kv_written:
                rope.rotate_(qkv[:, : a.num_heads + a.num_kv_heads], positions)
        else:
            (q, k, v), kv_written = self.qkv(x, positions, rope), False
        if self.query_scale_beta:  # Ministral 3: after RoPE, on the queries alone (K is cached unscaled)
            q.mul_(self._query_scale(positions, q.dtype))
        if self.query_temperature is not None:  # Llama 4's NoPE layers: in float32, rounded once (transformers')
            attn_scale, floor_scale = self.query_temperature
            temperature = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q.float() * temperature[:, None, None]).to(q.dtype)
        o = attend(q, k, v, layer_cache, meta, batch_invariant=self.deterministic, kv_written=kv_written,
                   window=self.window, sinks=self.sinks, chunk=self.chunk)
        if self.o_bias is None and self.residual_multiplier == 1.0 and isinstance(self.o_proj, Linear):
            # The residual add and the MLP's norm in the output projection's epilogue where its skinny kernel runs.
            x = self.o_proj.then_rms_norm(o.reshape(-1, self.q_size), self.post_norm, a.rms_norm_eps, residual)
            if x is not None:
                return x
        hidden = self._attention_output(o)
        if self.residual_multiplier != 1.0:
            hidden.mul_(self.residual_multiplier)
        return ops.rms_norm(hidden, self.post_norm, a.rms_norm_eps, residual=residual)

    def _rotated_heads(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                       layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """``_heads(x)`` with q and k rotated and K and V in the cache, all in the qkv matmul's skinny kernel
        (Linear.then_rotary_write_kv); None where that kernel does not run, having done nothing."""
        if self.qkv_bias is not None or not isinstance(self.qkv_proj, Linear):
            return None
        a = self.arch
        qkv = self.qkv_proj.then_rotary_write_kv(x, a.num_heads, a.num_kv_heads, positions, rope.cos_sin_on(x.device),
                                                 layer_cache, meta.slot_mapping)
        return None if qkv is None else qkv.view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)

    def _query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, 1, 1]: 1 + beta * ln(1 + floor(position / context)), in float32 and then ``dtype``, as
        transformers' get_llama_4_attn_scale."""
        a = self.arch
        scale = 1 + a.query_scale_beta * torch.log(1 + torch.floor(positions / a.query_scale_context))
        return scale.to(dtype)[:, None, None]

    def _forward_post_norms(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                            rope: RotaryEmbedding, layer_cache: torch.Tensor,
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A block whose sublayer outputs are normed before their residual adds: OLMo 2's ``h = x + n1(attn(x))``,
        ``x' = h + n2(mlp(h))``, GLM-4's with the inputs normed too (``attn(n0(x))``, ``mlp(n(h))``); in forward's
        convention: returns (the MLP's normed output, h), which the next layer (or the final norm) adds."""
        a = self.arch
        x = hidden if residual is None else hidden.add_(residual)
        x_in = x if self.input_norm is None else ops.rms_norm(x, self.input_norm, a.rms_norm_eps)
        q, k, v = self.qkv(x_in, positions, rope)
        o = attend(q, k, v, layer_cache, meta, batch_invariant=self.deterministic, window=self.window,
                   sinks=self.sinks, chunk=self.chunk)
        h = x.add_(ops.rms_norm(self._attention_output(o), self.attn_out_norm, a.rms_norm_eps))
        h_in = h if self.post_norm is None else ops.rms_norm(h, self.post_norm, a.rms_norm_eps)
        return ops.rms_norm(self._chunked_mlp(h_in), self.ff_norm, a.rms_norm_eps), h

    def _forward_parallel(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                          rope: RotaryEmbedding, layer_cache: torch.Tensor,
                          meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Cohere's block, ``x' = (x + attention(n(x))) + mlp(n(x))`` with n its LayerNorm, in forward's convention:
        returns (the MLP's output, x + attention), whose sum the next layer (or the final norm) takes in that order."""
        a = self.arch
        x = hidden if residual is None else hidden.add_(residual)
        h = layer_norm(x, self.input_norm, a.rms_norm_eps)
        o = attend(*self.qkv(h, positions, rope), layer_cache, meta, batch_invariant=self.deterministic,
                   window=self.window, sinks=self.sinks, chunk=self.chunk)
        return self._chunked_mlp(h), x.add_(self._attention_output(o))

    def _attention_output(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj (and its bias) over the attention output [tokens, heads, head_dim]."""
        out = self.o_proj(o.reshape(-1, self.q_size))
        if self.o_bias is not None:
            out += self.o_bias
        return out

    def _chunked_mlp(self, x: torch.Tensor, next_norm: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP (``next_norm``: then ``rms_norm(residual + out, next_norm)``, as :meth:`mlp`)."""
        chunk = MLP_CHUNK_TOKENS_CUDA if x.is_cuda else MLP_CHUNK_TOKENS
        if x.shape[0] <= chunk or not self.chunked_mlp:
            # DeepseekLayer borrows this method with an MLP module of its own, called with x alone.
            return self.mlp(x) if next_norm is None else self.mlp(x, next_norm, residual)
        if next_norm is not None:
            return ops.rms_norm(self._chunked_mlp(x), next_norm, self.arch.rms_norm_eps, residual=residual)
        # A long prefill runs the MLP in token chunks: its 2 x intermediate-wide buffers stay small
        # enough to be reused from the heap (engine/memory.py) and warm in cache.
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], chunk):
            out[start : start + chunk] = self.mlp(x[start : start + chunk])
        return out

    def mlp(self, x: torch.Tensor, next_norm: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output; with ``next_norm`` (forward_normed) ``rms_norm(residual + out, next_norm)``, ``residual``
        updated in place: in the down projection's epilogue where its skinny kernel runs."""
        eps = self.arch.rms_norm_eps if next_norm is not None else 0.0
        fuse_norm = next_norm is not None and self.residual_multiplier == 1.0
        if self.moe is not None:
            out = self.moe(x)
        elif isinstance(self.down_proj, Linear):  # one kernel for the activation and a matmul where that was faster
            gated = self.gate_up_proj.silu_and_mul_after(x) if isinstance(self.gate_up_proj, Linear) else None
            if gated is not None:  # in the gate/up projection's epilogue (5 to 128 rows)
                normed = self.down_proj.then_rms_norm(gated, next_norm, eps, residual) if fuse_norm else None
                out = self.down_proj(gated) if normed is None else None
            else:  # or as the down projection reads it (1 to 4 rows), else apart
                gate_up = self.gate_up_proj(x)
                normed = (self.down_proj.then_rms_norm(gate_up, next_norm, eps, residual, silu_and_mul=True)
                          if fuse_norm else None)
                out = self.down_proj.after_silu_and_mul(gate_up) if normed is None else None
            if normed is not None:
                return normed
        else:  # an adapter's projection (engine/lora)
            out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        if self.residual_multiplier != 1.0:
            out.mul_(self.residual_multiplier)
        return out if next_norm is None else ops.rms_norm(out, next_norm, eps, residual=residual)

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The block as a plain function of its input (the MTP head runs it this way)."""
        out, residual = self.forward(hidden, None, positions, rope, layer_cache, meta)
        return residual.add_(out)


class LlamaModel(CausalLM):
    arch_class = ModelArch
    # How tensor parallelism cuts it (engine/tensor_parallel/shard.py), read from each class itself, not inherited: a
    # subclass that computes across heads splits only where it says so.
    TENSOR_PARALLEL_SPLIT = "layers"
    # Whether pipeline parallelism cuts it into stages (engine/pipeline_parallel.py), read from the class itself: a
    # subclass whose forward differs (Gemma's, DeepSeek's) is not cut unless it says so.
    PIPELINE_PARALLEL = True
    takes_prompt_embeds = True  # its forward puts prompt rows given as embeddings in (CausalLM.put_prompt_rows)

    # A pipeline-parallel stage's model (engine/pipeline_parallel.py): its Stage (which layers it holds) and the group
    # its hidden states go through. None: every layer is here.
    pp_stage = None
    pp_group = None

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False, layers: range | None = None):
        """``layers``: the layers this model holds (a pipeline stage's; None: all), each built with its own index."""
        if arch.moe is not None and arch.moe.layout == "llama4":  # its checkpoints' name for the MLP
            weights = {name.replace(".feed_forward.", ".mlp."): t for name, t in weights.items()}
        embed_tokens, lm_head = embedding_and_lm_head(arch, weights)
        super().__init__(arch, dtype, deterministic, embed_tokens, lm_head)
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer(arch, weights, f"model.layers.{i}", deterministic, layer_index=i)
                       for i in (range(arch.num_layers) if layers is None else layers)]
        if arch.qk_norm and any(layer.q_norm is None or layer.k_norm is None for layer in self.layers):
            raise ValueError("weights lack self_attn.q_norm.weight / k_norm.weight in some layer (the config asks for "
                             "q/k norms in every layer)")
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions, dtype, self.embed_tokens.device,
                                    arch.rope_scaling, arch.rotary_dim)
        # OLMo 3: the sliding layers' own table (None: every layer reads self.rope).
        self.sliding_rope = None
        if arch.sliding_rope is not None:
            theta, scaling = arch.sliding_rope
            self.sliding_rope = RotaryEmbedding(arch.head_dim, theta, max_positions, dtype, self.embed_tokens.device,
                                                scaling, arch.rotary_dim)
        self.scale = arch.head_dim**-0.5 if arch.attention_multiplier is None else arch.attention_multiplier

    def lora_targets(self) -> list[tuple[int, object, str, tuple[tuple[str, int, int], ...]]]:
        a = self.arch
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # A fused checkpoint's adapters name the fused modules (peft adapts the Linear the model has).
        qkv = ((("qkv_proj", 0, q_size + 2 * kv_size),) if a.fused_checkpoint else
               (("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)))
        gate_up = ((("gate_up_proj", 0, 2 * a.intermediate_size),) if a.fused_checkpoint or a.fused_gate_up else
                   (("gate_proj", 0, a.intermediate_size), ("up_proj", a.intermediate_size, a.intermediate_size)))
        targets = []
        for i, layer in enumerate(self.layers):
            targets += [(i, layer, "qkv_proj", qkv), (i, layer, "o_proj", (("o_proj", 0, a.hidden_size),))]
            if layer.moe is None:  # a sparse layer's routed experts: lora_expert_targets
                targets += [(i, layer, "gate_up_proj", gate_up),
                            (i, layer, "down_proj", (("down_proj", 0, a.hidden_size),))]
            elif self.is_whole and a.moe.layout == "qwen2_moe":  # its shared expert: a dense SwiGLU
                width = a.moe.shared_expert_intermediate_size
                targets += [(i, layer.moe.shared, "gate_up_proj", (("shared_expert.gate_proj", 0, width),
                                                                   ("shared_expert.up_proj", width, width))),
                            (i, layer.moe.shared, "down_proj", (("shared_expert.down_proj", 0, a.hidden_size),))]
        return targets

    def lora_expert_targets(self) -> list:
        """Qwen3-MoE's, Qwen2-MoE's and Mixtral's routed experts (per-expert gate/up/down or w1/w3/w2 in PEFT's
        names); gpt-oss's, Llama 4's, Granite MoE's and GLM-4.5's take none."""
        from pdcluster.engine.lora.experts import ExpertTarget
        from pdcluster.engine.models.moe import SparseMoe

        moe = self.arch.moe
        names = {"qwen3": ("gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("w1", "w3", "w2")}.get(moe.layout) if moe is not None else None
        if names is None or not self.is_whole:
            return []
        gate, up, down = names
        width = moe.intermediate_size
        return [ExpertTarget(i, layer.moe.experts, ((gate, 0, width), (up, width, width)), down)
                for i, layer in enumerate(self.layers) if isinstance(layer.moe, SparseMoe)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.arch.logit_scale != 1.0:  # Cohere
            logits.mul_(self.arch.logit_scale)
        return logits if self.arch.logits_scaling == 1.0 else logits.div_(self.arch.logits_scaling)

    def lora_output_rows(self, attr: str, offset: int, width: int) -> torch.Tensor | None:
        order = self.arch.qk_order()
        if attr != "qkv_proj" or order is None:
            return None
        a = self.arch
        rows = permute_qk_rows(torch.arange((a.num_heads + 2 * a.num_kv_heads) * a.head_dim), a, order)
        return rows[offset : offset + width] - offset  # q's and k's rows stay within their slices

    def run_unchunked(self) -> None:
        for layer in self.layers:
            layer.chunked_mlp = False

    #: Layers whose input (the residual stream before them) each forward copies into ``aux_hidden`` (EAGLE-3's
    #: draft reads three, engine/models/eagle3.py); empty: none, and the forward pays nothing for it.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def capture_aux_hidden(self, layers: tuple[int, ...], max_tokens: int) -> None:
        """From now on each forward copies the residual stream before each of ``layers`` into ``aux_hidden``
        [tokens, len(layers) * hidden], in that order (vLLM's and SGLang's aux hidden states). One buffer for the
        engine's life, so CUDA graphs captured later write the same memory as eager steps."""
        if not all(0 < i < self.arch.num_layers for i in layers):
            raise ValueError(f"aux hidden state layers {layers} outside 1..{self.arch.num_layers - 1}")
        self.aux_layers = tuple(layers)
        self.aux_hidden = torch.zeros(max_tokens, len(layers) * self.arch.hidden_size, dtype=self.dtype,
                                      device=self.embed_tokens.device)

    def _store_aux(self, layer_index: int, stream: torch.Tensor) -> None:
        h, n = self.arch.hidden_size, stream.shape[0]
        for j, i in enumerate(self.aux_layers):
            if i == layer_index:
                if n > self.aux_hidden.shape[0]:
                    raise RuntimeError(f"a step of {n} tokens: the aux hidden state buffer holds "
                                       f"{self.aux_hidden.shape[0]}")
                self.aux_hidden[:n, j * h:(j + 1) * h].copy_(stream)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers(+draft), 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]. ``on_layer_done(i)`` runs as soon
        as layer i's KV is in the cache, so a KV connector can start sending it mid-forward."""
        self.hand_forward_to_ranks(input_ids, positions, meta)  # tensor parallelism: the other ranks' slices
        if self.pp_stage is not None:  # pipeline parallelism: this stage's layers between the hand-overs
            from pdcluster.engine.pipeline_parallel import forward_stage

            return forward_stage(self, input_ids, positions, kv_cache, meta, on_layer_done)
        hidden = F.embedding(input_ids, self.embed_tokens)
        self.put_prompt_rows(hidden)
        if self.arch.embedding_multiplier != 1.0:
            hidden.mul_(self.arch.embedding_multiplier)
        deepstack = None
        if self.image_rows is not None:  # image placeholders read the image's embeddings (engine/multimodal/)
            rows, embeds = self.image_rows
            width = hidden.shape[1]
            hidden.index_copy_(0, rows, embeds[:, :width].to(hidden.dtype))
            if embeds.shape[1] > width:  # Qwen3-VL's deepstack rows, one slice a layer from the first
                deepstack = embeds[:, width:].to(hidden.dtype).split(width, dim=1)
        if self._fuses_norms() and deepstack is None:
            return self._forward_normed(hidden, positions, kv_cache, meta, on_layer_done)
        residual = None
        aux = self.aux_layers
        for i, layer in enumerate(self.layers):
            rope = self.sliding_rope if self.sliding_rope is not None and layer.window else self.rope
            if aux and i in aux:
                self._store_aux(i, hidden if residual is None else hidden + residual)
            hidden, residual = layer.forward(hidden, residual, positions, rope, kv_cache[i], meta)
            if deepstack is not None and i < len(deepstack):
                # The layer's output stream (as transformers adds it: stream, then the image's rows) carried on as a
                # first layer's input (no residual).
                hidden = hidden if residual is None else hidden + residual
                hidden.index_add_(0, rows, deepstack[i])
                residual = None
            if on_layer_done is not None:
                on_layer_done(i)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last block's output and residual added and normed: the hidden states the head reads."""
        if self.arch.layer_norm:  # Cohere
            return layer_norm(hidden.add_(residual), self.norm, self.arch.rms_norm_eps)
        return ops.rms_norm(hidden, self.norm, self.arch.rms_norm_eps, residual=residual)

    def _fuses_norms(self) -> bool:
        """Whether every block runs cut at its norms (DecoderLayer.fuses_norms; kept once known: blocks stay)."""
        fuses = self.__dict__.get("_fuses_norms_known")
        if fuses is None:
            fuses = self._fuses_norms_known = bool(self.layers) and all(
                isinstance(layer, DecoderLayer) and layer.fuses_norms() for layer in self.layers)
        return fuses

    def _forward_normed(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, on_layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """forward's loop with each block from its normed input to the next block's (DecoderLayer.forward_normed):
        every norm right after the matmul whose output it adds, so that matmul's kernel may run it."""
        eps = self.arch.rms_norm_eps
        residual = hidden  # the embedding's own buffer: the first norm reads it, the blocks add to it in place
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        aux = self.aux_layers
        for i, layer in enumerate(self.layers):
            rope = self.sliding_rope if self.sliding_rope is not None and layer.window else self.rope
            if aux and i in aux:
                self._store_aux(i, residual)  # the stream before layer i: the blocks add to it in place
            next_norm = self.norm if i == last else self.layers[i + 1].input_norm
            x = layer.forward_normed(x, residual, positions, rope, kv_cache[i], meta, next_norm)
            if on_layer_done is not None:
                on_layer_done(i)
        return x
