"""Llama-family decoder over packed (varlen) token batches with a paged KV cache.

Weights use Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...); q/k/v and gate/up are
fused at load time so a layer is four matmuls (engine/linear.py: prepacked for the CPU GEMM in bf16).
Around them a layer is four more kernel calls (kernels/ops.py): residual add fused into RMSNorm,
RoPE in place on the q and k heads of the qkv output, paged attention reading the cache directly,
SiLU-and-mul. On CPU those are C kernels; on CUDA, Triton attention and torch for the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata, attend
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.causal_lm import CausalLM
from pdcluster.engine.models.glm4_moe import ARCHITECTURE as GLM4_MOE_ARCHITECTURE
from pdcluster.engine.models.glm4_moe import Glm4Moe, glm4_moe_arch
from pdcluster.engine.models.moe import MoeArch, SparseMoe, take_expert_weights, take_shared_expert
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch
from pdcluster.engine.models.rope import (RopeScaling, for_context, inv_freq_and_scale, partial_rotary_order,
                                          rope_from_config, rotary_dim_of)
from pdcluster.kernels import ops

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
# Qwen2 / Qwen2.5: Llama plus biases on q, k and v.
QWEN2 = ("Qwen2ForCausalLM",)
# Phi-3 / Phi-4: Llama with q/k/v and gate/up stored fused in the checkpoint (qkv_proj, gate_up_proj).
PHI3 = ("Phi3ForCausalLM",)
# Mixtral: Mistral with a sparse MoE in every layer (engine/models/moe.py).
MIXTRAL = ("MixtralForCausalLM",)
# Qwen3: Llama plus RMSNorm over each q and k head before RoPE; Qwen3-MoE: and sparse MoE MLPs (engine/models/moe.py).
QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, sparse MoE MLPs with a gated shared expert.
QWEN2_MOE = ("Qwen2MoeForCausalLM",)
# Granite 3.x (IBM): Llama with four multipliers (embedding, attention scale, residual branches, logits);
# GraniteMoe: and a sparse MoE in every layer (engine/models/moe.py).
GRANITE = ("GraniteForCausalLM", "GraniteMoeForCausalLM")
# OLMo 2 / OLMo 3 (AI2): norms after attention and the MLP instead of before, q/k RMSNorm over all heads at once;
# OLMo 3 slides three layers of four, each layer type with its own RoPE table.
OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# SmolLM3: Llama whose every fourth layer (``no_rope_layers``) takes no RoPE.
SMOLLM3 = ("SmolLM3ForCausalLM",)
# OLMoE: Llama with OLMo 2's q/k norms over all heads and Qwen3-MoE's router and experts in every layer.
OLMOE = ("OlmoeForCausalLM",)
# GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): four norms a layer (each sublayer's input and output), half of
# each head rotated in interleaved pairs, q/k/v biases, gate/up stored fused.
GLM4 = ("Glm4ForCausalLM",)
# GLM-4.5 / 4.6: Llama-shaped layers (half of each head rotated NeoX-style), DeepSeek-V3-routed MoE MLPs with shared
# experts after the first dense ones (engine/models/glm4_moe.py).
GLM4_MOE = (GLM4_MOE_ARCHITECTURE,)
# Multimodal checkpoints whose language model is served for text (image content is refused at the API): the
# architecture their text_config is, as transformers builds it.
MULTIMODAL_TEXT = {"Mistral3ForConditionalGeneration": "MistralForCausalLM",  # Mistral Small 3.1 / 3.2, Magistral
                   "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
                   "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                   "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}
SUPPORTED = (LLAMA_FAMILY + MIXTRAL + QWEN2 + PHI3 + QWEN3 + QWEN2_MOE + GRANITE + OLMO + SMOLLM3 + OLMOE + GLM4
             + GLM4_MOE + tuple(MULTIMODAL_TEXT))


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # q_norm / k_norm before RoPE: Qwen3's [head_dim] on each head, OLMo 2's over all heads
    moe: MoeArch | None = None  # Qwen3-MoE, Qwen2-MoE, Mixtral: which layers are sparse, and their experts
    group_router: NemotronMoeArch | None = None  # GLM-4.5: its MoE's DeepSeek-V3 router (engine/models/glm4_moe.py)
    rope_scaling: RopeScaling | None = None  # None: default RoPE (engine/models/rope.py)
    qkv_bias: bool = False  # Qwen2, Qwen2-MoE (its ``qkv_bias``), ``attention_bias`` in Llama / Mistral / Qwen3
    o_bias: bool = False  # ``attention_bias``: o_proj has one too (Qwen2's has not)
    # Sliding-window attention: a token of a sliding layer attends to its last ``sliding_window`` positions
    # (Mistral and Phi-3: every layer; Qwen2 / Qwen3 with use_sliding_window: the layers their layer_types
    # name, ``sliding_layers``; empty = every layer).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    fused_checkpoint: bool = False  # Phi-3: qkv_proj / gate_up_proj in the checkpoint (and adapters name them)
    fused_gate_up: bool = False  # GLM-4: gate_up_proj alone fused in the checkpoint
    # Partial rotary (Phi-4-mini): RoPE rotates this many of a head's dimensions (0: all); engine/models/rope.py
    # says how the loader lays them out for the kernels.
    rotary_dim: int = 0
    # Granite: the embedding times embedding_multiplier, attention scores times attention_multiplier (instead of
    # head_dim ** -0.5; None: that default), each sublayer's output times residual_multiplier before its residual
    # add, the logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Where a layer's norms sit: "pre" (Llama: before each sublayer), "post" (OLMo 2: after each sublayer's output,
    # before its residual add, post_attention_layernorm / post_feedforward_layernorm; its q_norm / k_norm span all of
    # q's / k's heads) or "sandwich" (GLM-4: before and after each sublayer).
    norm_layout: str = "pre"
    rope_interleaved: bool = False  # GLM-4: RoPE pairs (2j, 2j + 1) (ModelArch.qk_order lays them out for the kernels)
    # OLMo 3: the sliding layers' own RoPE (theta, variant) when it differs from the full layers' (None: one table).
    sliding_rope: tuple[float, RopeScaling | None] | None = None
    # SmolLM3: per layer, True where the layer takes no RoPE (empty: every layer takes it).
    nope_layers: tuple[bool, ...] = ()

    def window_of(self, layer_index: int | None) -> int:
        """The attention window of a layer (0: full causal attention). ``None``: a layer outside the stack
        (the MTP head's), which slides when every layer does."""
        if self.sliding_window is None:
            return 0
        if not self.sliding_layers:
            return self.sliding_window
        return self.sliding_window if layer_index is not None and self.sliding_layers[layer_index] else 0

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelArch":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        if arch[0] not in SUPPORTED:
            raise ValueError(f"{model_dir}: architecture {arch[0]!r} is not supported here ({', '.join(SUPPORTED)})")
        if arch[0] in MULTIMODAL_TEXT:
            cfg, arch = _text_config(cfg, arch[0]), [MULTIMODAL_TEXT[arch[0]]]
        rope_theta, rope_scaling, sliding_rope = _ropes(cfg, arch[0], str(model_dir))
        for key, supported in (("mlp_bias", False), ("hidden_act", "silu"), ("clip_qkv", None)):
            if cfg.get(key, supported) != supported:
                raise ValueError(f"{model_dir}: {key} {cfg[key]!r} is not supported (only {supported!r})")
        window, sliding_layers = _sliding_window(cfg, arch[0], str(model_dir))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        glm = arch[0] in GLM4 + GLM4_MOE
        rotary_dim = rotary_dim_of(cfg, head_dim, rope_scaling, str(model_dir), 0.5 if glm else 1.0)
        moe, group_router = (glm4_moe_arch(cfg, cfg["num_hidden_layers"], str(model_dir)) if arch[0] in GLM4_MOE
                             else (_moe(cfg, arch[0], str(model_dir)), None))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch[0] in QWEN3 + OLMO + OLMOE or (arch[0] in GLM4_MOE and bool(cfg.get("use_qk_norm"))),
            moe=moe,
            group_router=group_router,
            rope_scaling=rope_scaling,
            # Qwen2MoeConfig.qkv_bias defaults to True (Qwen1.5-MoE's config.json predates the key).
            qkv_bias=(attention_bias or arch[0] in QWEN2 or (arch[0] in QWEN2_MOE and cfg.get("qkv_bias", True))
                      or (arch[0] in GLM4 and cfg.get("attention_bias", True))),  # Glm4Config's default: True
            o_bias=attention_bias and not glm,  # GLM's o_proj never has one
            sliding_window=window,
            sliding_layers=sliding_layers,
            fused_checkpoint=arch[0] in PHI3,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            **_granite_multipliers(cfg, arch[0]),
            norm_layout="post" if arch[0] in OLMO else "sandwich" if arch[0] in GLM4 else "pre",
            fused_gate_up=arch[0] in GLM4,
            rope_interleaved=arch[0] in GLM4,
            sliding_rope=sliding_rope,
            nope_layers=_nope_layers(cfg, arch[0], str(model_dir)),
        )

    def for_context(self, max_model_len: int) -> "ModelArch":
        """This arch as an engine of ``max_model_len`` serves it (longrope's table: engine/models/rope.py)."""
        return replace(self, rope_scaling=for_context(self.rope_scaling, max_model_len))

    def qk_order(self) -> torch.Tensor | None:
        """With partial rotary, which checkpoint dimension each position of a q or k head holds in the kernels'
        layout (the loader permutes q and k by it); None when RoPE rotates whole heads."""
        if not self.rotary_dim and not self.rope_interleaved:
            return None
        return partial_rotary_order(self.head_dim, self.rotary_dim or self.head_dim, self.rope_interleaved)


def _text_config(cfg: dict, architecture: str) -> dict:
    """A multimodal config's language model: ``text_config`` over the top level (older Qwen2-VL / Qwen2.5-VL configs
    keep the text fields there), its M-RoPE read as the plain RoPE it is for text (every section at one position)."""
    text = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")},
            **(cfg.get("text_config") or {})}
    if "tie_word_embeddings" in cfg:  # the top level's, as transformers ties a multimodal model's head
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    for key in ("rope_scaling", "rope_parameters"):
        params = text.get(key)
        if isinstance(params, dict) and "mrope_section" in params:
            kind = params.get("rope_type") or params.get("type")
            params = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved", "type")}
            text[key] = {**params, "rope_type": "default" if kind in (None, "mrope", "default") else kind}
    return text


def _ropes(cfg: dict, architecture: str, where: str) -> tuple[float, RopeScaling | None, tuple | None]:
    """(theta, variant) of the model's RoPE, and the sliding layers' own when they have another (OLMo 3: transformers
    5 writes ``rope_parameters`` per layer type; an older config's ``rope_scaling`` is the full layers', its sliding
    layers default RoPE at the same theta)."""
    if architecture != "Olmo3ForCausalLM":
        return (*rope_from_config(cfg, where, phi3=architecture in PHI3, partial_ok=architecture in GLM4 + GLM4_MOE),
                None)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        theta = cfg.get("rope_theta") or 500000.0  # Olmo3Config's default_theta
        full, sliding = (rope_from_config({**cfg, "rope_scaling": None, "rope_theta": theta,
                                           "rope_parameters": params.get(kind) or {}}, where)
                         for kind in ("full_attention", "sliding_attention"))
    else:
        full = rope_from_config({**cfg, "rope_theta": cfg.get("rope_theta") or 500000.0}, where)
        sliding = (full[0], None)
    return (*full, None if sliding == full else sliding)


def _nope_layers(cfg: dict, architecture: str, where: str) -> tuple[bool, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` (1: RoPE, 0: none), or one in every
    ``no_rope_layer_interval`` (SmolLM3Config's rule); () for the other architectures."""
    if architecture not in SMOLLM3:
        return ()
    num_layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval") or 4
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"{where}: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(not flag for flag in flags)


def _granite_multipliers(cfg: dict, architecture: str) -> dict:
    """Granite's multipliers as GraniteConfig reads them (its defaults: 1.0, no change)."""
    if architecture not in GRANITE:
        return {}
    get = lambda key: float(cfg.get(key) if cfg.get(key) is not None else 1.0)  # noqa: E731
    return dict(embedding_multiplier=get("embedding_multiplier"), attention_multiplier=get("attention_multiplier"),
                residual_multiplier=get("residual_multiplier"), logits_scaling=get("logits_scaling"))


def _moe(cfg: dict, architecture: str, where: str) -> MoeArch | None:
    """The MoE layout of a sparse architecture (None: dense MLPs)."""
    num_layers = cfg["num_hidden_layers"]
    if architecture == "Qwen3MoeForCausalLM":
        return MoeArch.from_config(cfg, num_layers, where)
    if architecture in QWEN2_MOE:
        return MoeArch.from_config(cfg, num_layers, where, layout="qwen2_moe")
    if architecture == "GraniteMoeForCausalLM":
        return MoeArch.granitemoe(cfg, num_layers, where)
    if architecture in OLMOE:  # Qwen3-MoE's MoE, the experts intermediate_size wide (OlmoeConfig's defaults)
        return MoeArch.from_config({**cfg, "moe_intermediate_size": cfg.get("intermediate_size") or 2048,
                                    "num_experts": cfg.get("num_experts") or 64,
                                    "num_experts_per_tok": cfg.get("num_experts_per_tok") or 8}, num_layers, where)
    return MoeArch.mixtral(cfg, num_layers, where) if architecture in MIXTRAL else None


def _sliding_window(cfg: dict, architecture: str, where: str) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers slide) as transformers reads the config: Mistral's and Phi-3's window is live
    whenever set, on every layer; Qwen2's and Qwen3's only with use_sliding_window, on the layers layer_types
    names "sliding_attention" (or, without layer_types, those from max_window_layers on). Qwen2-MoE's as Qwen2's
    when layer_types is given; without it the layers that slide are ambiguous (below), so that is refused."""
    num_layers = cfg["num_hidden_layers"]
    layer_types = list(cfg.get("layer_types") or [])
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not supported (only 'full_attention', "
                         "'sliding_attention')")
    if layer_types and len(layer_types) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = cfg.get("sliding_window")
    if architecture in ("MistralForCausalLM", *MIXTRAL, *PHI3):
        return (int(window), ()) if window else (None, ())
    if architecture == "Olmo3ForCausalLM":
        if not layer_types:  # Olmo3Config's default: three sliding layers, then a full one
            layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
        if "sliding_attention" not in layer_types:
            return None, ()
        if not window:
            raise ValueError(f"{where}: layer_types name sliding layers but sliding_window is not set")
        return int(window), tuple(t == "sliding_attention" for t in layer_types)
    if architecture in SMOLLM3 and cfg.get("use_sliding_window") and window and not layer_types:
        # SmolLM3Config's rule: the layers without RoPE slide.
        layer_types = ["sliding_attention" if nope else "full_attention" for nope in _nope_layers(cfg, architecture,
                                                                                                   where)]
    if architecture in QWEN2 + QWEN3 + QWEN2_MOE + SMOLLM3 and cfg.get("use_sliding_window"):
        if not window:
            raise ValueError(f"{where}: use_sliding_window needs a sliding_window")
        if not layer_types and architecture in QWEN2_MOE:
            # Without layer_types transformers 5's Qwen2MoeConfig slides the even layers below max_window_layers,
            # Qwen2's rule the layers from max_window_layers on: which the checkpoint meant is unknown (configs that
            # transformers 5 saves list layer_types; Qwen's own checkpoints have use_sliding_window false).
            raise ValueError(f"{where}: use_sliding_window without layer_types is not supported for Qwen2-MoE "
                             "(transformers' Qwen2-MoE and Qwen2 rules disagree on which layers slide); list them "
                             "in layer_types")
        if not layer_types:
            first = cfg.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return int(window), tuple(t == "sliding_attention" for t in layer_types)
    if "sliding_attention" in layer_types:
        raise ValueError(f"{where}: layer_types name sliding layers but sliding_window is not in use")
    return None, ()


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
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


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
        if layout == "post":
            self.input_norm = self.post_norm = None
            self.attn_out_norm = w("post_attention_layernorm.weight")
            self.ff_norm = w("post_feedforward_layernorm.weight")
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
        self.q_norm = weights.pop(f"{prefix}.self_attn.q_norm.weight", None)
        self.k_norm = weights.pop(f"{prefix}.self_attn.k_norm.weight", None)
        if qk_order is not None and self.q_norm is not None:
            self.q_norm, self.k_norm = self.q_norm[qk_order], self.k_norm[qk_order]
        self.moe = None
        moe = getattr(arch, "moe", None)  # an MTP layer on a hybrid target gets a HybridArch (no .moe)
        if moe is not None and layer_index is not None and moe.sparse_layers[layer_index] and moe.layout == "glm4_moe":
            self.moe = Glm4Moe(moe, arch.group_router, weights, f"{prefix}.mlp", arch.hidden_size, deterministic)
        elif moe is not None and layer_index is not None and moe.sparse_layers[layer_index]:
            block = f"{prefix}.{moe.block}"
            gate_up, down = take_expert_weights(weights, block, moe, arch.hidden_size)
            shared = (take_shared_expert(weights, block, moe, arch.hidden_size, deterministic)
                      if moe.shared_expert_intermediate_size else None)
            self.moe = SparseMoe(moe, w(f"{moe.block}.{moe.router_weight}"), gate_up, down, deterministic,
                                 shared=shared)
        else:
            self.gate_up_proj = Linear(w("mlp.gate_up_proj.weight") if fused_gate_up else torch.cat(
                [w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), **det)
            self.down_proj = Linear(w("mlp.down_proj.weight"), **det)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        window_of = getattr(arch, "window_of", None)  # an MTP layer on a hybrid target: HybridArch has none
        self.residual_multiplier = getattr(arch, "residual_multiplier", 1.0)
        nope_layers = getattr(arch, "nope_layers", ())
        self.rope_on = not (layer_index is not None and nope_layers and nope_layers[layer_index])  # SmolLM3's NoPE
        self.window = window_of(layer_index) if window_of is not None else 0

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
            rope.rotate_(qkv[:, : a.num_heads + a.num_kv_heads], positions)
            return self._split(qkv)
        # Qwen3: RMSNorm over each head's head_dim (the norm kernel's last dim), OLMo 2 over all of q's (k's) heads
        # at once; then RoPE on the result.
        q = self._head_norm(qkv[:, : a.num_heads], self.q_norm)
        k = self._head_norm(qkv[:, a.num_heads : a.num_heads + a.num_kv_heads], self.k_norm)
        rope.rotate_(q, positions)
        rope.rotate_(k, positions)
        return q, k, qkv[:, a.num_heads + a.num_kv_heads :]

    def _head_norm(self, heads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] normalised over ``weight``'s width (one head, or all of a token's heads), as a
        new contiguous tensor."""
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
        if self.ff_norm is not None:
            return self._forward_post_norms(hidden, residual, positions, rope, layer_cache, meta)
        if residual is None:
            residual = hidden.clone()
            x = ops.rms_norm(hidden, self.input_norm, a.rms_norm_eps)
        else:
            x = ops.rms_norm(hidden, self.input_norm, a.rms_norm_eps, residual=residual)
        if not self.rope_on:  # a NoPE layer: attend writes K and V as they are
            (q, k, v), kv_written = self._split(self._heads(x)), False
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
        o = attend(q, k, v, layer_cache, meta, batch_invariant=self.deterministic, kv_written=kv_written,
                   window=self.window)
        hidden = self.o_proj(o.reshape(-1, self.q_size))
        if self.o_bias is not None:
            hidden += self.o_bias
        if self.residual_multiplier != 1.0:
            hidden.mul_(self.residual_multiplier)
        x = ops.rms_norm(hidden, self.post_norm, a.rms_norm_eps, residual=residual)
        return self._chunked_mlp(x), residual

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
        o = attend(q, k, v, layer_cache, meta, batch_invariant=self.deterministic, window=self.window)
        attn = self.o_proj(o.reshape(-1, self.q_size))
        if self.o_bias is not None:
            attn += self.o_bias
        h = x.add_(ops.rms_norm(attn, self.attn_out_norm, a.rms_norm_eps))
        h_in = h if self.post_norm is None else ops.rms_norm(h, self.post_norm, a.rms_norm_eps)
        return ops.rms_norm(self._chunked_mlp(h_in), self.ff_norm, a.rms_norm_eps), h

    def _chunked_mlp(self, x: torch.Tensor) -> torch.Tensor:
        chunk = MLP_CHUNK_TOKENS_CUDA if x.is_cuda else MLP_CHUNK_TOKENS
        if x.shape[0] <= chunk or not self.chunked_mlp:
            return self.mlp(x)
        # A long prefill runs the MLP in token chunks: its 2 x intermediate-wide buffers stay small
        # enough to be reused from the heap (engine/memory.py) and warm in cache.
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], chunk):
            out[start : start + chunk] = self.mlp(x[start : start + chunk])
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.moe(x) if self.moe is not None else self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        if self.residual_multiplier != 1.0:
            out.mul_(self.residual_multiplier)
        return out

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

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False):
        embed_tokens = weights["model.embed_tokens.weight"]
        lm_head = embed_tokens if arch.tie_word_embeddings else weights["lm_head.weight"]
        super().__init__(arch, dtype, deterministic, embed_tokens, lm_head)
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer(arch, weights, f"model.layers.{i}", deterministic, layer_index=i)
                       for i in range(arch.num_layers)]
        if arch.qk_norm and any(layer.q_norm is None or layer.k_norm is None for layer in self.layers):
            raise ValueError("weights lack self_attn.q_norm.weight / k_norm.weight in some layer (Qwen3 and OLMo 2 have "
                             "them in every layer)")
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions, dtype, self.embed_tokens.device,
                                    arch.rope_scaling, arch.rotary_dim)
        # OLMo 3: the sliding layers' own table (None: every layer reads self.rope).
        self.sliding_rope = None if arch.sliding_rope is None else RotaryEmbedding(
            arch.head_dim, *arch.sliding_rope[:1], max_positions, dtype, self.embed_tokens.device, arch.sliding_rope[1],
            arch.rotary_dim)
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
            if layer.moe is None:  # a sparse layer's experts (and Qwen2-MoE's shared expert) take no adapters
                targets += [(i, layer, "gate_up_proj", gate_up),
                            (i, layer, "down_proj", (("down_proj", 0, a.hidden_size),))]
        return targets

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
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
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.arch.embedding_multiplier != 1.0:
            hidden.mul_(self.arch.embedding_multiplier)
        residual = None
        for i, layer in enumerate(self.layers):
            rope = self.sliding_rope if self.sliding_rope is not None and layer.window else self.rope
            hidden, residual = layer.forward(hidden, residual, positions, rope, kv_cache[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return ops.rms_norm(hidden, self.norm, self.arch.rms_norm_eps, residual=residual)
