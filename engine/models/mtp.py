"""DeepSeek-style multi-token-prediction (MTP) draft module for a Llama target.

One MTP step at position ``i`` takes the target's final hidden state ``h_i`` (after the final norm: the
vector the lm_head reads) and the embedding of the next token ``t_{i+1}``::

    x   = eh_proj([hnorm(h_i); enorm(embed(t_{i+1}))])      # 2H -> H
    x   = decoder_layer(x, position i)                       # one Llama block, its own KV-cache layer
    g_i = final_norm(x)          (the target's norm)         # predicts t_{i+2} through the target's lm_head

Applied k times in a chain, step j feeding its own ``g`` and its own draft back in. The layer's KV is
layer ``num_target_layers`` of the engine's paged cache (kv_cache.py), in the same blocks as the target's
layers, so it transfers with them (S2). Entry ``i`` depends on ``t_{i+1}``, so it is written once that
token is known: for every position the target computes, in the same step (engine/proposers/mtp.py).

Checkpoints are safetensors with the names of :func:`mtp_param_shapes` (``mtp.eh_proj.weight``,
``mtp.layer.self_attn.q_proj.weight``, ...). ``engine.cache_dir/mtp/<model>-mtp.safetensors`` is used when
``EngineConfig.mtp_checkpoint`` is ""; without it the engine refuses to start (a random head drafts
nothing the target accepts: 0 of 261 drafts on SmolLM2, decoding slower than without speculation), naming
the ways out. ``mtp_checkpoint="random"`` asks for the seeded random head on purpose (tests: correctness
never depends on draft quality, verification is lossless).

A NemotronH that declares MTP layers of its own (``num_nextn_predict_layers``) drafts with those instead when
``mtp_checkpoint`` is "" (engine/models/nemotron_mtp.py; :func:`uses_own_mtp_layers` is the one rule).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.config import ConfigError
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.llama import DecoderLayer, LlamaModel, ModelArch, rms_norm, rope_dense
from pdcluster.engine.models.nemotron_h import HybridArch
from pdcluster.engine.models import deepseek_mtp, eagle, eagle3, nemotron_mtp
from pdcluster.engine.models.deepseek import ARCHITECTURES as DEEPSEEK_ARCHITECTURES
from pdcluster.engine.models.deepseek import DeepseekArch
from pdcluster.engine.models.registry import BUILTIN_MODELS, builtin_config, resolve_model

MTP_DIR = "mtp"
RANDOM_HEAD = "random"  # EngineConfig.mtp_checkpoint value that forces the seeded random head
# Drafts come from the first DRAFT_VOCAB_SIZE token ids only: BPE ids are in merge order, roughly by
# frequency, and on a CPU the full lm_head is most of a draft step's cost (SmolLM2: 28M of its 32M
# multiply-adds). Measured: 5.7% of SmolLM2's greedy tokens on ShareGPT lie past 16384, so at most that
# share of drafts is lost; verification keeps the output exact whatever the drafts. On a GPU drafts cover the whole
# vocabulary (engine/proposers/__init__.py).
DRAFT_VOCAB_SIZE = 16384


class MTPCheckpointError(ValueError):
    """An MTP checkpoint that does not fit the target model (missing tensors, wrong shapes)."""


class MTPHeadMissing(ConfigError):
    """``spec_method="mtp"`` with no trained head to load: refused rather than drafting at random."""


@dataclass(frozen=True)
class MTPSource:
    """What ``--spec mtp`` drafts with: ``kind`` "own" (the checkpoint's own MTP layers: a NemotronH with
    ``num_nextn_predict_layers``, engine/models/nemotron_mtp.py), "file" (a trained head at ``path``), "eagle" or
    "eagle3" (an EAGLE / EAGLE-3 draft's checkpoint at ``path``, engine/models/eagle.py, eagle3.py) or "random" (the
    seeded random head, asked for by name)."""

    kind: str
    path: Path | None = None


def missing_head_message(model_name: str, default: Path, hybrid: bool = False) -> str:
    """One line: what is missing and the ways out (bench/train_mtp.py trains Llama-family heads only)."""
    if hybrid:
        return (f"--spec mtp: {model_name!r} has no MTP layers of its own (config.json num_nextn_predict_layers is "
                f"0) and no trained MTP head was found (looked for {default}); pass --mtp-checkpoint PATH or use "
                "--spec ngram (--mtp-checkpoint random drafts with an untrained head: lossless but slower)")
    return (f"--spec mtp: no trained MTP head for {model_name!r} (looked for {default}) and the model has no MTP "
            f"layers of its own; train one with `python bench/train_mtp.py --model {model_name}` (a few minutes "
            "on a CPU), pass --mtp-checkpoint PATH, or use --spec ngram (--mtp-checkpoint random drafts with an "
            "untrained head: lossless but slower)")


def _own_mtp(arch):
    """The module serving the arch's own MTP layers: DeepSeek's (engine/models/deepseek_mtp.py) or NemotronH's."""
    return deepseek_mtp if isinstance(arch, DeepseekArch) else nemotron_mtp


def latent_attention_refusal(checkpoint: str) -> str:
    """Why our MTP head (a Llama layer, separate K and V planes) cannot draft for a latent-attention model."""
    what = f"with --mtp-checkpoint {checkpoint!r}" if checkpoint else "without MTP layers of its own"
    return (f"--spec mtp {what}: DeepSeek models (latent attention) draft with their own MTP layer only "
            "(num_nextn_predict_layers, no --mtp-checkpoint); use --spec ngram")


def uses_own_mtp_layers(checkpoint: str, arch) -> bool:
    """The one rule (KV-cache layers, proposer, start-up check): with no --mtp-checkpoint, a model that declares
    MTP layers of its own drafts with them."""
    return checkpoint == "" and bool(getattr(arch, "mtp_layer_types", ()))


def declared_arch(model_name: str):
    """The model's HybridArch from its config alone (a built-in's builder config, or a directory's config.json),
    without building or reading weights; None for other architectures or a name that resolves to neither."""
    if model_name in BUILTIN_MODELS:  # a built-in name wins over a same-named folder (registry.resolve_model)
        config = builtin_config(model_name)
    else:
        path = Path(model_name) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else None
    name = (config.get("architectures") or [""])[0] if config is not None else ""
    if name in DEEPSEEK_ARCHITECTURES:
        return DeepseekArch.from_config(config, where=model_name)
    if name != "NemotronHForCausalLM":
        return None
    return HybridArch.from_config(config, where=model_name)


def find_mtp_checkpoint(checkpoint: str, cache_dir: str | os.PathLike, model_name: str, arch=None) -> MTPSource:
    """What the engine will draft with for ``checkpoint``, checked without reading weights, so a server can
    refuse in one line before it starts any worker. ``arch``: the model's (looked up from its config if None)."""
    arch = arch if arch is not None else declared_arch(model_name)
    if isinstance(arch, DeepseekArch) and not uses_own_mtp_layers(checkpoint, arch):
        raise ConfigError(f"--spec mtp: {model_name}: {latent_attention_refusal(checkpoint)}")
    if checkpoint == RANDOM_HEAD:
        return MTPSource("random")
    kind = eagle3.draft_kind(checkpoint) if checkpoint else None  # a directory (or file) of an EAGLE draft
    if kind is not None:
        return MTPSource(kind, Path(checkpoint))
    if checkpoint:
        if not Path(checkpoint).is_file():
            raise MTPHeadMissing(f"mtp_checkpoint (--mtp-checkpoint): {checkpoint!r} does not exist; train one "
                                 "with bench/train_mtp.py")
        return MTPSource("file", Path(checkpoint))
    if uses_own_mtp_layers(checkpoint, arch):
        own = _own_mtp(arch)
        problem = own.own_mtp_problem(arch)
        if problem is not None:
            raise ConfigError(f"--spec mtp: {model_name}: {problem}")
        model_dir = None if model_name in BUILTIN_MODELS else Path(model_name)  # a built-in has them
        if model_dir is not None and not own.own_mtp_weight_names(model_dir, arch):
            raise MTPHeadMissing(f"--spec mtp: {model_dir}/config.json declares num_nextn_predict_layers "
                                 f"{arch.num_nextn_predict_layers} but its weights have no {own.mtp_prefix(arch)}.* tensors "
                                 "(transformers' save_pretrained drops them); pass --mtp-checkpoint PATH or use "
                                 "--spec ngram")
        return MTPSource("own", model_dir)
    default = default_mtp_checkpoint(cache_dir, model_name)
    if not default.is_file():
        raise MTPHeadMissing(missing_head_message(model_name, default, hybrid=isinstance(arch, HybridArch)))
    return MTPSource("file", default)


def mtp_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    p = "mtp.layer."
    return {
        "mtp.enorm.weight": (h,),
        "mtp.hnorm.weight": (h,),
        "mtp.eh_proj.weight": (h, 2 * h),
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }


def random_mtp_weights(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded random head (float32): norms at one, matrices variance-preserving. Drafts from it are
    mostly rejected, which is what the lossless tests want to exercise."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in mtp_param_shapes(arch).items():  # dict order: always the same draws
        if len(shape) == 1:
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return weights


def default_mtp_checkpoint(cache_dir: str | os.PathLike, model_name: str) -> Path:
    return Path(cache_dir) / MTP_DIR / f"{Path(model_name).name}-mtp.safetensors"


def load_mtp_weights(path: str | os.PathLike, arch: ModelArch) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(str(path))
    expected = mtp_param_shapes(arch)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise MTPCheckpointError(f"MTP checkpoint {str(path)!r} lacks {', '.join(missing)}")
    wrong = [f"{n}: {tuple(weights[n].shape)} != {s}" for n, s in expected.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise MTPCheckpointError(
            f"MTP checkpoint {str(path)!r} was trained for another model ({'; '.join(wrong[:3])}); "
            "retrain it with bench/train_mtp.py or set mtp_checkpoint to a matching file"
        )
    return {n: weights[n].float() for n in expected}


def save_mtp_weights(path: str | os.PathLike, weights: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file({n: t.detach().float().contiguous() for n, t in weights.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)  # readers never see a half-written file


def resolve_mtp_weights(checkpoint: str, cache_dir: str | os.PathLike, model_name: str, arch,
                        seed: int) -> tuple[dict[str, torch.Tensor], str]:
    """(weights, where they came from). An explicit path must exist; "" means the model's own MTP layers when it
    declares them (NemotronH ``num_nextn_predict_layers``), else the trained head in the cache (MTPHeadMissing
    without one); "random" asks for the random head seeded with ``seed``."""
    source = find_mtp_checkpoint(checkpoint, cache_dir, model_name, arch)
    if source.kind == "random":
        return random_mtp_weights(arch, seed), f"random(seed={seed})"
    if source.kind == "eagle3":
        return eagle3.load_eagle3_weights(source.path, arch, arch.num_layers), f"{source.path}: an EAGLE-3 draft"
    if source.kind == "eagle":
        return eagle.load_eagle_weights(source.path, arch), f"{source.path}: an EAGLE draft"
    if source.kind == "own":
        model_dir = resolve_model(model_name, cache_dir=cache_dir, progress=False)
        weights = _own_mtp(arch).load_own_mtp_weights(model_dir, arch)
        return weights, f"{model_dir}: its own MTP layers ({len(weights)} tensors)"
    return load_mtp_weights(source.path, arch), str(source.path)


class MTPHead:
    """Inference form: plain tensors, the target's own DecoderLayer code on the paged cache."""

    def __init__(self, target: LlamaModel, weights: dict[str, torch.Tensor], draft_vocab_size: int = DRAFT_VOCAB_SIZE):
        arch = target.arch
        expected = mtp_param_shapes(arch)
        w = {n: weights[n].to(target.device, target.dtype) for n in expected}  # checkpoints load on the host
        self.target = target
        self.eps = arch.rms_norm_eps
        self.enorm = w["mtp.enorm.weight"]
        self.hnorm = w["mtp.hnorm.weight"]
        # The target's mode (engine/linear.py): in deterministic mode every matmul of the head is the
        # batch-invariant GEMM too, so a request's drafts do not depend on the batch it is drafted in.
        det = getattr(target, "deterministic", False)
        self.eh_proj = Linear(w["mtp.eh_proj.weight"], deterministic=det)
        self.layer = DecoderLayer(arch, w, "mtp.layer", det)
        self.draft_lm_head = Linear(target.lm_head[: min(draft_vocab_size, arch.vocab_size)].contiguous(),
                                    deterministic=det)

    #: Draft layers in the paged KV cache.
    num_draft_layers = 1

    def draft_cache(self, kv_cache: torch.Tensor, first_layer: int) -> torch.Tensor:
        """This head's layer of the paged cache (what ``forward`` takes as ``layer_cache``)."""
        return kv_cache[first_layer]

    def fuse(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(next_token_ids, self.target.embed_tokens)
        x = torch.cat([rms_norm(hidden, self.hnorm, self.eps), rms_norm(emb, self.enorm, self.eps)], dim=-1)
        return self.eh_proj(x)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, H] target (or previous MTP step) final hidden at position p
        next_token_ids: torch.Tensor,  # int64 [n]: token at p + 1
        positions: torch.Tensor,  # int64 [n]: p
        layer_cache: torch.Tensor,  # the MTP layer of the paged cache
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the MTP layer's KV at ``meta.slot_mapping`` and returns ``g`` [n, H] (after the final norm)."""
        x = self.layer(self.fuse(hidden, next_token_ids), positions, self.target.rope, layer_cache, meta)
        return rms_norm(x, self.target.norm, self.eps)

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(g)

    def draft_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """Greedy drafts: argmax over the first ``draft_vocab_size`` ids (see DRAFT_VOCAB_SIZE)."""
        return self.draft_lm_head(g).argmax(dim=-1)

    def reference_kv(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor):
        """K (after RoPE) and V [n, Hkv, D] the layer writes for these inputs, without a cache (tests)."""
        x = rms_norm(self.fuse(hidden, next_token_ids), self.layer.input_norm, self.eps)
        _, k, v = self.layer.qkv(x, positions, self.target.rope)
        return k.contiguous(), v.contiguous()


class MTPTrainModule(nn.Module):
    """Training form: the same math as :class:`MTPHead` with dense causal attention over whole
    sequences, trainable parameters, and the target's embedding, final norm, RoPE and lm_head frozen."""

    def __init__(self, target: LlamaModel, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.arch = target.arch
        self.target = target
        self.names = list(mtp_param_shapes(target.arch))
        self.params = nn.ParameterList([nn.Parameter(weights[n].detach().float().clone()) for n in self.names])

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in zip(self.names, self.params)}

    def _w(self, name: str) -> torch.Tensor:
        return self.params[self.names.index(name)]

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, L, H] (target final hidden at positions 0..L-1), next_token_ids [B, L] (tokens at
        1..L) -> g [B, L, H]."""
        a, eps = self.arch, self.arch.rms_norm_eps
        w = self._w
        b, length, _ = hidden.shape
        positions = torch.arange(length)
        emb = F.embedding(next_token_ids, self.target.embed_tokens)
        x = torch.cat([rms_norm(hidden, w("mtp.hnorm.weight"), eps), rms_norm(emb, w("mtp.enorm.weight"), eps)], -1)
        x = F.linear(x, w("mtp.eh_proj.weight"))
        p = "mtp.layer."
        y = rms_norm(x, w(p + "input_layernorm.weight"), eps)
        q = F.linear(y, w(p + "self_attn.q_proj.weight")).view(b, length, a.num_heads, a.head_dim)
        k = F.linear(y, w(p + "self_attn.k_proj.weight")).view(b, length, a.num_kv_heads, a.head_dim)
        v = F.linear(y, w(p + "self_attn.v_proj.weight")).view(b, length, a.num_kv_heads, a.head_dim)
        rope = self.target.rope
        cos, sin = rope.cos[positions].float()[:, None, :], rope.sin[positions].float()[:, None, :]
        q, k = rope_dense(q, cos, sin), rope_dense(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=a.head_dim**-0.5, enable_gqa=True,
        )
        x = x + F.linear(o.transpose(1, 2).reshape(b, length, -1), w(p + "self_attn.o_proj.weight"))
        y = rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        gate, up = F.linear(y, w(p + "mlp.gate_proj.weight")), F.linear(y, w(p + "mlp.up_proj.weight"))
        x = x + F.linear(F.silu(gate) * up, w(p + "mlp.down_proj.weight"))
        return rms_norm(x, self.target.norm.float(), eps)

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(g, self.target.lm_head.float())
