"""DeepSeek-V2 and DeepSeek-V3 (transformers ``DeepseekV2ForCausalLM``: DeepSeek-V2 / V2-Lite / V2.5,
DeepSeek-Coder-V2; ``DeepseekV3ForCausalLM``: DeepSeek-V3 / V3.1 / R1, Kimi K2, Moonlight): Multi-head Latent
Attention (MLA) over a paged cache of latents, and DeepSeek's MoE.

MLA, per token x (the layer's normed input), as transformers computes it:
- q = q_b(rms(q_a(x))) (``q_lora_rank``; V2-Lite: q_proj(x)), per head a no-RoPE part q_n (``qk_nope_head_dim``)
  and a rotated part q_r (``qk_rope_head_dim``);
- [c, k_r] = kv_a_proj_with_mqa(x): the latent c (``kv_lora_rank``) normed by kv_a_layernorm, and one rotated key
  part k_r shared by every head;
- per head h: k_h = [W_k[h] c, k_r], v_h = W_v[h] c, with kv_b_proj = [W_k; W_v] per head; scores
  (q_n . W_k[h] c + q_r . k_r) * scale, scale = (nope + rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2.

Served "absorbed", as vLLM and SGLang decode it: q_n . W_k[h] c = (W_k[h]^T q_n) . c, so each head's query becomes
[W_k[h]^T q_n, q_r] and every head attends to one cached vector per token, [c, k_r] (kv_lora_rank + rope wide: 576
for V2 / V3), as multi-query attention over one KV head. The values are the latents themselves, so the attention
(engine/attention.attend_latent) returns kv_lora_rank dims a head, the attention over c, which W_v[h] then expands
per head: on CUDA a latent kernel of its own (kernels/triton_mla_attention.py: the latent and rotary parts scored
in two dots, one key tile serving as the value tile, heads as a tile's rows), on CPU the paged C kernel over the
plane as K and V. The cache keeps one plane instead of K and V (engine/kv_cache.py): a
token's KV is 576 numbers a layer instead of 128 heads x (192 + 128) keys and values, and a KV transfer or an offload
tier moves those 576.

The per-head products W_k[h]^T q_n and W_v[h] o run as a grouped matmul with one group per head (the MoE's:
batch-invariant in deterministic mode), or, in the fast mode on CUDA, as one batched GEMM (PerHeadLinear). RoPE: V2's rotation is on interleaved pairs (complex multiply), V3's too
unless ``rope_interleave`` is false; the loader reorders those rows of q_b / q_proj and kv_a so the kernels' NeoX
pairs are the checkpoint's (the dot products, all that reads them, are unchanged).

MoE (``first_k_dense_replace`` dense layers first): V3's router is GLM-4.5's (engine/models/glm4_moe.py: sigmoid
scores, correction bias, group-limited top-k, scaled); V2's softmaxes the logits and takes the top k, among the best
``topk_group`` groups by their best expert for ``group_limited_greedy``; both add shared experts. V3's own MTP layer
(``num_nextn_predict_layers``) drafts for ``--spec mtp``: engine/models/deepseek_mtp.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.engine.attention import AttentionMetadata, attend_latent
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.causal_lm import CausalLM, embedding_and_lm_head
from pdcluster.engine.models.glm4_moe import Glm4Moe, glm4_moe_arch
from pdcluster.engine.models.llama import DecoderLayer, LlamaModel, RotaryEmbedding
from pdcluster.engine.models.llama_arch import ModelArch
from pdcluster.engine.models.moe import GroupedLinear, SwiGLU
from pdcluster.engine.models.nemotron_blocks import ATTENTION
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch
from pdcluster.engine.models.rope import _yarn_mscale, partial_rotary_order, rope_from_config
from pdcluster.kernels import ops

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
ARCHITECTURES = (V2, V3)


@dataclass(frozen=True)
class MlaShape:
    q_lora_rank: int  # 0: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool

    @property
    def latent_width(self) -> int:
        """A cached token's width a layer: the latent and the shared rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekArch(ModelArch):
    """ModelArch's cache fields describe the latent cache: one KV "head" of ``mla.latent_width``."""

    mla: MlaShape | None = None
    softmax_router: bool = False  # V2's router (module docstring); V3's: the sigmoid one (group_router)
    attention_scale: float = 1.0
    num_nextn_predict_layers: int = 0  # V3's own MTP layers (engine/models/deepseek_mtp.py)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "DeepseekArch":
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()), str(model_dir))

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config") -> "DeepseekArch":
        name = (cfg.get("architectures") or [V3])[0]
        if name not in ARCHITECTURES:
            raise ValueError(f"{where}: architecture {name!r} is not supported here ({', '.join(ARCHITECTURES)})")
        v3 = name == V3
        get = lambda key, default: default if cfg.get(key) is None else cfg[key]  # noqa: E731
        for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("moe_layer_freq", 1),
                               ("mlp_bias", False)):
            if get(key, supported) != supported:
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (only {supported!r})")
        scoring, method = get("scoring_func", "sigmoid" if v3 else "softmax"), get("topk_method",
                                                                                 "noaux_tc" if v3 else "greedy")
        routers = ({("sigmoid", "noaux_tc")} if v3 else {("softmax", "greedy"), ("softmax", "group_limited_greedy")})
        if (scoring, method) not in routers:
            raise ValueError(f"{where}: scoring_func {scoring!r} with topk_method {method!r} is not supported for "
                             f"{name} (only {', '.join(f'{s}/{m}' for s, m in sorted(routers))})")
        num_layers, num_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        mla = MlaShape(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=get("kv_lora_rank", 512),
                       qk_nope_head_dim=get("qk_nope_head_dim", 128), qk_rope_head_dim=get("qk_rope_head_dim", 64),
                       v_head_dim=get("v_head_dim", 128),
                       rope_interleaved=bool(get("rope_interleave", True)) if v3 else True)
        rope_theta, rope_scaling = rope_from_config(cfg, where)
        scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        if rope_scaling is not None and rope_scaling.rope_type != "default" and rope_scaling.mscale_all_dim:
            scale *= _yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim) ** 2  # transformers' rule
        moe, group_router = None, None
        if cfg.get("n_routed_experts") is not None:
            moe, group_router = glm4_moe_arch(
                {**cfg, "first_k_dense_replace": get("first_k_dense_replace", 3 if v3 else 0),
                 "n_shared_experts": get("n_shared_experts", 1 if v3 else 2),
                 # transformers' V2 router never renormalises (DeepSeek's V2 configs say false); V3's default: true
                 "norm_topk_prob": bool(get("norm_topk_prob", v3)) and v3,
                 "routed_scaling_factor": get("routed_scaling_factor", 2.5 if v3 else 1.0),
                 "n_group": get("n_group", 1) if v3 or method == "group_limited_greedy" else 1,
                 "topk_group": get("topk_group", 1) if v3 or method == "group_limited_greedy" else 1},
                num_layers, where)
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=1, head_dim=mla.latent_width,
            rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            max_position_embeddings=get("max_position_embeddings", 163840 if v3 else 2048),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            moe=moe, group_router=group_router, rope_scaling=rope_scaling, mla=mla,
            softmax_router=not v3, attention_scale=scale,
            num_nextn_predict_layers=int(get("num_nextn_predict_layers", 0)) if v3 else 0,
        )

    @property
    def mtp_layer_types(self) -> str:
        """The own MTP layers' blocks in NemotronH's notation (engine/models/nemotron_blocks.py), which the MTP code
        counts draft layers by: each DeepSeek MTP layer holds one attention (MLA) block."""
        return ATTENTION * self.num_nextn_predict_layers

    @property
    def kv_planes(self) -> int:
        """The cache keeps one plane: each token's latent serves as its key and its value (engine/kv_cache.py)."""
        return 1

    def qk_order(self) -> None:
        return None  # the MLA loader orders its own rows (MlaAttention)


class SoftmaxGroupRouter:
    """DeepSeek-V2's router (transformers' ``DeepseekV2TopkRouter``): (weights float32 [T, k], expert ids [T, k])."""

    def __init__(self, moe: NemotronMoeArch, weight: torch.Tensor, deterministic: bool = False):
        self.moe = moe
        self.proj = Linear(weight.float(), deterministic=deterministic)  # [E, H], float32 as transformers keeps it

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        scores = self.proj(x.float()).softmax(dim=-1)
        if m.topk_group < m.n_group:  # group_limited_greedy: experts outside the best groups score 0
            groups = scores.view(-1, m.n_group, m.num_experts // m.n_group)
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device)
            keep.scatter_(1, groups.amax(dim=-1).topk(m.topk_group, dim=-1, sorted=False).indices, True)
            scores = groups.masked_fill(~keep.unsqueeze(-1), 0.0).view(-1, m.num_experts)
        weights, experts = scores.topk(m.top_k, dim=-1, sorted=False)
        return weights * m.routed_scaling_factor, experts


def take_weight(weights: dict[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    """``{prefix}.{name}`` popped from ``weights`` (freed with the dict once packed), or a one-line ValueError."""
    key = f"{prefix}.{name}"
    if key not in weights:
        raise ValueError(f"DeepSeek weights lack {key}")
    return weights.pop(key)


def _rope_rows_last(rows: torch.Tensor, num_heads: int, nope: int, order: torch.Tensor | None) -> torch.Tensor:
    """A projection's output rows [num_heads * (nope + rope), ...] with each head's rotated rows in the kernels'
    order (``order``: None keeps them)."""
    if order is None:
        return rows
    heads = rows.reshape(num_heads, -1, *rows.shape[1:])
    return torch.cat((heads[:, :nope], heads[:, nope:][:, order]), dim=1).reshape(rows.shape)


class PerHeadLinear:
    """``y[h] = x[h] @ weight[h]^T`` for each head h of x [num_heads, num_tokens, in]: [num_heads, num_tokens, out].
    Every head has the same rows, so in the fast mode on CUDA it is one batched GEMM (cuBLAS: one kernel, where the
    grouped matmul's tile table costs a few small ones a call, twice a layer); otherwise the MoE's grouped matmul
    with one group a head, whose row tiles do not depend on the batch (deterministic mode; the C kernel on CPU)."""

    def __init__(self, weight: torch.Tensor, deterministic: bool, batched: bool | None = None):
        self.batched = (weight.is_cuda and not deterministic) if batched is None else batched
        if self.batched:
            self.weight_t = weight.transpose(1, 2).contiguous()  # [heads, in, out]
        else:
            self.grouped = GroupedLinear(weight, deterministic)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.batched:
            return torch.bmm(x, self.weight_t)
        num_heads, num_tokens = x.shape[:2]
        # Head-major rows: group h is rows h * T .. (h + 1) * T.
        offs = torch.arange(0, (num_heads + 1) * num_tokens, num_tokens, dtype=torch.int64, device=x.device)
        return self.grouped(x.reshape(num_heads * num_tokens, -1), offs).view(num_heads, num_tokens, -1)


class MlaAttention:
    """One layer's MLA (module docstring); plain tensors, like DecoderLayer."""

    def __init__(self, arch: DeepseekArch, weights: dict[str, torch.Tensor], prefix: str, deterministic: bool):
        pop = lambda name: take_weight(weights, prefix, name)  # noqa: E731
        m, num_heads = arch.mla, arch.num_heads
        self.arch, self.mla, self.deterministic = arch, m, deterministic
        det = {"deterministic": deterministic}
        order = partial_rotary_order(m.qk_rope_head_dim, m.qk_rope_head_dim, True) if m.rope_interleaved else None
        nope = m.qk_nope_head_dim
        if m.q_lora_rank:
            self.q_a = Linear(pop("q_a_proj.weight"), **det)
            self.q_a_norm = pop("q_a_layernorm.weight")
            self.q_b = Linear(_rope_rows_last(pop("q_b_proj.weight"), num_heads, nope, order), **det)
        else:
            self.q_a = self.q_a_norm = None
            self.q_b = Linear(_rope_rows_last(pop("q_proj.weight"), num_heads, nope, order), **det)
        kv_a = pop("kv_a_proj_with_mqa.weight")  # [latent + rope, hidden]: the rope rows form one "head"
        self.kv_a = Linear(_rope_rows_last(kv_a, 1, m.kv_lora_rank, order), **det)
        self.kv_a_norm = pop("kv_a_layernorm.weight")
        kv_b = pop("kv_b_proj.weight").view(num_heads, nope + m.v_head_dim, m.kv_lora_rank)
        # q_n [nope] -> W_k[h]^T q_n [latent]: group h's weight [latent, nope]; o [latent] -> W_v[h] o [v].
        self.absorb_k = PerHeadLinear(kv_b[:, :nope].transpose(1, 2).contiguous(), deterministic)
        self.expand_v = PerHeadLinear(kv_b[:, nope:].contiguous(), deterministic)
        self.o_proj = Linear(pop("o_proj.weight"), **det)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, layer_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        m, num_heads, eps = self.mla, self.arch.num_heads, self.arch.rms_norm_eps
        num_tokens, latent, nope = x.shape[0], m.kv_lora_rank, m.qk_nope_head_dim
        q_in = x if self.q_a is None else ops.rms_norm(self.q_a(x), self.q_a_norm, eps)
        q = self.q_b(q_in).view(num_tokens, num_heads, nope + m.qk_rope_head_dim)
        kv = self.kv_a(x)
        # The cached vector [c, k_r] and each head's query [W_k^T q_n, q_r], both rotated in their last dims.
        key = torch.empty(num_tokens, 1, m.latent_width, dtype=x.dtype, device=x.device)
        key[:, 0, :latent] = ops.rms_norm(kv[:, :latent].contiguous(), self.kv_a_norm, eps)
        key[:, 0, latent:] = kv[:, latent:]
        query = torch.empty(num_tokens, num_heads, m.latent_width, dtype=x.dtype, device=x.device)
        query[:, :, latent:] = q[:, :, nope:]
        rope.rotate_(query[:, :, latent:], positions)
        rope.rotate_(key[:, :, latent:], positions)
        query[:, :, :latent] = self.absorb_k(q[:, :, :nope].transpose(0, 1)).transpose(0, 1)
        out = attend_latent(query, key, layer_cache, meta, latent, batch_invariant=self.deterministic)  # V: the c's
        o = self.expand_v(out.transpose(0, 1)).transpose(0, 1)
        return self.o_proj(o.reshape(num_tokens, num_heads * m.v_head_dim))


class DeepseekLayer:
    """One pre-norm block: MLA, then a dense SwiGLU or the MoE; ``forward`` in DecoderLayer's convention."""

    chunked_mlp = True
    window = 0  # no sliding layers (LlamaModel.forward asks)
    _chunked_mlp = DecoderLayer._chunked_mlp

    def __init__(self, arch: DeepseekArch, weights: dict[str, torch.Tensor], prefix: str, deterministic: bool,
                 layer_index: int | None = None, sparse: bool | None = None):
        """``sparse``: an MoE MLP (None: as ``first_k_dense_replace`` places layer ``layer_index``; the MTP layer,
        past the stack, passes it)."""
        pop = lambda name: take_weight(weights, prefix, name)  # noqa: E731
        self.arch = arch
        self.input_norm, self.post_norm = pop("input_layernorm.weight"), pop("post_attention_layernorm.weight")
        self.attention = MlaAttention(arch, weights, f"{prefix}.self_attn", deterministic)
        if sparse is None:
            sparse = arch.moe is not None and arch.moe.sparse_layers[layer_index]
        if sparse:
            router = (SoftmaxGroupRouter(arch.group_router, pop("mlp.gate.weight"), deterministic)
                      if arch.softmax_router else None)
            self.mlp = Glm4Moe(arch.moe, arch.group_router, weights, f"{prefix}.mlp", arch.hidden_size, deterministic,
                               router=router)
        else:
            self.mlp = SwiGLU(torch.cat([pop("mlp.gate_proj.weight"), pop("mlp.up_proj.weight")]),
                              pop("mlp.down_proj.weight"), deterministic)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, layer_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.arch.rms_norm_eps
        if residual is None:
            residual = hidden.clone()
            x = ops.rms_norm(hidden, self.input_norm, eps)
        else:
            x = ops.rms_norm(hidden, self.input_norm, eps, residual=residual)
        attn = self.attention(x, positions, rope, layer_cache, meta)
        return self._chunked_mlp(ops.rms_norm(attn, self.post_norm, eps, residual=residual)), residual


class DeepseekModel(LlamaModel):
    arch_class = DeepseekArch
    TENSOR_PARALLEL_SPLIT = "layers"  # MLA's heads and the experts' rows, as the Llama family's

    def __init__(self, arch: DeepseekArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False):
        embed_tokens, lm_head = embedding_and_lm_head(arch, weights)
        CausalLM.__init__(self, arch, dtype, deterministic, embed_tokens, lm_head)
        self.norm = weights["model.norm.weight"]
        self.layers = [DeepseekLayer(arch, weights, f"model.layers.{i}", deterministic, i)
                       for i in range(arch.num_layers)]
        self.rope = RotaryEmbedding(arch.mla.qk_rope_head_dim, arch.rope_theta, max_positions, dtype,
                                    self.embed_tokens.device, arch.rope_scaling)
        self.sliding_rope = None
        self.scale = arch.attention_scale

    def lora_targets(self) -> None:
        return None  # adapters on MLA's projections are not served

    def lora_output_rows(self, attr: str, offset: int, width: int) -> None:
        return None
