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
# transformers' problem types -> what turns logits into a client's scores.
_ACTIVATIONS = {"regression": "identity", "single_label_classification": "softmax",
                "multi_label_classification": "sigmoid"}


def causal_architecture(name: str) -> str:
    """The causal LM a classifier architecture is built on (``Qwen3ForSequenceClassification`` ->
    ``Qwen3ForCausalLM``); another name as it is."""
    return name[: -len(SUFFIX)] + "ForCausalLM" if name.endswith(SUFFIX) else name


@dataclass(frozen=True)
class ClassifierSpec:
    """What config.json says about a classifier's labels, readable without its weights (the API process)."""

    labels: tuple[str, ...]  # id2label in id order
    problem_type: str = ""  # transformers' problem_type; "" for none given

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
        """A client's scores from the head's logits (float32 [num_labels])."""
        x = np.asarray(logits, dtype=np.float64)
        if self.activation == "softmax":
            e = np.exp(x - x.max())
            x = e / e.sum()
        elif self.activation == "sigmoid":
            x = 1.0 / (1.0 + np.exp(-x))
        return x.astype(np.float32)


def classifier_spec(config: dict) -> ClassifierSpec | None:
    """The labels of a ``*ForSequenceClassification`` config (None for a causal model). transformers' rules: labels
    from ``id2label`` (keys are ids, JSON strings), else ``num_labels`` of them named LABEL_i, else two."""
    names = config.get("architectures") or []
    if not names or not str(names[0]).endswith(SUFFIX):
        return None
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
    return ClassifierSpec(labels, str(config.get("problem_type") or ""))


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


def take_classifier_head(weights: dict[str, torch.Tensor], spec: ClassifierSpec, hidden_size: int) -> ClassifierHead:
    """The checkpoint's ``score.weight`` popped from ``weights`` and checked against the labels; where the checkpoint
    has no LM head, the token embedding stands in for it (``standin_lm_head``)."""
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
