"""The tokenizer that counts prompt tokens: the served model's when it is a pdcluster built-in (or a
model directory, or a Hugging Face Hub id: its tokenizer files only), or the one ``--tokenizer`` names. Against a foreign server with a model name we
cannot resolve there is none, and the datasets that need exact counts say so."""

from __future__ import annotations

from pathlib import Path

from pdcluster.engine.models.hub import hub_snapshot, is_hub_id
from pdcluster.engine.models.registry import BUILTIN_MODELS, resolve_model
from pdcluster.engine.tokenizer import Tokenizer


class TokenizerSourceError(ValueError):
    pass


def load_tokenizer(tokenizer_arg: str | None, model: str) -> Tokenizer | None:
    """The tokenizer, or None when ``model`` is no name we can resolve and no ``--tokenizer`` was given."""
    name = tokenizer_arg or model
    if name in BUILTIN_MODELS:
        return Tokenizer(resolve_model(name, progress=False))
    path = Path(name).expanduser()
    if (path / "tokenizer.json").is_file():  # a tokenizer-only directory is enough here
        return Tokenizer(path)
    if not path.exists() and is_hub_id(name):  # the Hub's tokenizer files (no weights), as vLLM's bench fetches them
        try:
            path = hub_snapshot(name, progress=False, weights=False)
        except LookupError as e:
            if tokenizer_arg:
                raise TokenizerSourceError(f"--tokenizer: {e}") from None
            return None  # a served model's name only: the run goes on without exact counts, as before
        if (path / "tokenizer.json").is_file():
            return Tokenizer(path)
    if tokenizer_arg:
        raise TokenizerSourceError(
            f"--tokenizer: {tokenizer_arg!r} is neither a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "nor a directory with tokenizer.json")
    return None
