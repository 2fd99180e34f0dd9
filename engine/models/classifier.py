"""Sequence classifiers: a decoder checkpoint saved as ``<Family>ForSequenceClassification`` (reward models, Qwen3
classifiers, cross-encoder rerankers converted to one score) is the family's causal model with a ``score`` head
[num_labels, hidden] in place of the LM head, read at the last prompt position.

The engine serves such a checkpoint through the pooling path (``SamplingParams.pooling == "classify"``): the model
runner pools the last position's final hidden state and applies the head (``ClassifierHead.logits``), and the request's
vector is the raw logits. What a client sees (probabilities, labels) is applied after: ``activate``, as vLLM and
transformers' ``ForSequenceClassificationLoss`` read ``problem_type``.

Such a model does not generate: it has no LM head. The one token a pooling request samples comes from the token
embedding standing in for one (``standin_lm_head``); it is never shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the API processes read a classifier's labels without torch
    import torch

SUFFIX = "ForSequenceClassification"
# A token classifier (an encoder's: NER, engine/models/bert.py and modernbert.py): labels for every prompt token.
TOKEN_SUFFIX = "ForTokenClassification"
# transformers' problem types -> what turns logits into a client's scores.
_ACTIVATIONS = {"regression": "identity", "single_label_classification": "softmax",
                "multi_label_classification": "sigmoid"}


def causal_architecture(name: str) -> str:
    """The causal LM a classifier architecture is built on (``Qwen3ForSequenceClassification`` ->
    ``Qwen3ForCausalLM``); another name as it is."""
    return name[: -len(SUFFIX)] + "ForCausalLM" if name.endswith(SUFFIX) else name


# vLLM's conversions of a causal reranker's LM head into a score head (config.json ``method`` with
# ``classifier_from_token``): "from_2_way_softmax" (Qwen3-Reranker, mxbai-rerank-v2: two tokens [false, true], one
# label whose logit is their difference, so its sigmoid is the two-way softmax's "true"), "no_post_processing" (one
# label a token, its LM-head row).
FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True)
class ClassifierSpec:
    """What config.json says about a classifier's labels, readable without its weights (the API process)."""

    labels: tuple[str, ...]  # id2label in id order
    problem_type: str = ""  # transformers' problem_type; "" for none given
    # The head made from LM-head rows of these tokens by ``method`` (FROM_TOKEN_METHODS); () for a score.weight.
    from_tokens: tuple[str, ...] = ()
    method: str = ""
    # A *ForTokenClassification head: it labels each prompt token (SamplingParams.pooling "token_classify"), not the
    # sequence.
    per_token: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def activation(self) -> str:
        """"softmax", "sigmoid" or "identity": vLLM's classify activation (one label: sigmoid, as a cross-encoder
        scores; several: softmax), unless the config's problem_type says otherwise."""
        if self.problem_type in _ACTIVATIONS:
            return _ACTIVATIONS[self.problem_type]
        return "sigmoid" if self.num_labels == 1 else "softmax"

    def activate(self, logits: np.ndarray) -> np.ndarray:
        """A client's scores from the head's logits (float32 [num_labels], or [num_tokens, num_labels] for a token
        classifier: each row alone)."""
        x = np.asarray(logits, dtype=np.float64)
        if self.activation == "softmax":
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            x = e / e.sum(axis=-1, keepdims=True)
        elif self.activation == "sigmoid":
            x = 1.0 / (1.0 + np.exp(-x))
        return x.astype(np.float32)


def classifier_spec(config: dict) -> ClassifierSpec | None:
    """The labels of a ``*ForSequenceClassification`` or ``*ForTokenClassification`` config (None for a causal model).
    transformers' rules: labels from ``id2label`` (keys are ids, JSON strings), else ``num_labels`` of them named
    LABEL_i, else two."""
    names = config.get("architectures") or []
    if not names or not str(names[0]).endswith((SUFFIX, TOKEN_SUFFIX)):
        return None
    per_token = str(names[0]).endswith(TOKEN_SUFFIX)
    method, tokens = config.get("method"), config.get("classifier_from_token")
    if method is not None or tokens is not None:
        if method not in FROM_TOKEN_METHODS:
            raise ValueError(f"config.json method must be one of {', '.join(FROM_TOKEN_METHODS)} (with "
                             f"classifier_from_token), got {method!r}")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise ValueError(f"config.json classifier_from_token must be a list of token strings, got {tokens!r}")
        if method == "from_2_way_softmax":
            if len(tokens) != 2:
                raise ValueError(f"method from_2_way_softmax takes two tokens [false, true], got {tokens!r}")
            labels = (tokens[1],)
        else:
            labels = tuple(tokens)
        return ClassifierSpec(labels, str(config.get("problem_type") or ""), tuple(tokens), method)
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except ValueError:
            raise ValueError(f"config.json id2label has a key that is not a label id: {sorted(id2label)}") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"config.json id2label's ids must be 0..{len(by_id) - 1}, got {sorted(by_id)}")
        labels = tuple(by_id[i] for i in range(len(by_id)))
    else:
        num_labels = int(config.get("num_labels", 2))
        if num_labels < 1:
            raise ValueError(f"config.json num_labels must be >= 1, got {num_labels}")
        labels = tuple(f"LABEL_{i}" for i in range(num_labels))
    return ClassifierSpec(labels, str(config.get("problem_type") or ""), per_token=per_token)


def classifier_spec_of_dir(model_dir: str | Path | None) -> ClassifierSpec | None:
    """``classifier_spec`` of a model directory's config.json (None without one)."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    return classifier_spec(json.loads((Path(model_dir) / "config.json").read_text()))


class ClassifierHead:
    """The score matrix, applied to pooled hidden states in float32 (a handful of labels: no packed GEMM)."""

    def __init__(self, spec: ClassifierSpec, weight: torch.Tensor):
        self.spec = spec
        self.weight = weight.float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (or [hidden]) -> float32 [n, num_labels] (or [num_labels])."""
        return hidden.float() @ self.weight.T


def take_classifier_head(weights: dict[str, torch.Tensor], spec: ClassifierSpec, hidden_size: int,
                         model_dir: str | Path | None = None) -> ClassifierHead:
    """The checkpoint's ``score.weight`` popped from ``weights`` and checked against the labels, or (``from_tokens``)
    made from the LM head's rows of those tokens, read in ``model_dir``'s tokenizer; where the checkpoint has no LM
    head, the token embedding stands in for it (``standin_lm_head``)."""
    if spec.from_tokens:
        return ClassifierHead(spec, _head_from_tokens(weights, spec, model_dir))
    weight = weights.pop("score.weight", None)
    if weight is None:
        raise ValueError("a *ForSequenceClassification checkpoint needs score.weight (its classification head); "
                         "none in the weights")
    if tuple(weight.shape) != (spec.num_labels, hidden_size):
        raise ValueError(f"score.weight has shape {tuple(weight.shape)}, expected ({spec.num_labels}, {hidden_size}) "
                         f"for {spec.num_labels} labels (config.json id2label / num_labels)")
    weights.pop("score.bias", None)  # transformers' heads have none; a converted one may carry zeros
    standin_lm_head(weights)
    return ClassifierHead(spec, weight)


def standin_lm_head(weights: dict[str, torch.Tensor]) -> None:
    """A classifier has no LM head, yet every request samples one token (a pooling request's, never shown): the token
    embedding serves as the head, a tied model's own."""
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]


def _head_from_tokens(weights: dict[str, torch.Tensor], spec: ClassifierSpec, model_dir: str | Path | None):
    from pdcluster.engine.tokenizer import Tokenizer

    if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError("classifier_from_token needs the model's tokenizer.json to find its tokens")
    tokenizer = Tokenizer(model_dir)
    ids = []
    for token in spec.from_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:  # a word the tokenizer splits has no one row (vLLM takes the token's id alike)
            pieces = tokenizer.encode(token)
            if len(pieces) != 1:
                raise ValueError(f"classifier_from_token: {token!r} is not one token of this tokenizer ({pieces})")
            token_id = pieces[0]
        ids.append(token_id)
    lm_head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    if lm_head is None:
        raise ValueError("classifier_from_token needs the checkpoint's LM head (lm_head.weight, or a tied embedding)")
    rows = lm_head[ids].float()
    return (rows[1] - rows[0]).unsqueeze(0) if spec.method == "from_2_way_softmax" else rows
