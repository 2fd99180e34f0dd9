"""OpenAI's sampling fields -> engine SamplingParams for one prompt, every value checked once with a
400 that names the field, the value and the limit (cluster/api/validation.py decides max_tokens, the
logprobs wanted and the grammar; this file checks and maps the rest).

Limits are OpenAI's (penalties in [-2, 2], logit_bias in [-100, 100]) and vLLM's for its extensions
(repetition_penalty > 0, min_tokens <= max_tokens, min_p in [0, 1], stop_token_ids and allowed_token_ids
within the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.cluster.api.generation_defaults import NO_DEFAULTS, SamplingDefaults
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import SamplingFields, short
from pdcluster.engine.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI
MAX_LOGIT_BIAS = 100.0
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): 1/T would overflow the logits


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Extras:
    """What the API decides beyond the plain sampling fields (the same for every prompt)."""

    logprobs: int | None = None  # top-k per sampled token, None = no logprobs
    prompt_logprobs: int | None = None
    structured_output: str | None = None
    lora_name: str | None = None  # the LoRA adapter the request's ``model`` names (None: the base model)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # ``bad_words`` tokenized (bad_words_token_ids)
    keep_special_tokens: bool = False  # the tool-call parser reads special tokens (Mistral's [TOOL_CALLS])
    # thinking_token_budget's markers (cluster/api/reasoning.py MARKERS): (start ids, end ids), set with a budget.
    thinking_markers: tuple[list[int], list[int]] | None = None
    defaults: SamplingDefaults = NO_DEFAULTS  # the model's generation config, for the fields a request leaves out


def sampling_params(body: SamplingFields, max_tokens: int, vocab_size: int, extras: Extras) -> SamplingParams:
    defaults = extras.defaults
    temperature = defaults.pick("temperature", body.temperature, 1.0)
    if temperature < 0:
        raise _bad("temperature", f"must be >= 0 (0 = greedy), got {temperature!r}")
    if temperature < GREEDY_EPS:
        temperature = 0.0
    top_p = defaults.pick("top_p", body.top_p, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _bad("top_p", f"must be in (0, 1], got {top_p!r}")
    top_k = defaults.pick("top_k", body.top_k, 0)
    top_k = 0 if top_k == -1 else top_k
    if top_k < 0:
        raise _bad("top_k", f"must be >= 0 (0 or -1 disables it), got {body.top_k!r}")
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX:
        raise _bad("seed", f"must fit in a signed 64-bit integer, got {short(body.seed)}")
    min_tokens = body.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise _bad("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    min_p = defaults.pick("min_p", body.min_p, 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise _bad("min_p", f"must be in [0, 1] (0 = off), got {min_p!r}")
    allowed = body.allowed_token_ids
    if allowed is not None and not allowed:
        raise _bad("allowed_token_ids", "must not be empty (leave it out to allow every token)")
    if body.cache_salt is not None and not body.cache_salt:
        raise _bad("cache_salt", "must be a non-empty string (leave it out for no salt)")
    try:  # every value is checked here; SamplingParams' own checks are the engine's guard
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=body.seed,
            stop=_stop_strings(body), stop_token_ids=_token_ids("stop_token_ids", body.stop_token_ids or [],
                                                                vocab_size),
            ignore_eos=bool(body.ignore_eos), min_tokens=min_tokens, **_penalties(body, vocab_size, defaults),
            logprobs=extras.logprobs, prompt_logprobs=extras.prompt_logprobs,
            structured_output=extras.structured_output, lora_name=extras.lora_name, min_p=min_p,
            allowed_token_ids=(None if allowed is None else _token_ids("allowed_token_ids", allowed, vocab_size)),
            bad_words_token_ids=[list(seq) for seq in extras.bad_words_token_ids], cache_salt=body.cache_salt,
            skip_special_tokens=body.skip_special_tokens is not False and not extras.keep_special_tokens,
            include_stop_str_in_output=bool(body.include_stop_str_in_output), priority=_priority(body),
            kv_transfer_params=body.kv_transfer_params,
            **_thinking(body, extras))
    except ValueError as e:
        raise APIError(400, str(e)) from e


def bad_words_token_ids(words: list[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word as it would start the text, and (where that gives
    other tokens of the same count) after a space, as in the middle of text."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        if not word.strip():
            raise _bad("bad_words", f"bad_words[{i}] is empty")
        plain = tuple(tokenizer.encode(word.lstrip()))
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def _thinking(body: SamplingFields, extras: Extras) -> dict:
    budget = body.thinking_token_budget
    if budget is None:
        return {}
    if budget < 0:
        raise _bad("thinking_token_budget", f"must be >= 0 (leave it out for no limit), got {budget}")
    if extras.thinking_markers is None:
        raise _bad("thinking_token_budget", "needs the model's thinking markers: start the server with "
                                            "--reasoning-parser")
    start, end = extras.thinking_markers
    return {"thinking_token_budget": budget, "reasoning_start_token_ids": start, "reasoning_end_token_ids": end}


def _priority(body: SamplingFields) -> int:
    priority = body.priority or 0
    if not INT64_MIN <= priority <= INT64_MAX:  # it crosses msgpack to the workers
        raise _bad("priority", f"must fit in a signed 64-bit integer, got {short(priority)}")
    return priority


def _stop_strings(body: SamplingFields) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    if any(not s for s in stop):
        raise _bad("stop", f"stop strings must be non-empty, got {short(stop)}")
    return stop


def _token_ids(param: str, ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad(param, f"token ids out of range [0, {vocab_size}): {short(bad[:5])}")
    return list(ids)


def _penalties(body: SamplingFields, vocab_size: int, defaults: SamplingDefaults) -> dict:
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name) or 0.0
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise _bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        out[name] = value
    repetition = defaults.pick("repetition_penalty", body.repetition_penalty, 1.0)
    if not repetition > 0:
        raise _bad("repetition_penalty", f"must be > 0 (1 = off), got {repetition!r}")
    out["repetition_penalty"] = repetition
    bias = []
    for key, value in (body.logit_bias or {}).items():
        param = f"logit_bias[{key!r}]"
        if not (key.isascii() and key.isdigit() and len(key) <= 18):  # "-1" and "1.5" are not token ids
            raise _bad("logit_bias", f"keys must be token ids (as strings, e.g. \"50256\"), got {short(key)}")
        if not 0 <= int(key) < vocab_size:
            raise _bad("logit_bias", f"token id {int(key)} is out of range [0, {vocab_size})")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"{param}: bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                     f"got {value!r}")
        bias.append([int(key), float(value)])
    out["logit_bias"] = bias
    return out
