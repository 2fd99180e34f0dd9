"""NemotronH (transformers ``NemotronHForCausalLM``): a hybrid of Mamba2, attention and MLP blocks over
packed (varlen) token batches, with a paged KV cache for the attention layers and a slot-indexed
state pool for the Mamba layers.

The layer pattern (``layers_block_type``, or the legacy ``hybrid_override_pattern`` string) gives each
block one mixer: "M" Mamba2 (engine/models/mamba_mixer.py), "*" attention (no rotary embedding: position
comes from the Mamba layers), "-" MLP (``down(relu(up(x)) ** 2)``), "E" MoE (routed relu2 experts, optionally
in a latent space, plus a shared expert: engine/models/nemotron_moe.py). Every block is
``x = x + mixer(RMSNorm(x))`` (engine/models/nemotron_blocks.py); after the last, ``norm_f`` and the LM head.

Indexing the engine relies on: ``arch.num_layers`` counts the *attention* layers (the KV cache has one
layer per attention block, ``kv_cache[i]`` for the i-th), ``on_layer_done(i)`` runs with that
attention ordinal, and Mamba layer m keeps its state in ``pool.conv[m]`` / ``pool.ssm[m]``.

Weights use transformers' names: ``backbone.`` (what NVIDIA's checkpoints and transformers'
save_pretrained write) or ``model.`` as the prefix. The checkpoint's own MTP layers (``mtp.*``) are not loaded
here: with ``--spec mtp`` the proposer loads them (engine/models/nemotron_mtp.py), on these same blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.models.causal_lm import CausalLM
from pdcluster.engine.models.granite_hybrid import ARCHITECTURE as GRANITE_HYBRID
from pdcluster.engine.models.granite_hybrid import GraniteHybrid, dt_lower_limit, granite_fields, nemotron_names
from pdcluster.engine.models.mamba_mixer import MambaStepPlan
from pdcluster.engine.models.nemotron_blocks import (ATTENTION, GRANITE_MLP, MAMBA, MLP, MOE, TYPE_NAMES,
                                                     TokenChunked, build_blocks, run_blocks)
from pdcluster.engine.models.nemotron_moe import NemotronMoeArch
from pdcluster.engine.mamba_state import MambaStateShape
from pdcluster.engine.models.llama import RotaryEmbedding
# layers_block_type names (and the legacy ones transformers remaps) -> pattern characters.
_BLOCK_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
                "mlp": MLP, "moe": MOE}
# Legacy config keys NemotronHConfig.__post_init__ maps (the legacy name wins when both are present).
_LEGACY_KEYS = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "expand": "mamba_expand",
                "time_step_limit": "mamba_dt_limit", "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}
_MTP_DEFAULT = ["full_attention", "moe"]  # NemotronHConfig's mtp_layers_block_type
_DEFAULTS = {"n_groups": 8, "conv_kernel": 4, "expand": 2, "use_conv_bias": True,
             "chunk_size": 128}


def layer_pattern(cfg: dict, where: str = "config") -> tuple[str, ...]:
    """The per-layer pattern as characters "M", "*", "-", "E" from a NemotronH config dict; ValueError for
    an unknown layer type."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern") is None:
        raise ValueError(f"{where}: NemotronH config has neither layers_block_type nor hybrid_override_pattern")
    return _pattern(types, cfg.get("hybrid_override_pattern"), "layers_block_type", "hybrid_override_pattern",
                    where)


def mtp_layer_pattern(cfg: dict, where: str = "config") -> tuple[str, ...]:
    """The pattern of one MTP step (``mtp_layers_block_type``, or the legacy ``mtp_hybrid_override_pattern``;
    transformers' default attention + moe); () when ``num_nextn_predict_layers`` is 0."""
    if not cfg.get("num_nextn_predict_layers"):
        return ()
    types, pattern = cfg.get("mtp_layers_block_type") or _MTP_DEFAULT, cfg.get("mtp_hybrid_override_pattern")
    if pattern is not None and types == _MTP_DEFAULT:  # transformers: the legacy pattern overrides the default
        types = None
    return _pattern(types, pattern, "mtp_layers_block_type", "mtp_hybrid_override_pattern", where)


def _pattern(types: list | None, pattern: str | None, types_key: str, pattern_key: str,
             where: str) -> tuple[str, ...]:
    if types is None:
        chars = tuple(pattern)
        unknown = sorted(set(chars) - set(_BLOCK_TYPES.values()))
        if unknown:
            raise ValueError(f"{where}: {pattern_key} {pattern!r} has unknown layer characters {unknown} "
                             "(known: M mamba, * attention, - mlp, E moe)")
        return chars
    unknown = sorted({t for t in types if t not in _BLOCK_TYPES})
    if unknown:
        raise ValueError(f"{where}: {types_key} has unknown layer types {unknown} "
                         f"(known: {', '.join(sorted(_BLOCK_TYPES))})")
    return tuple(_BLOCK_TYPES[t] for t in types)


@dataclass(frozen=True)
class HybridArch:
    """A NemotronH config. The first block of fields are those engine code reads from a Llama
    ``ModelArch`` (``num_layers`` = attention layers = KV-cache layers); the rest are NemotronH's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP blocks' width
    num_layers: int  # attention layers (the KV cache's layers)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # layer_norm_epsilon
    rope_theta: float  # NemotronH attention has no RoPE; only our MTP draft head uses this
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layer_types: tuple[str, ...]  # "M", "*", "-", "E" per block
    num_hidden_layers: int  # all blocks
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    # dt is clamped to [dt_min, inf): the config's time_step_limit (default (0, inf), no clamp). Not time_step_min,
    # which sets dt_bias's init range; transformers <= 5.24's NemotronH mixer clamped at it, vLLM never did.
    dt_min: float
    use_conv_bias: bool
    use_bias: bool  # Mamba in_proj / out_proj biases
    mlp_bias: bool
    # The MoE blocks' shape, when the pattern has any. Not named ``moe``: DecoderLayer (llama.py) reads that as
    # Qwen3-MoE's, and the MTP head builds one on a HybridArch.
    routed_experts: NemotronMoeArch | None = None
    # The checkpoint's own MTP layers (engine/models/nemotron_mtp.py): num_nextn_predict_layers steps of this
    # pattern, () without. Their weights (``mtp.*``) are the MTP proposer's, never loaded with the model.
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    # A Granite 4.0 hybrid (engine/models/granite_hybrid.py): its multipliers, MoE and RoPE; None for NemotronH.
    granite: GraniteHybrid | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> "HybridArch":
        model_dir = Path(model_dir)
        return cls.from_config(json.loads((model_dir / "config.json").read_text()), where=str(model_dir))

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config") -> "HybridArch":
        if (cfg.get("architectures") or [None])[0] == GRANITE_HYBRID:
            return cls(**granite_fields(cfg, where))
        def get(key: str):
            legacy = _LEGACY_KEYS.get(key)
            if legacy is not None and legacy in cfg:
                return cfg[legacy]
            return cfg.get(key, _DEFAULTS.get(key))

        for key, expected in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (only {expected!r})")
        layer_types = layer_pattern(cfg, where)
        mtp_types = mtp_layer_pattern(cfg, where)
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Defaults are NemotronHConfig's, so a key a config leaves out means what it means to transformers.
        num_heads = cfg.get("num_attention_heads", 32)
        hidden = cfg.get("hidden_size", 4096)
        num_kv_heads = cfg.get("num_key_value_heads", 8)
        mamba_heads = cfg.get("mamba_num_heads", 128)
        mamba_head_dim = cfg.get("mamba_head_dim", 64)
        n_groups = get("n_groups")
        if mamba_heads % n_groups:
            raise ValueError(f"{where}: mamba_num_heads {mamba_heads} is not a multiple of n_groups {n_groups}")
        return cls(
            vocab_size=cfg.get("vocab_size", 131072),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 21504),
            num_layers=layer_types.count(ATTENTION),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads if num_kv_heads is not None else num_heads,
            head_dim=cfg.get("head_dim", 128) or hidden // num_heads,
            rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),  # transformers reads no other name
            rope_theta=10000.0,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id", 1),
            eos_token_ids=eos_ids,
            layer_types=layer_types,
            num_hidden_layers=len(layer_types),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=mamba_head_dim,
            ssm_state_size=cfg.get("ssm_state_size", 128),
            n_groups=n_groups,
            conv_kernel=get("conv_kernel"),
            chunk_size=get("chunk_size"),
            dt_min=dt_lower_limit(get("time_step_limit"), where),
            use_conv_bias=bool(get("use_conv_bias")),
            use_bias=bool(cfg.get("use_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            routed_experts=NemotronMoeArch.from_config(cfg, where) if MOE in layer_types + mtp_types else None,
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            mtp_layer_types=mtp_types,
        )

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count(MAMBA)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    def mamba_state_shape(self) -> MambaStateShape:
        return MambaStateShape(
            num_mamba_layers=self.num_mamba_layers,
            conv_dim=self.mamba_conv_dim,
            conv_width=self.conv_kernel - 1,
            num_heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            state_size=self.ssm_state_size,
        )


def _canonical_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``backbone.*`` -> ``model.*``; ``mtp.*`` (NemotronH's own MTP layers: the MTP proposer loads them) dropped."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("mtp."):
            continue
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        out[name] = tensor
    return out


def _lm_head(arch: HybridArch, lm_head: torch.Tensor | None, embed_tokens: torch.Tensor) -> torch.Tensor:
    """The checkpoint's lm_head.weight when it has one (transformers' NemotronH never ties, so a
    saved model always has it), shared with the embedding when tied and equal; the embedding
    when tied and absent."""
    if lm_head is None:
        if not arch.tie_word_embeddings:
            raise ValueError("NemotronH weights lack 'lm_head.weight' and tie_word_embeddings is false")
        return embed_tokens
    if arch.tie_word_embeddings and torch.equal(lm_head, embed_tokens):
        return embed_tokens
    return lm_head


class NemotronHModel(CausalLM):
    """The runner, the MTP head and the warmup use it as they use LlamaModel (the CausalLM interface).
    ``deterministic`` also runs Mamba prefill rows token by token (engine/models/mamba_mixer.py)."""

    arch_class = HybridArch
    TENSOR_PARALLEL_SPLIT = "hybrid"  # engine/tensor_parallel/shard_hybrid.py
    takes_prompt_embeds = True  # its forward puts prompt rows given as embeddings in (CausalLM.put_prompt_rows)

    def __init__(self, arch: HybridArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False):
        # Taken out of the dict as they are used: once fused and packed, loaded tensors are freed.
        weights = _canonical_names(nemotron_names(weights) if arch.granite is not None else weights)

        def take(key: str, layer_kind: str | None = None) -> torch.Tensor:
            if key not in weights:
                what = f" (the layer pattern makes it {TYPE_NAMES[layer_kind]!r})" if layer_kind else ""
                raise ValueError(f"NemotronH weights lack {key!r}{what}")
            return weights.pop(key)

        embed_tokens = take("model.embeddings.weight")
        lm_head = _lm_head(arch, weights.pop("lm_head.weight", None), embed_tokens)
        super().__init__(arch, dtype, deterministic, embed_tokens, lm_head)
        self.norm = take("model.norm_f.weight")
        self.layers = build_blocks(arch, arch.layer_types, "model.layers", weights, take, deterministic)
        granite = arch.granite
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, max_positions, dtype, self.embed_tokens.device,
                                    granite.rope_scaling if granite is not None else None)
        self.scale = arch.head_dim**-0.5 if granite is None else granite.attention_multiplier
        # Granite's attention takes RoPE when its config asks; NemotronH's never (the table is the MTP head's).
        self.block_rope = self.rope if granite is not None and granite.rope else None

    @property
    def architecture_name(self) -> str:
        return GRANITE_HYBRID if self.arch.granite is not None else "NemotronHForCausalLM"

    def lora_targets(self) -> list[tuple[int, object, str, tuple[tuple[str, int, int], ...]]] | None:
        """Attention (q/k/v fused, o), MLP (up, down) and Mamba in_proj and out_proj; MoE layers' experts take none. A
        Granite hybrid's adapters name Granite's layers, two blocks each here (``mamba.`` / ``self_attn.``, then
        ``shared_mlp.input_linear`` / ``output_linear``: its shared MLP beside the experts)."""
        a = self.arch
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        per_layer = 2 if a.granite is not None else 1
        targets = []
        for index, block in enumerate(self.layers):
            i = index // per_layer  # the checkpoint's layer (an adapter's)
            if block.kind == ATTENTION:
                targets += [(i, block.mixer, "qkv_proj", (("q_proj", 0, q_size), ("k_proj", q_size, kv_size),
                                                          ("v_proj", q_size + kv_size, kv_size))),
                            (i, block.mixer, "o_proj", (("o_proj", 0, a.hidden_size),))]
            elif block.kind == MLP:
                mlp = block.mixer.mixer  # inside its TokenChunked
                targets += [(i, mlp, "up_proj", (("up_proj", 0, mlp.up_proj.out_features),)),
                            (i, mlp, "down_proj", (("down_proj", 0, a.hidden_size),))]
            elif block.kind == MAMBA:
                targets += [(i, block.mixer, "in_proj", (("in_proj", 0, block.mixer.in_proj.out_features),)),
                            (i, block.mixer, "out_proj", (("out_proj", 0, a.hidden_size),))]
            elif block.kind == GRANITE_MLP:
                shared = block.mixer.mixer.shared  # the shared SwiGLU inside its TokenChunked (and its sum when split)
                targets += [(i, shared, "gate_up_proj", (("input_linear", 0, shared.gate_up_proj.out_features),)),
                            (i, shared, "down_proj", (("output_linear", 0, a.hidden_size),))]
            elif block.kind == MOE and self.is_whole:  # the shared expert, a NemotronH MLP; the routed experts below
                shared = block.mixer.mixer.shared
                targets += [(i, shared, "up_proj", (("shared_experts.up_proj", 0, shared.up_proj.out_features),)),
                            (i, shared, "down_proj", (("shared_experts.down_proj", 0, shared.down_proj.out_features),))]
        return targets

    def lora_expert_targets(self) -> list:
        """A NemotronH MoE layer's routed experts (``mixer.experts.{e}.up_proj`` / ``down_proj``; on the latent width
        where the model has one); a Granite hybrid's experts take none (stored stacked)."""
        from pdcluster.engine.lora.experts import ExpertTarget

        if self.arch.granite is not None or not self.is_whole:
            return []
        return [ExpertTarget(i, block.mixer.mixer.experts, (("up_proj", 0, block.mixer.mixer.experts.up.out_features),),
                             "down_proj", params=("up_proj", "down_proj"))
                for i, block in enumerate(self.layers) if block.kind == MOE]

    @property
    def lora_num_layers(self) -> int:
        return len(self.layers) // (2 if self.arch.granite is not None else 1)

    def run_unchunked(self) -> None:
        for block in self.layers:
            if isinstance(block.mixer, TokenChunked):
                block.mixer.chunked = False

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens] (unused: NemotronH has no positional encoding)
        kv_cache: torch.Tensor,  # [num_attention_layers(+draft), 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]. ``on_layer_done(i)`` runs as soon
        as attention layer i's KV is in the cache (i counts attention layers only)."""
        self.hand_forward_to_ranks(input_ids, positions, meta)  # tensor parallelism: the other ranks' slices
        plan = None
        if meta.mamba is not None and self.arch.num_mamba_layers:
            plan = meta.mamba.plan or MambaStepPlan.build(meta.mamba, input_ids.device,
                                                          recurrent_prefill=self.deterministic)
        hidden = F.embedding(input_ids, self.embed_tokens)
        self.put_prompt_rows(hidden)
        granite = self.arch.granite
        if granite is not None and granite.embedding_multiplier != 1.0:
            hidden.mul_(granite.embedding_multiplier)
        return run_blocks(self.layers, hidden, kv_cache, meta, self.norm, self.arch.rms_norm_eps, plan, on_layer_done,
                          positions, self.block_rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        granite = self.arch.granite
        return logits if granite is None or granite.logits_scaling == 1.0 else logits.div_(granite.logits_scaling)
