"""The one validation of a request: a parsed OpenAI body (cluster/api_protocol.py) becomes prompt token
ids and engine SamplingParams, or an APIError whose message names the field, the value and the limit.

Everything a client can get wrong is checked here, at the edge, against what the Router contract
exposes (cluster/router_api.py: ``tokenizer``, ``max_model_len``): the model name, unsupported
parameters, an empty or batched prompt, token ids outside the vocabulary, the context length,
``max_tokens`` and every sampling value. Routers and engines behind it keep only cheap guards for what
they alone know (request ids in use, the size of a worker's KV pool).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import anyio

from pdcluster.cluster.api_middleware import APIError
from pdcluster.cluster.api_protocol import (CHAT_COMPLETION, TEXT_COMPLETION, ChatCompletionRequest,
                                            CompletionRequest, SamplingFields, short)
from pdcluster.engine.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): 1/T would overflow the logits
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: up to the context's end)


@dataclass
class Prepared:
    """A validated request, ready for the router."""

    request_id: str
    object_kind: str  # TEXT_COMPLETION | CHAT_COMPLETION
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


async def prepare(body: SamplingFields, router, served_model_name: str) -> Prepared:
    _check_model(body, served_model_name)
    _reject_unsupported(body)
    tokenizer = router.tokenizer
    is_chat = isinstance(body, ChatCompletionRequest)
    # Tokenising a long prompt takes a while: keep it off the event loop.
    prompt_fn = _chat_prompt if is_chat else _completion_prompt
    ids = await anyio.to_thread.run_sync(prompt_fn, body, tokenizer)
    if is_chat:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        default = None
    else:
        max_tokens, param, default = body.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS
    params = _sampling_params(body, max_tokens, len(ids), router.max_model_len, param, default)
    prefix, kind = ("chatcmpl", CHAT_COMPLETION) if is_chat else ("cmpl", TEXT_COMPLETION)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Prepared(f"{prefix}-{uuid.uuid4().hex}", kind, served_model_name, ids, params, bool(body.stream),
                    include_usage)


def _check_model(body: SamplingFields, served_model_name: str) -> None:
    if body.model != served_model_name:
        raise APIError(404, f"The model {body.model!r} does not exist: this server serves {served_model_name!r}",
                       param="model", code="model_not_found")


def _reject_unsupported(body: SamplingFields) -> None:
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")

    if body.n not in (None, 1):
        no("n", f"only n=1 is supported, got {body.n}: send {body.n} requests (with different seeds) instead")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            no(name, f"penalties are not supported, got {value!r} (leave it out or send 0)")
    if body.logit_bias:
        no("logit_bias", "logit_bias is not supported (leave it out)")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            no("logprobs", f"logprobs are not supported, got {body.logprobs!r} (leave it out)")
        if body.echo:
            no("echo", "echo is not supported (leave it out or send false)")
        if body.best_of not in (None, 1):
            no("best_of", f"only best_of=1 is supported, got {body.best_of}")
        if body.suffix:
            no("suffix", "suffix (insertion) is not supported (leave it out)")
    else:
        if body.logprobs or body.top_logprobs:
            no("logprobs", "logprobs are not supported (leave logprobs and top_logprobs out)")
        if body.tools:
            no("tools", "tool calling is not supported (leave tools out)")
        if body.response_format is not None and body.response_format.type != "text":
            no("response_format", f"only response_format type 'text' is supported, got {body.response_format.type!r}")


def _completion_prompt(body: CompletionRequest, tokenizer) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: a batch of {len(prompt)} prompts is not supported: send one prompt "
                                "per request (concurrent requests are batched by the server)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab_size = tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids out of range [0, {vocab_size}): {short(bad[:5])}",
                           param="prompt")
    if not ids:
        raise APIError(400, "prompt is empty: give at least one token of text", param="prompt")
    return ids


def _chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    from pdcluster.engine.tokenizer import ChatTemplateError

    if not body.messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt is not False)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages") from e
    ids = tokenizer.encode(text)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids


def _sampling_params(body: SamplingFields, max_tokens: int | None, num_prompt: int, max_model_len: int,
                     max_tokens_param: str, default_max_tokens: int | None) -> SamplingParams:
    def bad(param: str, message: str) -> APIError:
        return APIError(400, f"{param}: {message}", param=param)

    if num_prompt >= max_model_len:
        raise APIError(400, f"prompt has {num_prompt} tokens, but this model's context (max_model_len) is "
                            f"{max_model_len} tokens: shorten the prompt to at most {max_model_len - 1} tokens",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:  # the default never overflows the context
        max_tokens = min(default_max_tokens or max_model_len, max_model_len - num_prompt)
    elif max_tokens <= 0:
        raise bad(max_tokens_param, f"must be at least 1, got {max_tokens}")
    if num_prompt + max_tokens > max_model_len:
        raise APIError(
            400, f"prompt ({num_prompt} tokens) + {max_tokens_param} ({max_tokens}) = {num_prompt + max_tokens} "
                 f"tokens exceeds this model's context (max_model_len) of {max_model_len} tokens: lower "
                 f"{max_tokens_param} to at most {max_model_len - num_prompt} or shorten the prompt",
            param=max_tokens_param, code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < 0:
        raise bad("temperature", f"must be >= 0 (0 = greedy), got {temperature!r}")
    if temperature < GREEDY_EPS:
        temperature = 0.0
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"must be in (0, 1], got {top_p!r}")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise bad("top_k", f"must be >= 0 (0 or -1 disables it), got {body.top_k!r}")
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX:
        raise bad("seed", f"must fit in a signed 64-bit integer, got {short(body.seed)}")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    if any(not s for s in stop):
        raise bad("stop", f"stop strings must be non-empty, got {short(stop)}")
    try:  # every value is checked above; SamplingParams' own checks are the engine's guard
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=body.seed, stop=stop, ignore_eos=bool(body.ignore_eos))
    except ValueError as e:
        raise APIError(400, str(e)) from e
