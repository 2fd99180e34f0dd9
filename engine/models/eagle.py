"""EAGLE draft heads (EAGLE-1, and HASS, its variant with two input norms) for ``--spec mtp``: the checkpoints vLLM
serves as ``method: eagle`` (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B), given as ``--mtp-checkpoint DIR`` (or one
weights file).

One draft step at position ``i`` takes the target's final hidden state ``h_i`` (after its final norm: the vector its
lm_head reads) and the embedding of the next token ``t_{i+1}``::

    x   = fc([embed(t_{i+1}); h_i])            # 2H -> H (HASS: each half RMS-normed first)
    g_i = decoder_layer(x, position i)         # one Llama block WITHOUT its input norm; no final norm
    t   = argmax(lm_head(g_i))                 # the target's lm_head (the draft's own where it ships one)

and the chain feeds ``g`` back as the next step's hidden, as the MTP head does (engine/proposers/mtp.py runs both:
the same inputs, positions and draft KV layer, so the KV transfer, lookahead slots and prefix-cache rule of MTP hold
unchanged). The block is the EAGLE reference's (SafeAILab/EAGLE cnets.py): the first layer has no input norm, and
the output is the block's residual stream. The draft embeds with the target's embedding (EAGLE trains with it
frozen; a copy in the checkpoint is not read).

EAGLE-3 drafts (which read three of the target's layers, not its final hidden state) are engine/models/eagle3.py's.
Refused with a clear message: drafts of more than one layer, and tensors whose shapes do not fit the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.llama import DecoderLayer, LlamaModel, rms_norm, rope_dense

PREFIX = "eagle."
_LAYER = "layers.0."
# In a checkpoint, not read: the target's own embedding (and, as vLLM does, an input norm of the first layer).
_IGNORED = ("embed_tokens.weight", _LAYER + "input_layernorm.weight")


class EagleCheckpointError(ValueError):
    """An EAGLE checkpoint that cannot draft for the target (another kind of draft, wrong shapes)."""


def weight_files(path: Path) -> list[Path]:
    """The weight files of an EAGLE checkpoint at ``path`` (a directory or one file); [] when there are none."""
    if path.is_file():
        return [path] if path.suffix in (".safetensors", ".bin", ".pt") else []
    if not path.is_dir():
        return []
    files = sorted(path.glob("*.safetensors"))
    return files or sorted(path.glob("pytorch_model*.bin"))


def _tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            return list(f.keys())
    try:  # names only: mapped, not read (torch.save's zip format; an older file is read whole)
        return list(torch.load(str(file), map_location="cpu", weights_only=True, mmap=True))
    except RuntimeError:
        return list(_load_file(file))


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    state = torch.load(str(file), map_location="cpu", weights_only=True)  # EAGLE's own releases: pytorch_model.bin
    if not isinstance(state, dict):
        raise EagleCheckpointError(f"{file}: not a state dict of tensors")
    return state


def _plain(name: str) -> str:
    """A tensor name without the ``model.`` prefix some conversions add."""
    return name[len("model."):] if name.startswith("model.") else name


def tensor_names(path: Path) -> set[str]:
    """The names of every tensor of the checkpoint at ``path`` (a directory or one file), without a ``model.``
    prefix, read without the tensors ({} when there are no weight files)."""
    return {_plain(n) for f in weight_files(path) for n in _tensor_names(f)}


def read_checkpoint(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (a directory or one file), named without a ``model.`` prefix."""
    files = weight_files(path)
    if not files:
        raise EagleCheckpointError(f"{what} checkpoint {str(path)!r}: no *.safetensors or pytorch_model*.bin")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        found.update({_plain(n): t for n, t in _load_file(file).items()})
    return found


def load_eagle_weights(path: str | Path, arch) -> dict[str, torch.Tensor]:
    """The draft's tensors, named ``eagle.*``, checked against the target's ``arch``."""
    path = Path(path)
    found = read_checkpoint(path, "EAGLE")
    if "midlayer.self_attn.q_proj.weight" in found or "d2t" in found:
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r} is an EAGLE-3 draft (it reads three of the "
                                   "target's layers): engine/models/eagle3.py loads it")
    config = path / "config.json" if path.is_dir() else None
    num_layers = json.loads(config.read_text()).get("num_hidden_layers", 1) if config and config.is_file() else 1
    if num_layers != 1 or any(n.startswith("layers.") and not n.startswith(_LAYER) for n in found):
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r} has {num_layers} layers; drafts of one layer "
                                   "are served (EAGLE's own releases have one)")
    unlike = [what for what, yes in (("fused q/k/v checkpoints", getattr(arch, "fused_checkpoint", False)),
                                     ("attention sinks", getattr(arch, "attention_sinks", False)),
                                     ("its norm layout", getattr(arch, "norm_layout", "pre") != "pre"),
                                     ("latent attention", not hasattr(arch, "num_kv_heads"))) if yes]
    if unlike:
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r}: EAGLE drafts are served for Llama-layout "
                                   f"targets (Llama, Mistral, Mixtral, Qwen2/3, ...), not one with {unlike[0]}")
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    gate = found.get(_LAYER + "mlp.gate_proj.weight")
    inter = gate.shape[0] if gate is not None and gate.dim() == 2 else -1
    expected = {"fc.weight": (h, 2 * h), _LAYER + "self_attn.q_proj.weight": (q, h),
                _LAYER + "self_attn.k_proj.weight": (kv, h), _LAYER + "self_attn.v_proj.weight": (kv, h),
                _LAYER + "self_attn.o_proj.weight": (h, q), _LAYER + "post_attention_layernorm.weight": (h,),
                _LAYER + "mlp.gate_proj.weight": (inter, h), _LAYER + "mlp.up_proj.weight": (inter, h),
                _LAYER + "mlp.down_proj.weight": (h, inter)}
    if getattr(arch, "qkv_bias", False):  # a Qwen2 target's draft block has its q/k/v biases (and o's, if it has)
        expected.update({_LAYER + "self_attn.q_proj.bias": (q,), _LAYER + "self_attn.k_proj.bias": (kv,),
                         _LAYER + "self_attn.v_proj.bias": (kv,)})
    if getattr(arch, "o_bias", False):
        expected[_LAYER + "self_attn.o_proj.bias"] = (h,)
    optional = {"fc.bias": (h,), "embedding_layernorm.weight": (h,), "hidden_states_layernorm.weight": (h,),
                "lm_head.weight": (arch.vocab_size, h), _LAYER + "self_attn.q_norm.weight": (arch.head_dim,),
                _LAYER + "self_attn.k_norm.weight": (arch.head_dim,)}  # Qwen3's per-head norms
    missing = sorted(set(expected) - set(found))
    if missing:
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r} lacks {', '.join(missing)}")
    shapes = {**expected, **{n: s for n, s in optional.items() if n in found}}
    wrong = [f"{n}: {tuple(found[n].shape)} != {s}" for n, s in shapes.items() if tuple(found[n].shape) != s]
    if wrong:
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r} was trained for another model "
                                   f"({'; '.join(wrong[:3])})")
    for pair in (("embedding_layernorm.weight", "hidden_states_layernorm.weight"),
                 (_LAYER + "self_attn.q_norm.weight", _LAYER + "self_attn.k_norm.weight")):
        if (pair[0] in found) != (pair[1] in found):
            raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r}: {pair[0]} and {pair[1]} come together; "
                                       "it has one")
    unknown = sorted(set(found) - set(shapes) - set(_IGNORED))
    if unknown:
        raise EagleCheckpointError(f"EAGLE checkpoint {str(path)!r}: unexpected tensors {', '.join(unknown[:3])}")
    out = {PREFIX + n.replace(_LAYER, "layer."): found[n].float() for n in shapes}
    return out


def is_eagle_weights(weights: dict) -> bool:
    """Whether resolved draft weights (engine/models/mtp.py resolve_mtp_weights) are an EAGLE draft's."""
    return PREFIX + "fc.weight" in weights


def random_eagle_weights(arch, seed: int = 0, hass: bool = False) -> dict[str, torch.Tensor]:
    """A seeded random EAGLE draft in checkpoint names (float32; tests): norms at one, matrices variance-preserving."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), _LAYER + "self_attn.q_proj.weight": (q, h),
              _LAYER + "self_attn.k_proj.weight": (kv, h), _LAYER + "self_attn.v_proj.weight": (kv, h),
              _LAYER + "self_attn.o_proj.weight": (h, q), _LAYER + "post_attention_layernorm.weight": (h,),
              _LAYER + "mlp.gate_proj.weight": (inter, h), _LAYER + "mlp.up_proj.weight": (inter, h),
              _LAYER + "mlp.down_proj.weight": (h, inter)}
    if hass:
        shapes.update({"embedding_layernorm.weight": (h,), "hidden_states_layernorm.weight": (h,)})
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen) if "norm" in name else \
                0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return weights


class EagleHead:
    """Inference form, with MTPHead's interface (engine/proposers/mtp.py): the target's own DecoderLayer code on the
    paged cache, in the draft layer after the target's."""

    #: Draft layers in the paged KV cache.
    num_draft_layers = 1

    def __init__(self, target: LlamaModel, weights: dict[str, torch.Tensor], draft_vocab_size: int):
        arch = target.arch
        w = {n: t.to(target.device, target.dtype) for n, t in weights.items() if n.startswith(PREFIX)}
        det = getattr(target, "deterministic", False)  # batch-invariant GEMMs in deterministic mode, as MTPHead
        self.target, self.eps = target, arch.rms_norm_eps
        self.fc = Linear(w.pop(PREFIX + "fc.weight"), deterministic=det)
        self.fc_bias = w.pop(PREFIX + "fc.bias", None)
        self.embedding_norm = w.pop(PREFIX + "embedding_layernorm.weight", None)
        self.hidden_norm = w.pop(PREFIX + "hidden_states_layernorm.weight", None)
        lm_head = w.pop(PREFIX + "lm_head.weight", None)
        lm_head = target.lm_head if lm_head is None else lm_head
        # DecoderLayer takes an input norm; EAGLE's block has none, and forward() never applies this one.
        w[PREFIX + "layer.input_layernorm.weight"] = torch.ones(arch.hidden_size, dtype=target.dtype,
                                                                 device=target.device)
        self.layer = DecoderLayer(arch, w, PREFIX + "layer", det)
        self.draft_lm_head = Linear(lm_head[: min(draft_vocab_size, arch.vocab_size)].contiguous(), deterministic=det)

    def draft_cache(self, kv_cache: torch.Tensor, first_layer: int) -> torch.Tensor:
        return kv_cache[first_layer]

    def fuse(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(next_token_ids, self.target.embed_tokens)
        if self.embedding_norm is not None:  # HASS
            emb, hidden = rms_norm(emb, self.embedding_norm, self.eps), rms_norm(hidden, self.hidden_norm, self.eps)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        return x + self.fc_bias if self.fc_bias is not None else x

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Writes the draft layer's KV at ``meta.slot_mapping`` and returns ``g`` [n, H] (the block's residual
        stream: what the lm_head reads and the next draft step takes as its hidden)."""
        x = self.fuse(hidden, next_token_ids)
        residual = x.clone()  # no input norm: attention reads the fused vector itself
        layer = self.layer
        out = layer._chunked_mlp(layer._attention_block(x, residual, positions, self.target.rope, layer_cache, meta))
        return residual.add_(out)

    def reference_kv(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor):
        """K (after RoPE) and V [n, Hkv, D] the layer writes for these inputs, without a cache (tests)."""
        _, k, v = self.layer.qkv(self.fuse(hidden, next_token_ids), positions, self.target.rope)
        return k.contiguous(), v.contiguous()

    def draft_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """Greedy drafts over the first ``draft_vocab_size`` ids (engine/models/mtp.py DRAFT_VOCAB_SIZE)."""
        return self.draft_lm_head(g).argmax(dim=-1)


def save_eagle_checkpoint(directory: str | Path, weights: dict[str, torch.Tensor], arch,
                          metadata: dict[str, str]) -> Path:
    """``weights`` in checkpoint names as an EAGLE directory (config.json + model.safetensors) the engine loads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    inter = weights[_LAYER + "mlp.gate_proj.weight"].shape[0]
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": arch.hidden_size,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps,
        "vocab_size": arch.vocab_size, "bias": "fc.bias" in weights}, indent=1))
    save_file({n: t.detach().float().contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"),
              metadata=metadata)
    return directory


class EagleTrainModule(nn.Module):
    """Training form (bench/train_mtp.py --head eagle): EagleHead's math with dense causal attention over whole
    sequences, its tensors trainable (checkpoint names), the target's embedding, RoPE and lm_head frozen."""

    def __init__(self, target: LlamaModel, weights: dict[str, torch.Tensor]):
        super().__init__()
        if getattr(target.arch, "qkv_bias", False) or getattr(target.arch, "qk_norm", False):
            raise ValueError("EagleTrainModule trains drafts for Llama targets (no q/k/v biases or q/k norms)")
        self.arch, self.target = target.arch, target
        self.names = list(weights)
        self.params = nn.ParameterList([nn.Parameter(weights[n].detach().float().clone()) for n in self.names])

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in zip(self.names, self.params)}

    def _w(self, name: str) -> torch.Tensor | None:
        return self.params[self.names.index(name)] if name in self.names else None

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, L, H] (the target's final hidden at 0..L-1), next_token_ids [B, L] (tokens at 1..L) -> g."""
        a, w, p = self.arch, self._w, _LAYER
        b, length, _ = hidden.shape
        emb = F.embedding(next_token_ids, self.target.embed_tokens.float())
        if w("embedding_layernorm.weight") is not None:
            emb = rms_norm(emb, w("embedding_layernorm.weight"), a.rms_norm_eps)
            hidden = rms_norm(hidden, w("hidden_states_layernorm.weight"), a.rms_norm_eps)
        x = F.linear(torch.cat([emb, hidden], -1), w("fc.weight"), w("fc.bias"))
        q = F.linear(x, w(p + "self_attn.q_proj.weight")).view(b, length, a.num_heads, a.head_dim)
        k = F.linear(x, w(p + "self_attn.k_proj.weight")).view(b, length, a.num_kv_heads, a.head_dim)
        v = F.linear(x, w(p + "self_attn.v_proj.weight")).view(b, length, a.num_kv_heads, a.head_dim)
        positions = torch.arange(length)
        rope = self.target.rope
        cos, sin = rope.cos[positions].float()[:, None, :], rope.sin[positions].float()[:, None, :]
        q, k = rope_dense(q, cos, sin), rope_dense(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, scale=a.head_dim**-0.5, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, length, -1), w(p + "self_attn.o_proj.weight"))
        y = rms_norm(x, w(p + "post_attention_layernorm.weight"), a.rms_norm_eps)
        gate, up = F.linear(y, w(p + "mlp.gate_proj.weight")), F.linear(y, w(p + "mlp.up_proj.weight"))
        return x + F.linear(F.silu(gate) * up, w(p + "mlp.down_proj.weight"))

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(g, self.target.lm_head.float())
