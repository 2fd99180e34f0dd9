"""Encoder-only models: BERT, RoBERTa and XLM-RoBERTa checkpoints, as embedding models (``BertModel``,
``RobertaModel``, ``XLMRobertaModel``: all-MiniLM, bge, e5, gte, bge-m3, multilingual-e5) and cross-encoders
(``BertForSequenceClassification``, ``RobertaForSequenceClassification``, ``XLMRobertaForSequenceClassification``:
ms-marco-MiniLM, bge-reranker). They pool and never generate; every token of a prompt attends to every other, so a
step computes a prompt whole (the scheduler's ``whole_prompts``) and nothing is kept in the KV cache between steps.

What they are (transformers' BertModel / XLMRobertaModel):
- embeddings: word + absolute position + token type, then LayerNorm (with bias);
- post-norm blocks: x = LN(x + O(attention(x))); x = LN(x + W2(act(W1 x))), every projection with a bias;
- RoBERTa counts positions from ``pad_token_id + 1`` (its pad tokens take position ``pad_token_id``);
- BERT's token types: a pair is read as ``[CLS] a [SEP] b [SEP]`` with type 1 from ``b`` on (what the tokenizer's
  pair template gives); derived here from the ids (after the first [SEP]), so a pair needs no second input. RoBERTa's
  tokenizer gives none: all 0.
- heads: BERT's classifier reads the pooler (dense + tanh over [CLS]), RoBERTa's its own dense + tanh then out_proj,
  both over the first token (``EncoderClassifierHead``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.engine.linear import Linear
from pdcluster.engine.models.bert_names import ENCODER_ARCHITECTURES
from pdcluster.engine.models.causal_lm import CausalLM
from pdcluster.engine.models.classifier import ClassifierSpec, classifier_spec_of_dir
from pdcluster.engine.models.llama_arch import ModelArch

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class BertArch(ModelArch):
    family: str = "bert"  # "bert" or "roberta" (XLM-RoBERTa too)
    type_vocab_size: int = 2
    position_offset: int = 0  # RoBERTa: pad_token_id + 1, the first position a token takes
    pad_token_id: int | None = None
    sep_token_id: int | None = None  # where a pair's second text starts (BERT's token types)
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_dir(cls, model_dir: Path) -> "BertArch":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        where = f"{model_dir}/config.json"
        name = (cfg.get("architectures") or ["BertModel"])[0]
        family = "roberta" if cfg.get("model_type") in ("roberta", "xlm-roberta") or "Roberta" in name else "bert"
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{where}: position_embedding_type {cfg['position_embedding_type']!r} is not supported "
                             "(only absolute position embeddings)")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{where}: a BERT decoder (is_decoder / add_cross_attention) is not served; only encoders")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        pad = cfg.get("pad_token_id")
        offset = int(pad) + 1 if family == "roberta" and pad is not None else 0
        positions = int(cfg.get("max_position_embeddings", 512)) - offset
        types = int(cfg.get("type_vocab_size", 2))
        sep = _sep_token_id(Path(model_dir), cfg) if family == "bert" and types > 1 else None
        eos = cfg.get("eos_token_id", sep)
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), rope_theta=10000.0,
            max_position_embeddings=positions, tie_word_embeddings=True, bos_token_id=None,
            eos_token_ids=(int(eos),) if eos is not None else (), family=family, type_vocab_size=types,
            position_offset=offset, pad_token_id=None if pad is None else int(pad), sep_token_id=sep,
            hidden_act=act, layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        )

    def for_context(self, max_model_len: int) -> "BertArch":
        return self


def _sep_token_id(model_dir: Path, cfg: dict) -> int | None:
    """BERT's separator: tokenizer_config.json's sep_token (else "[SEP]") in the tokenizer's vocabulary, else
    config.json's sep_token_id."""
    from tokenizers import Tokenizer as _HFTokenizer

    name = "[SEP]"
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        sep = json.loads(tok_cfg.read_text()).get("sep_token")
        name = sep.get("content", name) if isinstance(sep, dict) else (sep or name)
    if (model_dir / "tokenizer.json").is_file():
        found = _HFTokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(name)
        if found is not None:
            return int(found)
    return cfg.get("sep_token_id")


# Rows of a step's per-token work (projections, bias adds, GELU, LayerNorms) computed together: a chunk's
# intermediate-wide activations stay in cache between those passes (on a CPU they are memory-bound over a whole step's
# rows: bias adds and GELU over 6,400 x 1,536 bf16 rows took 3 and 16 ms a layer, bench/embeddings.py --model bge-small).
ROW_CHUNK = 256
ROW_CHUNK_CUDA = 16384


def _joined(weights: dict[str, torch.Tensor], names: tuple[str, ...], leaf: str, optional: bool = False):
    """The ``leaf`` tensors of ``names`` taken out of ``weights``, joined along rows (one name: the tensor itself);
    None where ``optional`` and the checkpoint has none."""
    parts = [weights.pop(f"{n}.{leaf}", None) if optional else weights.pop(f"{n}.{leaf}") for n in names]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _dense(weights: dict[str, torch.Tensor], names: tuple[str, ...], deterministic: bool,
           optional_bias: bool = False) -> Linear:
    """``x @ W.T + b``, the bias run in the GEMM's epilogue where it has one (every BERT projection has one; a
    ModernBERT's where its config says so: ``optional_bias``); ``names``: projections stored apart, run as one."""
    return Linear(_joined(weights, names, "weight"), deterministic=deterministic,
                  bias=_joined(weights, names, "bias", optional_bias))


class _LayerNorm:
    """``optional_bias``: a LayerNorm that may have no bias (ModernBERT's unless ``norm_bias``)."""

    def __init__(self, weights: dict[str, torch.Tensor], name: str, eps: float, optional_bias: bool = False):
        self.weight, self.eps = weights.pop(f"{name}.weight"), eps
        self.bias = _joined(weights, (name,), "bias", optional_bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def prompt_spans(meta) -> list[tuple[int, int]]:
    """Each prompt's (start, end) rows in the step (empty ones left out): an encoder attends within each alone."""
    starts = meta.query_start_loc.cpu().tolist()
    return [(s, e) for s, e in zip(starts[:-1], starts[1:]) if e > s]


class EncoderLayer:
    def __init__(self, arch: BertArch, weights: dict[str, torch.Tensor], i: int, deterministic: bool):
        p = f"encoder.layer.{i}."
        self.arch = arch
        self.qkv = _dense(weights, tuple(p + f"attention.self.{n}" for n in ("query", "key", "value")), deterministic)
        self.out = _dense(weights, (p + "attention.output.dense",), deterministic)
        self.attn_norm = _LayerNorm(weights, p + "attention.output.LayerNorm", arch.layer_norm_eps)
        self.up = _dense(weights, (p + "intermediate.dense",), deterministic)
        self.down = _dense(weights, (p + "output.dense",), deterministic)
        self.mlp_norm = _LayerNorm(weights, p + "output.LayerNorm", arch.layer_norm_eps)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        a = self.arch
        n, chunk = x.shape[0], ROW_CHUNK_CUDA if x.is_cuda else ROW_CHUNK
        qkv = x.new_empty(n, 3 * a.hidden_size)
        for s in range(0, n, chunk):
            qkv[s:s + chunk] = self.qkv(x[s:s + chunk])
        q, k, v = qkv.view(n, 3, a.num_heads, a.head_dim).transpose(0, 1)  # [n, heads, head_dim] each
        o = torch.empty_like(q)
        # Each prompt attends to itself both ways, alone: its rows never depend on the batch around it.
        for start, end in spans:
            o[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                                          v[start:end].transpose(0, 1)).transpose(0, 1)
        o = o.view(n, a.hidden_size)
        out = torch.empty_like(x)
        for s in range(0, n, chunk):  # post-norm: LN(x + O(o)), then LN(h + W2(act(W1 h)))
            h = self.attn_norm(self.out(o[s:s + chunk]).add_(x[s:s + chunk]))
            out[s:s + chunk] = self.mlp_norm(self.down(self.act(self.up(h))).add_(h))
        return out


class EncoderClassifierHead:
    """A cross-encoder's head over the first token's final hidden state: BERT's pooler (dense + tanh) then its
    classifier, or RoBERTa's classifier.dense + tanh then classifier.out_proj. In float32 (a handful of labels)."""

    reads_first_token = True  # the runner hands it the prompt's first row ([CLS] / <s>), not its last

    def __init__(self, spec: ClassifierSpec, weights: dict[str, torch.Tensor], family: str, prefix: str,
                 hidden_size: int):
        self.spec = spec
        names = ((f"{prefix}pooler.dense", "classifier") if family == "bert"
                 else ("classifier.dense", "classifier.out_proj"))
        missing = [f"{n}.weight" for n in names if f"{n}.weight" not in weights]
        if missing:
            raise ValueError(f"a {family} sequence classifier needs {', '.join(missing)} (its head); not in the weights")
        self.dense_w, self.dense_b = (weights.pop(f"{names[0]}.{s}").float() for s in ("weight", "bias"))
        self.out_w, self.out_b = (weights.pop(f"{names[1]}.{s}").float() for s in ("weight", "bias"))
        if tuple(self.out_w.shape) != (spec.num_labels, hidden_size):
            raise ValueError(f"{names[1]}.weight has shape {tuple(self.out_w.shape)}, expected ({spec.num_labels}, "
                             f"{hidden_size}) for {spec.num_labels} labels (config.json id2label / num_labels)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (or [hidden]) -> float32 [n, num_labels] (or [num_labels])."""
        pooled = torch.tanh(hidden.float() @ self.dense_w.T + self.dense_b)
        return pooled @ self.out_w.T + self.out_b


class EncoderTokenClassifierHead:
    """A token classifier's head (``BertForTokenClassification``, ``XLMRobertaForTokenClassification``: NER): one
    linear layer over each token's final hidden state, in float32."""

    def __init__(self, spec: ClassifierSpec, weights: dict[str, torch.Tensor], hidden_size: int):
        self.spec = spec
        if "classifier.weight" not in weights:
            raise ValueError("a token classifier needs classifier.weight (its head); not in the weights")
        self.out_w = weights.pop("classifier.weight").float()
        self.out_b = weights.pop("classifier.bias").float() if "classifier.bias" in weights else None
        if tuple(self.out_w.shape) != (spec.num_labels, hidden_size):
            raise ValueError(f"classifier.weight has shape {tuple(self.out_w.shape)}, expected ({spec.num_labels}, "
                             f"{hidden_size}) for {spec.num_labels} labels (config.json id2label / num_labels)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 [n, num_labels]."""
        return F.linear(hidden.float(), self.out_w, self.out_b)


class BertModel(CausalLM):
    """An encoder served for pooling. Its LM head is the word embedding (a stand-in: the one token a pooling request
    samples is never shown)."""

    arch_class = BertArch
    encoder_only = True
    # The encoder's first tensor, and the prefixes a bare encoder may be saved under (its model class's name).
    embedding_tensor = "embeddings.word_embeddings.weight"
    bare_prefixes = ("bert.", "roberta.", "model.")

    def __init__(self, arch: BertArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 deterministic: bool = False):
        embed = weights.pop("embeddings.word_embeddings.weight")
        super().__init__(arch, dtype, deterministic, embed, embed)
        self.position_embeddings = weights.pop("embeddings.position_embeddings.weight")
        self.token_type_embeddings = weights.pop("embeddings.token_type_embeddings.weight", None)
        self.embed_norm = _LayerNorm(weights, "embeddings.LayerNorm", arch.layer_norm_eps)
        self.scale = arch.head_dim ** -0.5  # the attention metadata's (SDPA's default, the one BERT uses)
        self.layers = [EncoderLayer(arch, weights, i, deterministic) for i in range(arch.num_layers)]
        for name in ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids",
                     "embeddings.token_type_ids"):
            weights.pop(name, None)  # an embedding model's unused pooler; buffers some checkpoints save
        if weights:
            raise ValueError(f"unexpected tensors in an encoder checkpoint: {sorted(weights)[:5]}")

    @classmethod
    def build_with_head(cls, model_dir: Path, arch: BertArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                        max_positions: int, deterministic: bool) -> "BertModel":
        name = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures", [""])[0]
        prefix = ENCODER_ARCHITECTURES.get(name, "")
        if f"{prefix}{cls.embedding_tensor}" not in weights:  # a bare encoder saved under its model's name
            prefix = next((p for p in cls.bare_prefixes if f"{p}{cls.embedding_tensor}" in weights), prefix)
        spec = classifier_spec_of_dir(model_dir)
        head = cls.classifier_head(spec, weights, arch, prefix) if spec is not None else None
        # The encoder's tensors under a bare encoder's names (a classifier keeps them under bert. / roberta.).
        for key in [k for k in weights if prefix and k.startswith(prefix)]:
            weights[key[len(prefix):]] = weights.pop(key)
        model = cls(arch, weights, dtype, max_positions, deterministic)
        model.classifier = head
        return model

    @staticmethod
    def classifier_head(spec: ClassifierSpec, weights: dict[str, torch.Tensor], arch: BertArch, prefix: str):
        """A cross-encoder's head (or a token classifier's), taken out of ``weights``."""
        if spec.per_token:
            return EncoderTokenClassifierHead(spec, weights, arch.hidden_size)
        return EncoderClassifierHead(spec, weights, arch.family, prefix, arch.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta,
                on_layer_done=None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of the step's prompts, each computed whole (the scheduler never
        splits one: ``whole_prompts``); ``kv_cache`` is not read or written."""
        a = self.arch
        spans = prompt_spans(meta)
        if a.family == "roberta" and a.pad_token_id is not None:
            # transformers' create_position_ids_from_input_ids: non-pad tokens count from pad + 1, pads stay at pad.
            keep = (input_ids != a.pad_token_id).to(torch.int64)
            counts = torch.cat([torch.cumsum(keep[s:e], 0) for s, e in spans]) if spans else keep
            position_ids = counts * keep + a.pad_token_id
        else:
            position_ids = positions
        hidden = F.embedding(input_ids, self.embed_tokens) + F.embedding(position_ids, self.position_embeddings)
        if self.token_type_embeddings is not None:
            hidden = hidden + F.embedding(self._token_types(input_ids, spans), self.token_type_embeddings)
        hidden = self.embed_norm(hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, spans)
            if on_layer_done is not None:
                on_layer_done(i)
        return hidden

    def _token_types(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """0 up to a prompt's first [SEP], 1 after it (a pair's second text and its [SEP]): the pair template's."""
        types = torch.zeros_like(input_ids)
        sep = self.arch.sep_token_id
        if sep is None or self.arch.type_vocab_size < 2:
            return types
        is_sep = (input_ids == sep).to(torch.int64)
        for s, e in spans:
            seen = torch.cumsum(is_sep[s:e], 0) - is_sep[s:e]  # separators before each token
            types[s:e] = (seen > 0).to(input_ids.dtype)
        return types
