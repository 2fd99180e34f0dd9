"""vLLM's ``--tokenizer``: a model served with another directory's (or Hub repository's) tokenizer. Used where a
checkpoint ships without one (a quantized or converted copy whose repository carries only weights), or where the same
vocabulary comes with a fixed chat template or other special tokens.

The model directory is seen through an overlay (engine/models/overlay.py, ``<cache>/tokenizers/<digest>/``): every
tokenizer file (``TOKENIZER_FILES``: the vocabulary, its config with the chat template, special tokens) comes from the
tokenizer's directory and none from the model's, as vLLM loads the tokenizer from that path alone; everything else
(config.json, the weights, generation_config.json, an image processor's config) is the model's. Every process that
resolves the model (the router, each worker, each tensor-parallel rank) then reads the same tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .overlay import place_overlay

TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
})


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or name.endswith(".tiktoken")


def with_tokenizer(model_dir: Path, tokenizer_dir: Path, cache_dir: Path) -> Path:
    """``model_dir`` with ``tokenizer_dir``'s tokenizer files instead of its own (``model_dir`` itself where they are
    one directory)."""
    model_dir, tokenizer_dir = Path(model_dir).resolve(), Path(tokenizer_dir).resolve()
    if model_dir == tokenizer_dir:
        return model_dir
    key = json.dumps({"model": str(model_dir), "tokenizer": str(tokenizer_dir)}, sort_keys=True)
    target = Path(cache_dir) / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    links = {f.name: f for f in model_dir.iterdir() if not is_tokenizer_file(f.name)}
    links.update({f.name: f for f in tokenizer_dir.iterdir() if is_tokenizer_file(f.name)})
    return place_overlay(target, links, {})


def check_tokenizer_fits(tokenizer, arch, name: str) -> None:
    """ValueError where ``name``'s tokenizer (``tokenizer``, read through the overlay) has ids past the model's
    embedding rows: a prompt holding one would index outside the embedding (vLLM would fail mid-request; here it is
    one line at start-up). A smaller vocabulary is served, as vLLM serves one (a model's rows past it are padding)."""
    num_rows = getattr(arch, "vocab_size", None)
    if num_rows is not None and tokenizer.vocab_size > num_rows:
        raise ValueError(f"--tokenizer {name}: its vocabulary has {tokenizer.vocab_size} tokens (added ones "
                         f"included), more than the model's {num_rows} embedding rows; give the model's own tokenizer "
                         "or one of its vocabulary")
