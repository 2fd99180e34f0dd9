"""vLLM's ``--hf-overrides``: keys set over a model's config.json without editing the checkpoint (e.g. a causal
reranker served as a classifier: ``{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "method": "from_2_way_softmax"}``).

Every part of the engine and the API reads config.json from the model directory, so the override is a directory: an
overlay in the cache (``<cache>/overrides/<digest>/``, engine/models/overlay.py) holding links to every file of the
model and its own config.json, the original with the overrides merged in (nested objects merged key by key, as vLLM
updates a config), named by the model directory and the overrides.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .overlay import place_overlay


def parse_hf_overrides(text: str | dict | None) -> dict:
    """The overrides as a dict ({} for none); ValueError naming what is wrong."""
    if not text:
        return {}
    values = json.loads(text) if isinstance(text, str) else text
    if not isinstance(values, dict):
        raise ValueError(f"hf_overrides: a JSON object is expected, got {text!r}")
    return values


def merged_config(config: dict, overrides: dict) -> dict:
    """``config`` with ``overrides`` set over it, nested objects merged key by key."""
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged_config(out[key], value)
        else:
            out[key] = value
    return out


def overlay_dir(model_dir: Path, overrides: dict, cache_dir: Path) -> Path:
    """A directory that is ``model_dir`` with ``overrides`` over its config.json (``model_dir`` itself for none)."""
    if not overrides:
        return model_dir
    model_dir = Path(model_dir).resolve()
    key = json.dumps({"model": str(model_dir), "overrides": overrides}, sort_keys=True)
    target = Path(cache_dir) / "overrides" / hashlib.sha256(key.encode()).hexdigest()[:24]
    want = merged_config(json.loads((model_dir / "config.json").read_text()), overrides)
    links = {f.name: f for f in model_dir.iterdir() if f.name != "config.json"}
    return place_overlay(target, links, {"config.json": json.dumps(want, indent=2) + "\n"})
