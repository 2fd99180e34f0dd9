"""Which checkpoints are encoder-only (engine/models/bert.py, modernbert.py), readable without torch: the API processes ask, to
refuse generation and to pool by [CLS]."""

from __future__ import annotations

import json
from pathlib import Path

# architectures[0] -> the checkpoint's prefix of the encoder's tensors in a classifier ("" for a bare encoder).
ENCODER_ARCHITECTURES = {
    "BertModel": "", "RobertaModel": "", "XLMRobertaModel": "",
    "BertForSequenceClassification": "bert.", "RobertaForSequenceClassification": "roberta.",
    "XLMRobertaForSequenceClassification": "roberta.",
    # token classifiers (NER): a label for every prompt token
    "BertForTokenClassification": "bert.", "RobertaForTokenClassification": "roberta.",
    "XLMRobertaForTokenClassification": "roberta.",
    # engine/models/modernbert.py
    "ModernBertModel": "", "ModernBertForSequenceClassification": "model.", "ModernBertForTokenClassification": "model.",
}
MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification",
                            "ModernBertForTokenClassification")


def is_encoder_architecture(name: str) -> bool:
    return name in ENCODER_ARCHITECTURES


def is_encoder_dir(model_dir: str | Path | None) -> bool:
    """Whether a model directory's config.json names an encoder-only architecture."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return False
    names = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    return bool(names) and is_encoder_architecture(str(names[0]))
