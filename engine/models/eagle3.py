"""EAGLE-3 draft heads for ``--spec mtp`` (vLLM's and SGLang's ``method: eagle3``: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
RedHatAI's speculators and the like), given as ``--mtp-checkpoint DIR``.

The draft reads three of the target's layers, not its final hidden state: the residual stream before layers
``(2, L // 2, L - 3)`` (or the checkpoint's ``eagle_aux_hidden_state_layer_ids``), which the target copies into
one buffer each forward (LlamaModel.capture_aux_hidden). One draft step at position ``i``::

    h   = fc([a_i; b_i; c_i])                       # pass 1 only: 3H -> H; later steps take the last step's g
    x   = [input_norm(embed(t_{i+1})); hidden_norm(h)]   # 2H: the block's attention reads both
    r   = h                  (hidden_norm(h) with norm_before_residual)
    g_i = r + attn(x) + mlp(...)                     # one Llama block on the residual r; its KV in the draft layer
    t   = d2t(argmax(lm_head(norm(g_i))))            # the draft's own vocabulary, mapped to the target's ids

chained k times in the draft KV layer after the target's, as the MTP and EAGLE heads are (engine/proposers/mtp.py),
so the KV transfer, lookahead slots and prefix-cache rule hold unchanged.

Served for Llama-family targets whose attention shape the draft block shares (its KV lives in the paged cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.eagle import EagleCheckpointError, read_checkpoint, tensor_names, weight_files
from pdcluster.engine.models.llama import DecoderLayer, LlamaModel, rms_norm

PREFIX = "eagle3."
_LAYER_PREFIXES = ("midlayer.", "layers.0.")  # EAGLE-3's own releases, speculators' conversions


def draft_kind(path: str | Path) -> str | None:
    """What the checkpoint at ``path`` drafts as, its tensor names read once: "eagle3" (a ``d2t`` map, a
    ``midlayer`` block, or a config naming the algorithm), "eagle" (an ``fc`` fusing the embedding with the hidden
    state: engine/models/eagle.py), or None (neither, or unreadable: the MTP loader then says what is wrong)."""
    path = Path(path)
    if not weight_files(path):
        return None
    config = _config(path) if path.is_dir() else {}
    if "eagle3" in json.dumps(config.get("architectures", [])).lower() or \
            (config.get("speculators_config") or {}).get("algorithm") == "eagle3":
        return "eagle3"
    try:
        names = tensor_names(path)
    except Exception:  # noqa: BLE001 - unreadable: not a draft we know
        return None
    if any(n.split(".")[-1] == "d2t" or "midlayer." in n for n in names):
        return "eagle3"
    return "eagle" if "fc.weight" in names else None


def _config(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not file.is_file():
        return {}
    config = json.loads(file.read_text())
    # speculators: the block's shape under transformer_layer_config, the rest at the top.
    return {**(config.get("transformer_layer_config") or {}), **config}


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default: early, middle and late (the stream before each of these layers)."""
    return 2, num_layers // 2, num_layers - 3


def load_eagle3_weights(path: str | Path, arch, num_target_layers: int) -> dict[str, torch.Tensor]:
    """The draft's tensors (``eagle3.*``; ``eagle3.d2t`` int64, ``eagle3.aux_layers`` the target layers it reads),
    checked against the target's ``arch``."""
    path = Path(path)
    found = {}
    for name, t in read_checkpoint(path, "EAGLE-3").items():
        for prefix in _LAYER_PREFIXES:
            if name.startswith(prefix):
                name = "layer." + name[len(prefix):]
        found[name] = t
    config = _config(path)
    if config.get("num_hidden_layers", 1) != 1 or any(n.startswith("layers.") for n in found):
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r}: drafts of one layer are served")
    d2t = found.get("d2t")
    draft_vocab = int(d2t.shape[0]) if d2t is not None else arch.vocab_size
    gate = found.get("layer.mlp.gate_proj.weight")
    expected = _shapes(arch, draft_vocab, gate.shape[0] if gate is not None and gate.dim() == 2 else -1, "layer.")
    missing = sorted(set(expected) - set(found))
    if missing:
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r} lacks {', '.join(missing)}")
    wrong = [f"{n}: {tuple(found[n].shape)} != {s}" for n, s in expected.items() if tuple(found[n].shape) != s]
    if wrong:
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r} does not fit this target (its block must "
                                   f"share the target's hidden size and attention shape: {'; '.join(wrong[:3])})")
    unknown = sorted(set(found) - set(expected) - {"d2t", "t2d", "embed_tokens.weight"})
    if unknown:
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r}: unexpected tensors {', '.join(unknown[:3])}")
    if d2t is not None and (d2t.dim() != 1 or d2t.dtype.is_floating_point):
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r}: d2t must be a vector of ids")
    ids = torch.arange(draft_vocab) + (d2t.long() if d2t is not None else 0)
    if ids.min() < 0 or ids.max() >= arch.vocab_size:
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r}: d2t maps past the target's vocabulary")
    layers = tuple(config.get("eagle_aux_hidden_state_layer_ids") or
                   (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or
                   default_aux_layers(num_target_layers))
    if len(layers) != 3 or not all(isinstance(i, int) and 0 < i < num_target_layers for i in layers):
        raise EagleCheckpointError(f"EAGLE-3 checkpoint {str(path)!r}: aux hidden state layers {list(layers)} are "
                                   f"not three of the target's 1..{num_target_layers - 1}")
    out = {PREFIX + n: found[n].float() for n in expected}
    out[PREFIX + "draft_to_target"] = ids
    out[PREFIX + "aux_layers"] = torch.tensor(layers, dtype=torch.int64)
    out[PREFIX + "norm_before_residual"] = torch.tensor(bool(config.get("norm_before_residual", False)))
    return out


def _shapes(arch, draft_vocab: int, intermediate: int, block: str) -> dict[str, tuple[int, ...]]:
    """A draft's tensors and their shapes, its block's named with the prefix ``block``."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    b = block
    return {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h),
            b + "input_layernorm.weight": (h,), b + "hidden_norm.weight": (h,),
            b + "post_attention_layernorm.weight": (h,), b + "self_attn.q_proj.weight": (q, 2 * h),
            b + "self_attn.k_proj.weight": (kv, 2 * h), b + "self_attn.v_proj.weight": (kv, 2 * h),
            b + "self_attn.o_proj.weight": (h, q), b + "mlp.gate_proj.weight": (intermediate, h),
            b + "mlp.up_proj.weight": (intermediate, h), b + "mlp.down_proj.weight": (h, intermediate)}


def is_eagle3_weights(weights: dict) -> bool:
    return PREFIX + "fc.weight" in weights


def random_eagle3_weights(arch, draft_vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded random EAGLE-3 draft in its releases' names (``midlayer.*``, float32, ``d2t``; tests)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _shapes(arch, draft_vocab, arch.intermediate_size, "midlayer.")
    weights = {n: (1.0 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else
               torch.randn(s, generator=gen) / s[1] ** 0.5 for n, s in shapes.items()}
    # The draft vocabulary: every other target id from 0 (d2t[i] = target id - i), as the releases' frequent ids.
    weights["d2t"] = torch.arange(draft_vocab, dtype=torch.int64)
    return weights


class Eagle3Head:
    """Inference form, with MTPHead's interface (engine/proposers/mtp.py) plus ``target_hidden``: what pass 1 takes
    for the verified positions (the target's aux hidden states through ``fc``)."""

    #: Draft layers in the paged KV cache.
    num_draft_layers = 1

    def __init__(self, target: LlamaModel, weights: dict[str, torch.Tensor], max_tokens: int):
        if type(target).forward is not LlamaModel.forward:
            raise EagleCheckpointError(f"EAGLE-3 drafts are served for Llama-family targets, not "
                                       f"{target.architecture_name}")
        arch = target.arch
        dev, dtype = target.device, target.dtype
        w = {n[len(PREFIX):]: t for n, t in weights.items() if n.startswith(PREFIX)}
        det = getattr(target, "deterministic", False)  # batch-invariant GEMMs in deterministic mode, as MTPHead
        self.target, self.eps = target, arch.rms_norm_eps
        self.fc = Linear(w.pop("fc.weight").to(dev, dtype), deterministic=det)
        self.norm = w.pop("norm.weight").to(dev, dtype)
        self.lm_head = Linear(w.pop("lm_head.weight").to(dev, dtype), deterministic=det)
        self.draft_to_target = w.pop("draft_to_target").to(dev)
        self.norm_before_residual = bool(w.pop("norm_before_residual"))
        target.capture_aux_hidden(tuple(w.pop("aux_layers").tolist()), max_tokens)
        block = {f"{PREFIX}layer.{n[len('layer.'):]}": t.to(dev, dtype) for n, t in w.items()}
        self.input_norm = block.pop(f"{PREFIX}layer.input_layernorm.weight")
        self.hidden_norm = block.pop(f"{PREFIX}layer.hidden_norm.weight")
        # DecoderLayer takes an input norm; the block norms its two halves itself (above) and never applies this one.
        block[f"{PREFIX}layer.input_layernorm.weight"] = self.input_norm
        self.layer = DecoderLayer(arch, block, f"{PREFIX}layer", det)

    def draft_cache(self, kv_cache: torch.Tensor, first_layer: int) -> torch.Tensor:
        return kv_cache[first_layer]

    def target_hidden(self, hidden_states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Pass 1's hidden for the step's token ``rows``: the target's aux hidden states of those tokens, fused."""
        return self.fc(self.target.aux_hidden[rows])

    def _inputs(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's attention input [n, 2H] and its residual [n, H] (a new tensor: the block adds to it)."""
        emb = rms_norm(F.embedding(next_token_ids, self.target.embed_tokens), self.input_norm, self.eps)
        normed = rms_norm(hidden, self.hidden_norm, self.eps)
        residual = normed.clone() if self.norm_before_residual else hidden.clone()
        return torch.cat([emb, normed], dim=-1), residual

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Writes the draft layer's KV at ``meta.slot_mapping`` and returns ``g`` [n, H] (the block's residual
        stream, before the final norm: what the next draft step takes as its hidden)."""
        x, residual = self._inputs(hidden, next_token_ids)
        layer = self.layer
        out = layer._chunked_mlp(layer._attention_block(x, residual, positions, self.target.rope, layer_cache, meta))
        return residual.add_(out)

    def reference_kv(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor):
        """K (after RoPE) and V [n, Hkv, D] the layer writes for these inputs (pass 1's: ``hidden`` the fused aux
        states), without a cache (tests)."""
        _, k, v = self.layer.qkv(self._inputs(hidden, next_token_ids)[0], positions, self.target.rope)
        return k.contiguous(), v.contiguous()

    def draft_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """Greedy drafts over the draft's vocabulary, as the target's ids."""
        return self.draft_to_target[self.lm_head(rms_norm(g, self.norm, self.eps)).argmax(dim=-1)]
