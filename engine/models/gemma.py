"""Gemma 2 and Gemma 3 over the Llama path's pieces: ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` (1B, and
text-only checkpoints) and the language model of ``Gemma3ForConditionalGeneration`` (Gemma 3 4B and up; served
for text, its vision tower left unloaded). What Gemma changes:

- RMSNorm scales by (1 + weight), in float32 before the cast (``gemma_rms_norm``; transformers' Gemma3RMSNorm);
- four norms a layer: input, post-attention (on the attention's output, before the residual add),
  pre-feedforward, post-feedforward (on the MLP's output);
- Gemma 3: RMSNorm over each q and k head before RoPE (as Qwen3, with Gemma's norm);
- GeGLU: down(gelu_tanh(gate) * up);
- the embedding is scaled by sqrt(hidden_size) (the scale rounded to the weights' dtype, as transformers);
- attention scale query_pre_attn_scalar ** -0.5;
- sliding layers (``layer_types``; else Gemma 2's every other layer, Gemma 3's all but every
  ``sliding_window_pattern``-th) attend to their last ``sliding_window`` positions; Gemma 3's use a local RoPE
  table (``rope_local_base_freq`` / the "sliding_attention" parameters), its full layers the global one;
- Gemma 2: attention scores soft-capped, softcap * tanh(s / softcap), in the attention kernels;
- final logit soft-capping (cap * tanh(logits / cap)).

Gemma 3's images (``Gemma3ForConditionalGeneration`` with its preprocessor_config.json: engine/multimodal/gemma3.py)
replace their soft tokens' embeddings after the embedding scale, and attend to each other both ways
(engine/multimodal/bidirectional.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata, attend
from pdcluster.engine.models.causal_lm import embedding_and_lm_head
from pdcluster.engine.models.classifier import causal_architecture
from pdcluster.engine.models.llama import DecoderLayer, LlamaModel, ModelArch, RotaryEmbedding
from pdcluster.engine.models.rope import RopeScaling, rope_from_config
from pdcluster.engine.multimodal.bidirectional import ImageSpan, attend_images_both_ways, image_spans

GEMMA2 = ("Gemma2ForCausalLM",)
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config lists only what differs from them.
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
                 "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1}


@dataclass(frozen=True)
class GemmaArch(ModelArch):
    query_pre_attn_scalar: float = 256.0
    local_rope_theta: float = 10000.0
    local_rope_scaling: RopeScaling | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2

    @classmethod
    def from_dir(cls, model_dir: Path) -> "GemmaArch":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        where = str(model_dir)
        arch = causal_architecture((cfg.get("architectures") or ["Gemma3ForCausalLM"])[0])  # a classifier's too
        if arch not in GEMMA2 + GEMMA3:
            raise ValueError(f"{where}: architecture {arch!r} is not supported here ({', '.join(GEMMA2 + GEMMA3)})")
        gemma2 = arch in GEMMA2
        if arch == "Gemma3ForConditionalGeneration":  # Gemma 3 4B and up: its language model, for text
            tie = cfg.get("tie_word_embeddings", True)
            cfg = {**TEXT_DEFAULTS, "tie_word_embeddings": tie, **(cfg.get("text_config") or {})}
        for key, supported in (("use_bidirectional_attention", False), ("attention_bias", False)):
            if cfg.get(key) not in (None, supported):
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (only {supported!r})")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{where}: hidden_activation {cfg['hidden_activation']!r} is not supported "
                             "(only 'gelu_pytorch_tanh')")
        num_layers = cfg["num_hidden_layers"]
        # transformers' rules when the config does not list them: Gemma 2 slides on even layers, Gemma 3 on all but
        # every sliding_window_pattern-th.
        pattern = 2 if gemma2 else cfg.get("sliding_window_pattern", 6)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"{where}: layer_types must name 'sliding_attention' or 'full_attention' for each of "
                             f"the {num_layers} layers")
        if gemma2:  # one RoPE table for every layer
            global_theta, global_scaling = rope_from_config(cfg, where)
            local_theta, local_scaling = global_theta, global_scaling
        else:
            global_theta, global_scaling, local_theta, local_scaling = _ropes(cfg, where)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id", 1)
        window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise ValueError(f"{where}: sliding layers need a sliding_window")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=global_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=cfg.get("bos_token_id", 2),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            qk_norm=not gemma2,
            rope_scaling=global_scaling,
            sliding_window=int(window) if window else None,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            # Gemma2Config's defaults (50 and 30) where a config leaves them out; Gemma 3 has neither.
            final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        )


def _ropes(cfg: dict, where: str) -> tuple[float, RopeScaling | None, float, RopeScaling | None]:
    """(global theta, scaling, local theta, scaling): transformers 5's rope_parameters per layer type, or
    transformers 4's rope_theta + rope_scaling (global) and rope_local_base_freq (local, default RoPE)."""
    params = cfg.get("rope_parameters") or {}
    plain = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if "full_attention" in params or "sliding_attention" in params:
        full = rope_from_config({**plain, "rope_parameters": {"rope_theta": 1_000_000.0,
                                                              **(params.get("full_attention") or {})}}, where)
        local = rope_from_config({**plain, "rope_parameters": {"rope_theta": 10_000.0,
                                                               **(params.get("sliding_attention") or {})}}, where)
    else:
        full = rope_from_config({**plain, "rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                 "rope_scaling": cfg.get("rope_scaling"), "rope_parameters": params or None}, where)
        local = (float(cfg.get("rope_local_base_freq", 10_000.0)), None)
    return (*full, *local)


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) in float32 (``weight_plus_one``, kept float32),
    then cast back. Over the last dim."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)


class GemmaLayer(DecoderLayer):
    chunked_mlp = False  # the MLP is a few torch ops around two Linears: no chunking

    def __init__(self, arch: GemmaArch, weights: dict[str, torch.Tensor], prefix: str, deterministic: bool,
                 layer_index: int):
        super().__init__(arch, weights, prefix, deterministic, layer_index=layer_index)
        plus_one = lambda t: 1.0 + t.float()  # noqa: E731
        self.input_norm, self.post_norm = plus_one(self.input_norm), plus_one(self.post_norm)
        self.pre_ff_norm = plus_one(weights.pop(f"{prefix}.pre_feedforward_layernorm.weight"))
        self.post_ff_norm = plus_one(weights.pop(f"{prefix}.post_feedforward_layernorm.weight"))
        if arch.qk_norm:
            self.q_norm, self.k_norm = plus_one(self.q_norm), plus_one(self.k_norm)
        self.local = arch.sliding_layers[layer_index]
        self.softcap = arch.attn_logit_softcapping or 0.0

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                layer_cache: torch.Tensor, meta: AttentionMetadata,
                image_spans: list[ImageSpan] | None = None) -> torch.Tensor:
        """The residual stream after this block (Gemma norms each sublayer's output before adding it);
        ``image_spans``: the step's Gemma 3 images, whose soft tokens attend to each other both ways."""
        a = self.arch
        eps = a.rms_norm_eps
        x = gemma_rms_norm(hidden, self.input_norm, eps)
        qkv = self._heads(x)
        q, k, v = self._split(qkv)
        if self.q_norm is not None:  # Gemma 3
            q, k = gemma_rms_norm(q, self.q_norm, eps), gemma_rms_norm(k, self.k_norm, eps)
        rope.rotate_(q, positions)
        rope.rotate_(k, positions)
        o = attend(q, k, v, layer_cache, meta, batch_invariant=self.deterministic, window=self.window,
                   softcap=self.softcap)
        if image_spans:
            attend_images_both_ways(q, o, layer_cache, meta.block_tables, image_spans, meta.scale, self.window)
        attn = self.o_proj(o.reshape(-1, self.q_size))
        hidden = hidden + gemma_rms_norm(attn, self.post_norm, eps)
        mlp = self.mlp(gemma_rms_norm(hidden, self.pre_ff_norm, eps))
        return hidden + gemma_rms_norm(mlp, self.post_ff_norm, eps)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaModel(LlamaModel):
    """Loads as the Llama family does (CausalLM.load: a multimodal checkpoint's language model under the text model's
    names, its vision tower and projector dropped, image inputs refused at the API), and splits over tensor-parallel
    ranks as it does: Gemma's extra norms act on whole hidden states (after o_proj's and down_proj's sums) or on one
    head (Gemma 3's q/k norms), its soft-caps on one head's scores or on the whole logits."""

    arch_class = GemmaArch
    TENSOR_PARALLEL_SPLIT = "layers"

    def __init__(self, arch: GemmaArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False):
        embed_tokens, lm_head = embedding_and_lm_head(arch, weights)
        super(LlamaModel, self).__init__(arch, dtype, deterministic, embed_tokens, lm_head)
        self.norm = 1.0 + weights["model.norm.weight"].float()
        self.layers = [GemmaLayer(arch, weights, f"model.layers.{i}", deterministic, i)
                       for i in range(arch.num_layers)]
        if arch.qk_norm and any(layer.q_norm is None or layer.k_norm is None for layer in self.layers):
            raise ValueError("Gemma 3 weights lack self_attn.q_norm.weight / k_norm.weight in some layer")
        device = self.embed_tokens.device
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions, dtype, device, arch.rope_scaling)
        self.local_rope = RotaryEmbedding(arch.head_dim, arch.local_rope_theta, max_positions, dtype, device,
                                          arch.local_rope_scaling)
        self.scale = arch.query_pre_attn_scalar**-0.5
        # transformers multiplies by the scale rounded to the weights' dtype.
        self.embed_scale = torch.tensor(arch.hidden_size**0.5).to(dtype).item()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        self.hand_forward_to_ranks(input_ids, positions, meta)  # tensor parallelism: the other ranks' slices
        hidden = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        self.put_prompt_rows(hidden)  # scaled already, as vLLM's and transformers' Gemma inputs_embeds
        spans = None
        if self.image_rows is not None:  # Gemma 3's images: their rows are not scaled (engine/multimodal/gemma3.py)
            rows, embeds = self.image_rows
            hidden.index_copy_(0, rows, embeds.to(hidden.dtype))
            spans = image_spans(rows, meta.query_start_loc.cpu().numpy(), meta.seq_lens.cpu().numpy())
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, positions, self.local_rope if layer.local else self.rope, kv_cache[i], meta,
                                   spans)
            if on_layer_done is not None:
                on_layer_done(i)
        return gemma_rms_norm(hidden, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

