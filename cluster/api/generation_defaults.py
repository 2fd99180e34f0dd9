"""The model creator's sampling defaults (vLLM's ``--generation-config``): a request that leaves ``temperature``,
``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` out gets the value the model's ``generation_config.json``
recommends (Qwen3's temperature 0.6, top_p 0.95, top_k 20, say), and a chat request without ``max_tokens`` stops
at its ``max_new_tokens``. vLLM's rules:

- ``auto`` (the default) reads the model directory's generation_config.json; ``vllm`` reads nothing (the API's
  own defaults: temperature 1, no top-k ...); a directory reads that directory's generation_config.json.
- A value equal to transformers' own default (temperature 1.0, top_k 50, top_p 1.0, repetition_penalty 1.0) is not
  a recommendation and is left out, as vLLM reads only the file's differences from those defaults.
- ``--override-generation-config`` JSON goes over the file (or over nothing, with ``vllm``).
A value the request sets always wins. Completions keep OpenAI's default of 16 tokens (vLLM's request default).

Imports only the standard library (the API processes load it with the app).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The keys vLLM reads, and transformers' GenerationConfig defaults (a file value equal to its default is dropped).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                "max_new_tokens": None}
SOURCES_HELP = "auto (the model's generation_config.json), vllm (none) or a directory holding a generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field out gets (None: the API's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # chat requests without max_tokens / max_completion_tokens

    def pick(self, name: str, value, fallback):
        """The request's value, else this default, else ``fallback``."""
        if value is not None:
            return value
        default = getattr(self, name)
        return fallback if default is None else default


NO_DEFAULTS = SamplingDefaults()


def sampling_defaults(model_dir: str | os.PathLike | None, source: str = "auto",
                      overrides: dict | None = None) -> SamplingDefaults:
    """The defaults ``source`` and ``overrides`` give (ValueError naming the flag for a bad file or value)."""
    config: dict = {}
    if source == "auto":
        if model_dir is not None and os.path.isfile(os.path.join(model_dir, "generation_config.json")):
            config = _read(os.path.join(model_dir, "generation_config.json"))
    elif source != "vllm":
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config: {path} does not exist (want {SOURCES_HELP})")
        config = _read(path)
    found = {k: config[k] for k in _HF_DEFAULTS if config.get(k) is not None and config[k] != _HF_DEFAULTS[k]}
    if overrides:
        if not isinstance(overrides, dict):
            raise ValueError(f"--override-generation-config: want a JSON object, got {overrides!r}")
        ignored = sorted(set(overrides) - set(_HF_DEFAULTS))
        if ignored:  # as vLLM, other generation settings are not sampling defaults
            log.warning("--override-generation-config: ignoring %s (read: %s)", ", ".join(ignored),
                        ", ".join(_HF_DEFAULTS))
        found.update({k: v for k, v in overrides.items() if k in _HF_DEFAULTS and v is not None})
    defaults = _checked(found)
    if defaults != NO_DEFAULTS:
        log.info("sampling defaults from the model's generation config (a request's own values win; "
                 "--generation-config vllm for none): %s", found)
    return defaults


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    return config


def _checked(found: dict) -> SamplingDefaults:
    def number(name: str, ok, want: str, integer: bool = False):
        value = found.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)) \
                or not ok(value):
            raise ValueError(f"generation config: {name} must be {want}, got {value!r}")
        return value

    top_k = number("top_k", lambda v: v >= -1, "an integer >= -1 (0 or -1: off)", integer=True)
    return SamplingDefaults(
        temperature=number("temperature", lambda v: v >= 0, ">= 0"),
        top_p=number("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=None if top_k in (None, -1) else top_k,
        min_p=number("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=number("repetition_penalty", lambda v: v > 0, "> 0"),
        max_tokens=number("max_new_tokens", lambda v: v >= 1, "an integer >= 1", integer=True))
