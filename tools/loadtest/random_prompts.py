"""Random prompts that are exactly N tokens long for the model's tokenizer.

Random ids drawn from the vocabulary (added/special tokens excluded: a server may drop or refuse them)
are not yet a prompt of N tokens as text: decoding and re-encoding can merge or split them. So the
ids are driven to a fixed point of ``encode(decode(ids))``, truncated or topped up to N each round;
at the fixed point the text and the ids are the same prompt, so sending either one gives the server
exactly N prompt tokens (in practice one or two rounds).
"""

from __future__ import annotations

import json

import numpy as np

MAX_ROUNDS = 64


class RandomPromptError(ValueError):
    pass


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Every id of the vocabulary except the added tokens (``added_tokens`` of tokenizer.json)."""
    added: set[int] = set()
    path = tokenizer.model_dir / "tokenizer.json"
    for entry in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", []):
        added.add(int(entry["id"]))
    ids = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), np.fromiter(added, dtype=np.int64))
    if ids.size == 0:
        raise RandomPromptError(f"tokenizer in {tokenizer.model_dir} has no ordinary tokens to draw from")
    return ids


def exact_length_prompt(tokenizer, vocab_ids: np.ndarray, num_tokens: int,
                        rng: np.random.Generator) -> tuple[list[int], str]:
    """Token ids and their text, with ``encode(text) == ids`` and ``len(ids) == num_tokens``."""
    ids = rng.choice(vocab_ids, size=num_tokens).tolist()
    for _ in range(MAX_ROUNDS):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text)
        if again == ids:
            return ids, text
        missing = max(0, num_tokens - len(again))
        ids = again[:num_tokens] + rng.choice(vocab_ids, size=missing).tolist()
    raise RandomPromptError(
        f"could not make a {num_tokens}-token prompt that survives decode/encode in {MAX_ROUNDS} rounds "
        f"with the tokenizer in {tokenizer.model_dir}: use --prompt-format ids")
