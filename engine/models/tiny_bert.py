"""Tiny seeded encoders made by transformers (engine/models/bert.py's and modernbert.py's models), for the tests
(tests/test_bert.py, test_modernbert.py, test_token_pooling.py) and the GPU check: a BERT, an XLM-RoBERTa and a
ModernBERT, each as an embedding model (``BertModel`` / ``XLMRobertaModel`` / ``ModernBertModel``, with a
sentence-transformers Pooling module where asked), a one-label cross-encoder (``*ForSequenceClassification``) or a
token classifier of TOKEN_LABELS (``*ForTokenClassification``).

Their tokenizer is a WordPiece one whose vocabulary is written from a fixed text (sorted: the same ids on every run),
with BERT's pair template ([CLS] a [SEP] b [SEP], type ids 1 from b on) or RoBERTa's (<s> a </s></s> b </s>, no type
ids). Weights are drawn wider than transformers' init, so that a token's type, position or neighbour moves the output
well past rounding."""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("bert", "bert-cross", "xlm-roberta", "xlm-roberta-cross", "modernbert", "modernbert-cross",
         "bert-token", "xlm-roberta-token", "modernbert-token")
# A token classifier's labels (NER's BIO tags).
TOKEN_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
_TEXT = ("the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun . paged attention moves "
         "blocks of keys and values between prefill and decode workers ; an encoder reads every token both ways "
         "and pools them into one vector , which a search index compares by cosine . what is the capital of france "
         "? paris is the capital and largest city of france . berlin is in germany , rome in italy . 0 1 2 3 4 5 6 7 "
         "8 9 ! ? , . ; : ' \" ( ) - embeddings rerankers queries documents passages relevant")


def _tokenizer(roberta: bool, typed_pairs: bool = True):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    specials = ["<s>", "<pad>", "</s>", "<unk>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    unk = "<unk>" if roberta else "[UNK]"
    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    # The vocabulary is written, not trained: tokenizers' WordPieceTrainer breaks ties in hash order, so two processes
    # got two vocabularies (and two different tiny models) from one text. Every word of the text, then every character
    # alone and as a continuation piece, each list sorted: the same ids on every run.
    words = sorted({w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(_TEXT))})
    chars = sorted({c for w in words for c in w})
    pieces = specials + [w for w in words if w not in chars] + chars + [f"##{c}" for c in chars]
    tok = Tokenizer(WordPiece({piece: i for i, piece in enumerate(pieces)}, unk_token=unk))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    if roberta:
        cls, sep = ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[cls, sep])
    else:
        cls, sep = ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1" if typed_pairs else "[CLS] $A [SEP] $B [SEP]",
            special_tokens=[cls, sep])
    return tok


# bge-small-en-v1.5's shape (BAAI/bge-small-en-v1.5: BertModel, 33M parameters), for bench/embeddings.py.
BGE_SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
                 vocab_size=30522, max_position_embeddings=512)
# ModernBERT-base's (answerdotai/ModernBERT-base, gte-modernbert-base: 22 layers, 149M parameters); its band of 64
# tokens either side and every third layer global are build_tiny_bert's defaults for a full-size shape.
MODERNBERT_BASE = dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                       vocab_size=50368, max_position_embeddings=8192)


def build_tiny_bert(out: Path, kind: str = "bert", pooling: str | None = None, seed: int = 0,
                    shape: dict | None = None) -> Path:
    """The checkpoint of ``kind`` (one of KINDS) in ``out`` (created); ``pooling``: a sentence-transformers Pooling
    module's mode ("cls", "mean", "lasttoken") with a Normalize module after it, None for no modules.json; ``shape``:
    config sizes in place of the tiny ones (BGE_SMALL: a real model's, random weights, its vocabulary mostly unused
    by the small tokenizer)."""
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    out.mkdir(parents=True, exist_ok=True)
    roberta, cross, modern = kind.startswith("xlm-roberta"), kind.endswith("-cross"), kind.startswith("modernbert")
    token = kind.endswith("-token")
    tok = _tokenizer(roberta, typed_pairs=not modern)  # ModernBERT's tokenizer gives a pair no token types
    tok.save(str(out / "tokenizer.json"))
    specials = ({"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                 "pad_token": "<pad>", "unk_token": "<unk>"} if roberta else
                {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                 "mask_token": "[MASK]"})
    (out / "tokenizer_config.json").write_text(json.dumps({
        **specials, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": (shape or {}).get("max_position_embeddings", 4096 if modern else 64)}))
    sizes = dict(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64)
    sizes.update(shape or {})
    positions = sizes.pop("max_position_embeddings")
    shape = dict(**sizes, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if modern:  # tiny: rotary, layers 0 and 3 global, the others a +-4 band; the cross-encoder with every bias and
        # mean-pooled. A full-size ``shape`` keeps its own layers, positions and ModernBERT's band of +-64.
        del shape["hidden_act"], shape["hidden_dropout_prob"], shape["attention_probs_dropout_prob"]
        full = positions > 64
        if not full:
            shape["num_hidden_layers"] = 4
        biases = dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True,
                      classifier_pooling="mean") if cross else {}
        ids = {k: tok.token_to_id(t) for k, t in (("pad", "[PAD]"), ("cls", "[CLS]"), ("sep", "[SEP]"))}
        cfg = transformers.ModernBertConfig(**shape, max_position_embeddings=positions if full else 4096,
                                            local_attention=128 if full else 8, global_attn_every_n_layers=3,
                                            pad_token_id=ids["pad"], cls_token_id=ids["cls"], bos_token_id=ids["cls"],
                                            sep_token_id=ids["sep"], eos_token_id=ids["sep"], **biases)
        model_class = (transformers.ModernBertForSequenceClassification if cross else
                       transformers.ModernBertForTokenClassification if token else transformers.ModernBertModel)
    elif roberta:  # XLM-R's: positions from pad + 1, one token type
        cfg = transformers.XLMRobertaConfig(**shape, max_position_embeddings=positions + 2, type_vocab_size=1,
                                            pad_token_id=tok.token_to_id("<pad>"), bos_token_id=tok.token_to_id("<s>"),
                                            eos_token_id=tok.token_to_id("</s>"), layer_norm_eps=1e-5)
        model_class = (transformers.XLMRobertaForSequenceClassification if cross else
                       transformers.XLMRobertaForTokenClassification if token else transformers.XLMRobertaModel)
    else:
        cfg = transformers.BertConfig(**shape, max_position_embeddings=positions, type_vocab_size=2,
                                      pad_token_id=tok.token_to_id("[PAD]"))
        model_class = (transformers.BertForSequenceClassification if cross else
                       transformers.BertForTokenClassification if token else transformers.BertModel)
    if cross:
        cfg.num_labels = 1
    if token:
        cfg.id2label = dict(enumerate(TOKEN_LABELS))
        cfg.label2id = {label: i for i, label in enumerate(TOKEN_LABELS)}
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "embeddings" in name else 1.2 / p.shape[1] ** 0.5)
            elif name.endswith("weight") and "norm" in name.lower():  # BERT's LayerNorm, ModernBERT's *norm
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(str(out))
    if pooling is not None:
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (out / "1_Pooling").mkdir(exist_ok=True)
        chosen = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}[pooling]
        modes = {f"pooling_mode_{m}": m == chosen for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
        (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": cfg.hidden_size,
                                                                   **modes}))
    return out


def transformers_outputs(model_dir: Path, texts: list[str | tuple[str, str]]) -> list:
    """transformers' reference per input (a text, or a pair as the tokenizer's pair template reads it, with its type
    ids): an embedding model's last hidden states [n, hidden] (float32), a cross-encoder's logits [num_labels]."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model_class = getattr(transformers, cfg["architectures"][0])
    model = model_class.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for text in texts:
            enc = tok.encode(*text) if isinstance(text, tuple) else tok.encode(text)
            ids = torch.tensor([enc.ids])
            typed = cfg.get("model_type") == "bert" and cfg.get("type_vocab_size", 2) > 1
            kwargs = {"token_type_ids": torch.tensor([enc.type_ids])} if typed else {}
            result = model(input_ids=ids, **kwargs)
            outs.append(result.logits[0] if hasattr(result, "logits") and result.logits is not None
                        else result.last_hidden_state[0])
    return outs
