"""ModernBERT encoders (answerdotai/ModernBERT-*, gte-modernbert-base, modernbert-embed-base, gte-reranker-modernbert-base):
``ModernBertModel`` as an embedding model and ``ModernBertForSequenceClassification`` as a cross-encoder, served as
engine/models/bert.py serves BERT (pooled, never generating, each prompt computed whole in one step).

What differs from BERT (transformers' ModernBertModel):
- no position table: rotary embeddings on q and k (rotate-half pairs), with one base for the global layers
  (``global_rope_theta``, 160,000) and another for the local ones (``local_rope_theta``, 10,000);
- every ``global_attn_every_n_layers``-th layer (from layer 0) attends over the whole prompt; the others attend to the
  tokens within ``local_attention / 2`` positions either side (a band: computed in query chunks over their keys, so
  an 8,192-token prompt never builds an 8,192-square mask);
- pre-norm blocks: x += Wo(attention(LN(x))); x += Wo(act(in) * gate), [in, gate] = Wi(LN(x)); layer 0 has no
  attention norm (its input is the normalised embedding); a final LayerNorm; LayerNorms and projections without bias
  unless the config says ``norm_bias`` / ``attention_bias`` / ``mlp_bias``;
- no token types (a pair is ``[CLS] a [SEP] b [SEP]``, all type 0);
- the classifier pools the final hidden states by [CLS] or by their mean (``classifier_pooling``), then
  LN(act(dense(.))), then a linear layer to the labels.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.engine.models.bert import (_ACTIVATIONS, ROW_CHUNK, ROW_CHUNK_CUDA, BertArch, BertModel, _dense,
                                         _LayerNorm, prompt_spans)
from pdcluster.engine.models.causal_lm import CausalLM
from pdcluster.engine.models.classifier import ClassifierSpec
from pdcluster.engine.models.llama import RotaryEmbedding

# Query rows a local layer computes together: their keys are the chunk and the window either side of it.
LOCAL_QUERY_CHUNK = 256


@dataclass(frozen=True)
class ModernBertArch(BertArch):
    family: str = "modernbert"
    global_layers: tuple[bool, ...] = ()  # per layer: attends over the whole prompt (else within local_window)
    local_window: int = 64  # a local layer's token sees those at most this many positions away (local_attention / 2)
    local_rope_theta: float = 10000.0  # the local layers' rotary base (the global ones': ModelArch.rope_theta)
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModernBertArch":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        where = f"{model_dir}/config.json"
        acts = {key: cfg.get(key, "gelu") for key in ("hidden_activation", "classifier_activation")}
        for name, act in acts.items():
            if act not in _ACTIVATIONS:
                raise ValueError(f"{where}: {name} {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        num_layers = int(cfg["num_hidden_layers"])
        pooling = cfg.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"{where}: classifier_pooling {pooling!r} is not supported (cls or mean)")
        local_attention = int(cfg.get("local_attention", 128))
        pad, sep = cfg.get("pad_token_id"), cfg.get("sep_token_id", cfg.get("eos_token_id"))
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            rms_norm_eps=float(cfg.get("norm_eps", 1e-5)), rope_theta=_rope_theta(cfg, "full_attention", where),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)), tie_word_embeddings=True,
            bos_token_id=None, eos_token_ids=(int(sep),) if sep is not None else (), type_vocab_size=1,
            pad_token_id=None if pad is None else int(pad), sep_token_id=None, hidden_act=acts["hidden_activation"],
            layer_norm_eps=float(cfg.get("norm_eps", 1e-5)), global_layers=_global_layers(cfg, num_layers, where),
            local_window=local_attention // 2, local_rope_theta=_rope_theta(cfg, "sliding_attention", where), norm_bias=bool(cfg.get("norm_bias", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            classifier_pooling=pooling, classifier_activation=acts["classifier_activation"],
            classifier_bias=bool(cfg.get("classifier_bias", False)),
        )


def _global_layers(cfg: dict, num_layers: int, where: str) -> tuple[bool, ...]:
    """Which layers attend globally: ``layer_types`` (transformers 5's config) or every
    ``global_attn_every_n_layers``-th from layer 0 (the Hub's configs)."""
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"{where}: layer_types must name full_attention or sliding_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
        return tuple(t == "full_attention" for t in types)
    every = int(cfg.get("global_attn_every_n_layers", 3))
    return tuple(i % every == 0 for i in range(num_layers))


def _rope_theta(cfg: dict, layer_type: str, where: str) -> float:
    """A layer type's rotary base: transformers 5's ``rope_parameters`` per layer type, else the Hub configs'
    ``global_rope_theta`` / ``local_rope_theta``. Scaled rotary embeddings are refused."""
    params = (cfg.get("rope_parameters") or {}).get(layer_type) or {}
    kind = params.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
    if kind != "default":
        raise ValueError(f"{where}: rope_type {kind!r} is not supported for ModernBERT (only the default rotary)")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    key, default = (("global_rope_theta", 160000.0) if layer_type == "full_attention"
                    else ("local_rope_theta", 10000.0))
    return float(cfg.get(key) or default)


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   chunk: int | None = None) -> torch.Tensor:
    """One prompt's attention where query i sees keys j with |i - j| <= window: q, k, v [heads, n, head_dim]. Query
    rows go ``chunk`` at a time over their keys (the chunk and ``window`` either side), so memory stays
    O(n * (chunk + 2 window)); a prompt within the window is plain attention."""
    n, chunk = q.shape[1], chunk or LOCAL_QUERY_CHUNK
    if n <= window + 1:
        return F.scaled_dot_product_attention(q, k, v)
    out = torch.empty_like(q)
    for qs in range(0, n, chunk):
        qe = min(n, qs + chunk)
        ks, ke = max(0, qs - window), min(n, qe + window)
        out[:, qs:qe] = F.scaled_dot_product_attention(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke],
                                                       attn_mask=_band_mask(qe - qs, ke - ks, qs - ks, window,
                                                                            q.device))
    return out


@functools.lru_cache(maxsize=64)
def _band_mask(num_rows: int, num_cols: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
    """[num_rows, num_cols] bool: query row i (at column offset + i) sees key column j where |offset + i - j| <=
    window. A chunk's mask depends on its shape alone, so every local layer and every prompt of a length reuse it."""
    rows = torch.arange(offset, offset + num_rows, device=device)[:, None]
    return (rows - torch.arange(num_cols, device=device)[None, :]).abs() <= window


class ModernBertLayer:
    def __init__(self, arch: ModernBertArch, weights: dict[str, torch.Tensor], i: int, deterministic: bool):
        p = f"layers.{i}."
        self.arch, self.is_global = arch, arch.global_layers[i]
        eps = arch.layer_norm_eps
        # Layer 0 has no attention norm (its input is the normalised embedding).
        self.attn_norm = (_LayerNorm(weights, p + "attn_norm", eps, optional_bias=True)
                          if f"{p}attn_norm.weight" in weights else None)
        self.qkv = _dense(weights, (p + "attn.Wqkv",), deterministic, optional_bias=True)
        self.out = _dense(weights, (p + "attn.Wo",), deterministic, optional_bias=True)
        self.mlp_norm = _LayerNorm(weights, p + "mlp_norm", eps, optional_bias=True)
        self.up = _dense(weights, (p + "mlp.Wi",), deterministic, optional_bias=True)  # [input; gate]
        self.down = _dense(weights, (p + "mlp.Wo",), deterministic, optional_bias=True)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], rotary: RotaryEmbedding,
                positions: torch.Tensor):
        a = self.arch
        n, chunk = x.shape[0], ROW_CHUNK_CUDA if x.is_cuda else ROW_CHUNK
        qkv = x.new_empty(n, 3 * a.hidden_size)
        for s in range(0, n, chunk):
            h = x[s:s + chunk] if self.attn_norm is None else self.attn_norm(x[s:s + chunk])
            qkv[s:s + chunk] = self.qkv(h)
        q, k, v = qkv.view(n, 3, a.num_heads, a.head_dim).unbind(1)  # [n, heads, head_dim] each
        rotary.rotate_(q, positions)  # in place on the strided views (kernels/ops.rotary: rotate-half pairs)
        rotary.rotate_(k, positions)
        o = torch.empty_like(q)
        # Each prompt attends to itself, alone: its rows never depend on the batch around it.
        for start, end in spans:
            qh, kh, vh = (t[start:end].transpose(0, 1) for t in (q, k, v))
            o[start:end] = (F.scaled_dot_product_attention(qh, kh, vh) if self.is_global
                            else band_attention(qh, kh, vh, a.local_window)).transpose(0, 1)
        o = o.view(n, a.hidden_size)
        out = torch.empty_like(x)
        width = a.intermediate_size
        for s in range(0, n, chunk):
            h = self.out(o[s:s + chunk]).add_(x[s:s + chunk])
            up = self.up(self.mlp_norm(h))
            out[s:s + chunk] = self.down(self.act(up[:, :width]).mul_(up[:, width:])).add_(h)
        return out


class ModernBertClassifierHead:
    """LN(act(dense(pooled))) then the classifier, in float32; ``pooled``: the [CLS] row, or the prompt's mean
    (``classifier_pooling``), of the final hidden states; a token classifier's (ModernBertForTokenClassification)
    applies the same to every row."""

    def __init__(self, spec: ClassifierSpec, weights: dict[str, torch.Tensor], arch: ModernBertArch):
        self.spec = spec
        if "classifier.weight" not in weights or "head.dense.weight" not in weights:
            raise ValueError("a ModernBERT sequence classifier needs head.dense.weight and classifier.weight (its "
                             "head); not in the weights")
        # The runner hands the head the prompt's first row, or (an encoder's prompt is whole in its step) the mean.
        self.reads_first_token = arch.classifier_pooling == "cls"
        self.reads_prompt_mean = arch.classifier_pooling == "mean"
        take = lambda name: None if (t := weights.pop(name, None)) is None else t.float()  # noqa: E731
        self.dense_w, self.dense_b = take("head.dense.weight"), take("head.dense.bias")
        self.norm_w, self.norm_b = take("head.norm.weight"), take("head.norm.bias")
        self.out_w, self.out_b = take("classifier.weight"), take("classifier.bias")
        self.act, self.eps = _ACTIVATIONS[arch.classifier_activation], arch.layer_norm_eps
        if tuple(self.out_w.shape) != (spec.num_labels, arch.hidden_size):
            raise ValueError(f"classifier.weight has shape {tuple(self.out_w.shape)}, expected ({spec.num_labels}, "
                             f"{arch.hidden_size}) for {spec.num_labels} labels (config.json id2label / num_labels)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (or [hidden]) -> float32 [n, num_labels] (or [num_labels])."""
        h = F.linear(hidden.float(), self.dense_w, self.dense_b)
        h = F.layer_norm(self.act(h), (h.shape[-1],), self.norm_w, self.norm_b, self.eps)
        return F.linear(h, self.out_w, self.out_b)


class ModernBertModel(BertModel):
    """A ModernBERT encoder served for pooling as BertModel is (its loading with a head; its own layers). Its LM head
    is the token embedding (a stand-in: the one token a pooling request samples is never shown)."""

    arch_class = ModernBertArch
    embedding_tensor = "embeddings.tok_embeddings.weight"
    bare_prefixes = ("model.",)

    def __init__(self, arch: ModernBertArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, deterministic: bool = False):
        embed = weights.pop("embeddings.tok_embeddings.weight")
        CausalLM.__init__(self, arch, dtype, deterministic, embed, embed)
        self.embed_norm = _LayerNorm(weights, "embeddings.norm", arch.layer_norm_eps, optional_bias=True)
        self.scale = arch.head_dim ** -0.5  # the attention metadata's (SDPA's default, the one ModernBERT uses)
        self.layers = [ModernBertLayer(arch, weights, i, deterministic) for i in range(arch.num_layers)]
        self.final_norm = _LayerNorm(weights, "final_norm", arch.layer_norm_eps, optional_bias=True)
        self.rotary = {is_global: RotaryEmbedding(arch.head_dim, theta, arch.max_position_embeddings, dtype,
                                                  embed.device)
                       for is_global, theta in ((True, arch.rope_theta), (False, arch.local_rope_theta))}
        if weights:
            raise ValueError(f"unexpected tensors in a ModernBERT checkpoint: {sorted(weights)[:5]}")

    @staticmethod
    def classifier_head(spec: ClassifierSpec, weights: dict[str, torch.Tensor], arch: ModernBertArch, prefix: str):
        return ModernBertClassifierHead(spec, weights, arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta,
                on_layer_done=None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of the step's prompts, each computed whole (``whole_prompts``);
        ``kv_cache`` is not read or written."""
        spans = prompt_spans(meta)
        hidden = self.embed_norm(F.embedding(input_ids, self.embed_tokens))
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, spans, self.rotary[layer.is_global], positions)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.final_norm(hidden)
