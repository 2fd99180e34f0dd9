"""What a Llama-family checkpoint's config.json says about its shape, read as transformers reads it: ``ModelArch``,
one frozen dataclass per model (hashable: workers compare it), and the per-family rules that fill it (RoPE variants and
tables, sliding layers, MoE layouts, norm placement, multipliers, multimodal checkpoints served for text). The forward
that runs it is engine/models/llama.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdcluster.engine.models.classifier import causal_architecture
from pdcluster.engine.models.glm4_moe import ARCHITECTURE as GLM4_MOE_ARCHITECTURE
from pdcluster.engine.models.glm4_moe import glm4_moe_arch
from pdcluster.engine.models.moe import MoeArch
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch
from pdcluster.engine.models.rope import (RopeScaling, for_context, partial_rotary_order, rope_from_config,
                                          rotary_dim_of)

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
                   "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
                   # Qwen3-VL-30B-A3B / 235B-A22B: Qwen3-MoE text, its experts fused (engine/models/moe.py)
                   "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
                   "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
                   # LLaVA 1.5 and its kind (a CLIP or SigLIP tower, an MLP projector): images too, engine/multimodal/
                   "LlavaForConditionalGeneration": "LlamaForCausalLM",
                   "LlavaNextForConditionalGeneration": "LlamaForCausalLM"}  # LLaVA-NeXT (1.6): its tiles too
# Cohere Command R / R+ / Aya, and Cohere2 (Command R7B, Command A): LayerNorm (no bias) instead of RMSNorm, attention
# and the MLP in parallel on one normed input, RoPE in interleaved pairs, the logits times logit_scale; Cohere2 slides
# three layers of four and gives its full layers no RoPE.
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM")
# EXAONE 4.0 (LG): OLMo 2's post-norms with Qwen3's per-head q/k norms; with a sliding window, three sliding layers of
# four (or its sliding_window_pattern) and no RoPE on the full ones.
EXAONE4 = ("Exaone4ForCausalLM",)
# Ministral 3 (3B / 8B / 14B, Dec 2025): Mistral with YaRN and each query scaled by 1 + beta * ln(1 + floor(position /
# original context)) after RoPE (``llama_4_scaling_beta``; 1 within the original context).
MINISTRAL3 = ("Ministral3ForCausalLM",)
# Seed-OSS (ByteDance): Llama with q/k/v biases (attention_bias) and an o_proj bias of its own (attention_out_bias).
SEED_OSS = ("SeedOssForCausalLM",)
# gpt-oss (OpenAI, gpt-oss-20b / -120b): every other layer sliding (128 positions), attention sinks (one learned
# logit per head in each softmax), q/k/v and o biases, YaRN, and a MoE in every layer whose experts have biases and
# a clamped SwiGLU (engine/models/moe.py); its releases' experts are MXFP4 (engine/models/mxfp4.py).
GPT_OSS = ("GptOssForCausalLM",)
# GptOssConfig's RoPE when a config gives none (YaRN over a 4,096-position original context, theta 150,000).
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# Llama 4 (Scout, Maverick; text): three layers of four with RoPE in interleaved pairs, chunked attention (8,192
# positions) and a weightless L2 norm on q and k after RoPE; the fourth without RoPE, full attention, its queries
# scaled up with position (temperature tuning); MoE layers (every one, or every other: interleave_moe_layer_step)
# whose router picks the top k by logit and scales each expert's input by the sigmoid of it, beside a shared expert,
# dense layers intermediate_size_mlp wide (engine/models/moe.py). The multimodal checkpoint's language model too.
LLAMA4 = ("Llama4ForCausalLM",)
SUPPORTED = (LLAMA_FAMILY + MIXTRAL + QWEN2 + PHI3 + QWEN3 + QWEN2_MOE + GRANITE + OLMO + SMOLLM3 + OLMOE + GLM4
             + GLM4_MOE + COHERE + EXAONE4 + MINISTRAL3 + SEED_OSS + GPT_OSS + LLAMA4 + tuple(MULTIMODAL_TEXT))
# Mistral3ForConditionalGeneration's language models by text_config.model_type.
_MISTRAL3_TEXT = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}
# LlavaForConditionalGeneration's language models by text_config.model_type (LlavaConfig's default: llama).
_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TEXT_BY_MODEL_TYPE = {"Mistral3ForConditionalGeneration": ("mistral", _MISTRAL3_TEXT, "Mistral3"),
                       "LlavaForConditionalGeneration": ("llama", _LLAVA_TEXT, "LLaVA"),
                       "LlavaNextForConditionalGeneration": ("llama", _LLAVA_TEXT, "LLaVA-NeXT")}


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
    # q_norm / k_norm before RoPE: Qwen3's (EXAONE 4's, GLM-4.5's) RMSNorm [head_dim] on each head, OLMo 2's over all
    # heads at once, Cohere's LayerNorm [heads, head_dim] per head.
    qk_norm: bool = False
    qk_norm_spans_heads: bool = False  # OLMo 2/3, OLMoE: q_norm [heads * head_dim], k_norm [kv_heads * head_dim]
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
    # Partial rotary (Phi-4-mini, GLM-4): RoPE rotates this many of a head's dimensions (0: all);
    # engine/models/rope.py says how the loader lays them out for the kernels.
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
    # q's / k's heads), "sandwich" (GLM-4: before and after each sublayer) or "parallel" (Cohere: one input norm,
    # attention and the MLP both on it, their outputs added to the residual).
    norm_layout: str = "pre"
    layer_norm: bool = False  # Cohere: LayerNorm (mean-centred, no bias) wherever the others have RMSNorm
    logit_scale: float = 1.0  # Cohere: the logits times this
    rope_interleaved: bool = False  # GLM-4, Cohere: RoPE pairs (2j, 2j + 1) (qk_order lays them out for the kernels)
    # OLMo 3: the sliding layers' own RoPE (theta, variant) when it differs from the full layers' (None: one table).
    sliding_rope: tuple[float, RopeScaling | None] | None = None
    # Per layer, True where the layer takes no RoPE (SmolLM3's, Cohere2's and EXAONE 4's; empty: every layer takes it).
    nope_layers: tuple[bool, ...] = ()
    # Ministral 3: queries times 1 + beta * ln(1 + floor(position / query_scale_context)) after RoPE (beta 0: none).
    query_scale_beta: float = 0.0
    query_scale_context: int = 0
    # gpt-oss: each attention layer's ``self_attn.sinks`` [num_heads], one value-less logit per head in each softmax.
    attention_sinks: bool = False
    # Llama 4: chunked attention on the layers ``chunked_layers`` names (a token sees its own chunk of
    # ``attention_chunk_size`` positions); q and k L2-normed (no weight) after RoPE on RoPE layers; on NoPE layers
    # queries times 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)) (``query_temperature``).
    attention_chunk_size: int = 0
    chunked_layers: tuple[bool, ...] = ()
    qk_l2_norm: bool = False
    query_temperature: tuple[float, float] | None = None  # (attn_scale, floor_scale)

    def chunk_of(self, layer_index: int | None) -> int:
        """The attention chunk of a layer (0: none)."""
        if not self.attention_chunk_size or layer_index is None or not self.chunked_layers[layer_index]:
            return 0
        return self.attention_chunk_size

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
        # A *ForSequenceClassification checkpoint is its family's causal model with a score head
        # (engine/models/classifier.py).
        arch = [causal_architecture(name) for name in cfg.get("architectures") or ["LlamaForCausalLM"]]
        if arch[0] not in SUPPORTED:
            raise ValueError(f"{model_dir}: architecture {arch[0]!r} is not supported here ({', '.join(SUPPORTED)})")
        if arch[0] in MULTIMODAL_TEXT:
            arch = [_text_architecture(cfg, arch[0], str(model_dir))]
            cfg = _text_config(cfg, arch[0])
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
        llama4 = arch[0] in LLAMA4
        attention_bias = bool(cfg.get("attention_bias", arch[0] in GPT_OSS))  # GptOssConfig's default: True
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # Llama 4: the dense layers' width (its intermediate_size is the experts')
            intermediate_size=cfg.get("intermediate_size_mlp") or 16384 if llama4 else cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("layer_norm_eps", 1e-5) if arch[0] in COHERE else cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=(arch[0] in QWEN3 + OLMO + OLMOE + EXAONE4
                     or (arch[0] in GLM4_MOE + COHERE and bool(cfg.get("use_qk_norm")))),
            qk_norm_spans_heads=arch[0] in OLMO + OLMOE,
            moe=moe,
            group_router=group_router,
            rope_scaling=rope_scaling,
            # Qwen2MoeConfig.qkv_bias defaults to True (Qwen1.5-MoE's config.json predates the key).
            qkv_bias=(attention_bias or arch[0] in QWEN2 or (arch[0] in QWEN2_MOE and cfg.get("qkv_bias", True))
                      or (arch[0] in GLM4 and cfg.get("attention_bias", True))),  # Glm4Config's default: True
            # GLM's o_proj never has one; Seed-OSS says apart (attention_out_bias).
            o_bias=bool(cfg.get("attention_out_bias")) if arch[0] in SEED_OSS else attention_bias and not glm,
            sliding_window=window,
            sliding_layers=sliding_layers,
            fused_checkpoint=arch[0] in PHI3,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            **_granite_multipliers(cfg, arch[0]),
            norm_layout=("post" if arch[0] in OLMO + EXAONE4 else "sandwich" if arch[0] in GLM4 else
                         "parallel" if arch[0] in COHERE else "pre"),
            fused_gate_up=arch[0] in GLM4,
            rope_interleaved=arch[0] in GLM4 + COHERE + LLAMA4,
            layer_norm=arch[0] in COHERE,
            logit_scale=float(cfg.get("logit_scale", 0.0625)) if arch[0] in COHERE else 1.0,
            sliding_rope=sliding_rope,
            nope_layers=_nope_layers(cfg, arch[0], str(model_dir)),
            **_query_scaling(cfg, arch[0]),
            attention_sinks=arch[0] in GPT_OSS,
            **(_llama4_attention(cfg, str(model_dir)) if llama4 else {}),
        )

    def for_context(self, max_model_len: int) -> "ModelArch":
        """This arch as an engine of ``max_model_len`` serves it (longrope's table: engine/models/rope.py)."""
        return replace(self, rope_scaling=for_context(self.rope_scaling, max_model_len))

    def qk_order(self) -> torch.Tensor | None:
        """With partial or interleaved rotary, which checkpoint dimension each position of a q or k head holds in the
        kernels' layout (the loader permutes q and k by it); None when RoPE rotates whole heads NeoX-style."""
        if not self.rotary_dim and not self.rope_interleaved:
            return None
        return partial_rotary_order(self.head_dim, self.rotary_dim or self.head_dim, self.rope_interleaved)


def _text_architecture(cfg: dict, architecture: str, where: str) -> str:
    """The architecture a multimodal checkpoint's language model is (Mistral3's and LLaVA's by their text model_type)."""
    if architecture not in _TEXT_BY_MODEL_TYPE:
        return MULTIMODAL_TEXT[architecture]
    default, by_type, family = _TEXT_BY_MODEL_TYPE[architecture]
    model_type = (cfg.get("text_config") or {}).get("model_type", default)
    if model_type not in by_type:
        raise ValueError(f"{where}: a {family} checkpoint whose text model is {model_type!r} is not supported "
                         f"({', '.join(by_type)})")
    return by_type[model_type]


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
    if architecture in GPT_OSS:
        if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            cfg = {**cfg, "rope_parameters": _GPT_OSS_ROPE}
        cfg = {**cfg, "rope_theta": cfg.get("rope_theta") or 150000.0}  # GptOssConfig's default_theta
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


def _llama4_attention(cfg: dict, where: str) -> dict:
    """Llama 4's chunked layers, q/k L2 norm and NoPE-layer temperature as Llama4TextConfig reads them."""
    num_layers, chunk = cfg["num_hidden_layers"], cfg.get("attention_chunk_size", 8192)
    nope = _nope_layers(cfg, "Llama4ForCausalLM", where)
    layer_types = cfg.get("layer_types") or ["chunked_attention" if not no_rope and chunk else "full_attention"
                                             for no_rope in nope]
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "chunked_attention")})
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"{where}: layer_types {layer_types} (Llama 4: one of 'full_attention', "
                         f"'chunked_attention' for each of {num_layers} layers)")
    chunked = tuple(t == "chunked_attention" for t in layer_types)
    if any(chunked) and not chunk:
        raise ValueError(f"{where}: layer_types name chunked layers but attention_chunk_size is not set")
    tuning = cfg.get("attn_temperature_tuning", True)
    return dict(attention_chunk_size=int(chunk or 0) if any(chunked) else 0, chunked_layers=chunked,
                qk_l2_norm=bool(cfg.get("use_qk_norm", True)),
                query_temperature=(float(cfg.get("attn_scale", 0.1)), float(cfg.get("floor_scale", 8192)))
                if tuning else None)


def _query_scaling(cfg: dict, architecture: str) -> dict:
    """Ministral 3's position-dependent query scale (``llama_4_scaling_beta`` beside its RoPE parameters)."""
    if architecture not in MINISTRAL3:
        return {}
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return {}
    context = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
    return dict(query_scale_beta=float(beta), query_scale_context=int(context))


def _every_nth_full_layer_types(cfg: dict) -> list[str]:
    """layer_types, or without them Cohere2Config's and Olmo3Config's rule: every ``sliding_window_pattern``-th (4th)
    layer full, the others sliding."""
    pattern = cfg.get("sliding_window_pattern") or 4
    return list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])])


def _exaone4_layer_types(cfg: dict) -> list[str]:
    """EXAONE 4's layer_types, or without them its sliding_window_pattern: a string of "L" (sliding) and "G" (full)
    repeated from layer 0, or an int n (every n-th layer full), as Exaone4Config reads it; all full without a window."""
    num_layers, pattern = cfg["num_hidden_layers"], cfg.get("sliding_window_pattern") or 4
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if not cfg.get("sliding_window"):
        return ["full_attention"] * num_layers
    if isinstance(pattern, str):
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                for i in range(num_layers)]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _nope_layers(cfg: dict, architecture: str, where: str) -> tuple[bool, ...]:
    """SmolLM3's and Llama 4's layers without RoPE: ``no_rope_layers`` (1: RoPE, 0: none), or one in every
    ``no_rope_layer_interval`` (SmolLM3Config's and Llama4TextConfig's rule); Cohere2's full layers, and EXAONE 4's when it has a window;
    () for the other architectures."""
    if architecture == "Cohere2ForCausalLM":
        return tuple(t == "full_attention" for t in _every_nth_full_layer_types(cfg))
    if architecture in EXAONE4:
        return tuple(bool(cfg.get("sliding_window")) and t == "full_attention" for t in _exaone4_layer_types(cfg))
    if architecture not in SMOLLM3 + LLAMA4:
        return ()
    num_layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if not flags:  # absent (or, as Llama4TextConfig reads it, empty): one layer in every interval without RoPE
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
    if architecture == "Qwen3MoeForCausalLM" and cfg.get("model_type") == "qwen3_vl_moe_text":
        # Qwen3VLMoeTextTopKRouter renormalises its top k always (its config has no norm_topk_prob).
        return replace(MoeArch.from_config(cfg, num_layers, where, layout="qwen3_vl_moe"), norm_topk_prob=True)
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
    if architecture in GPT_OSS:
        return MoeArch.gpt_oss(cfg, num_layers, where)
    if architecture in LLAMA4:
        return MoeArch.llama4(cfg, num_layers, where)
    return MoeArch.mixtral(cfg, num_layers, where) if architecture in MIXTRAL else None


def _sliding_window(cfg: dict, architecture: str, where: str) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers slide) as transformers reads the config: Mistral's and Phi-3's window is live
    whenever set, on every layer; Qwen2's and Qwen3's only with use_sliding_window, on the layers layer_types
    names "sliding_attention" (or, without layer_types, those from max_window_layers on). Qwen2-MoE's as Qwen2's
    when layer_types is given; without it the layers that slide are ambiguous (below), so that is refused."""
    num_layers = cfg["num_hidden_layers"]
    if architecture in LLAMA4:  # no sliding layers: its local layers are chunked (_llama4_attention)
        return None, ()
    layer_types = list(cfg.get("layer_types") or [])
    unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not supported (only 'full_attention', "
                         "'sliding_attention')")
    if layer_types and len(layer_types) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = cfg.get("sliding_window")
    if architecture in ("MistralForCausalLM", *MIXTRAL, *PHI3, *MINISTRAL3):
        return (int(window), ()) if window else (None, ())
    if architecture in EXAONE4:
        layer_types = _exaone4_layer_types(cfg)
        if "sliding_attention" not in layer_types or not window:
            return None, ()
        return int(window), tuple(t == "sliding_attention" for t in layer_types)
    if architecture in ("Olmo3ForCausalLM", "Cohere2ForCausalLM", *GPT_OSS):
        if not layer_types:  # Olmo3Config's and Cohere2Config's default: three sliding layers, then a full one;
            # GptOssConfig's: every other one, from layer 0
            layer_types = (_every_nth_full_layer_types({**cfg, "sliding_window_pattern": 2}) if architecture in GPT_OSS
                           else _every_nth_full_layer_types(cfg))
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
