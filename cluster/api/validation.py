"""The one validation of a request: a parsed OpenAI body (cluster/api/protocol.py) becomes prompts
(token ids), their engine SamplingParams and what the response shows, or an APIError whose message
names the field, the value and the limit.

Everything a client can get wrong is checked here, at the edge, against what the Router contract
exposes (cluster/api/router_contract.py: ``tokenizer``, ``max_model_len``): the model name, unsupported
parameters, empty prompts and the batch size, token ids outside the vocabulary, the context length,
``max_tokens``, logprobs, the grammar (cluster/api/structured.py) and every sampling value
(cluster/api/sampling.py). Routers and engines behind it keep only cheap guards for what they alone
know (request ids in use, the size of a worker's KV pool).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace

import anyio

from pdcluster.cluster.api.generation_defaults import NO_DEFAULTS, SamplingDefaults
from pdcluster.cluster.api.images import chat_images, expand_images, image_token_text
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.api.prompt_embeds import (PROMPT_EMBEDS_OFF, chat_marker, chat_prompt_embeds, given_prompt_embeds,
                                                 model_hidden_size)
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.options import MAX_LOGPROBS, check_template_kwargs
from pdcluster.cluster.api.protocol import (CHAT_COMPLETION, TEXT_COMPLETION, ChatCompletionRequest,
                                            ChatMessage, CompletionRequest, SamplingFields, short)
from pdcluster.cluster.api.reasoning import needs_special_tokens
from pdcluster.cluster.api.sampling import INT64_MAX, Extras, bad_words_token_ids, sampling_params
from pdcluster.cluster.api.structured import ToolCalls, structured_request
from pdcluster.cluster.api.tool_parsers import ToolParser
from pdcluster.engine.beam_search import BeamSearchParams
from pdcluster.engine.multimodal.spec import chat_content
from pdcluster.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, PromptEmbeds
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import ChatTemplateError, ContinueFinalMessageError
from pdcluster.wire.external_kv import ExternalKVError, asks_for_split, wants_remote_decode
from pdcluster.wire.external_kv import check_request_params as check_kv_transfer_params
from pdcluster.wire.sglang_bootstrap import bootstrap_kv_params

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: up to the context's end)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 128  # prompts x n: each is a router request


@dataclass
class PromptInput:
    """One prompt of the request and the parameters of its router requests."""

    token_ids: list[int]
    params: SamplingParams
    text: str | None = None  # what echo shows (the client's string, or the ids decoded); None without echo


@dataclass
class Output:
    """What each choice shows besides its text."""

    num_logprobs: int | None = None  # top alternatives per token; None = no logprobs
    echo: bool = False  # the prompt (and its logprobs) first
    num_prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs``: alternatives per prompt position
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    drop_output: bool = False  # max_tokens 0 with echo (scoring): the one token generated is not shown
    tool_calls: ToolCalls | None = None  # the text is tool calls (cluster/api/structured.py)
    reasoning_parser: str | None = None  # chat: the reasoning comes apart from the answer (cluster/api/reasoning.py)
    include_reasoning: bool = True  # vLLM's: false, the reasoning is not shown (only the answer)
    chat_echo: str = ""  # chat's echo (vLLM's): the final assistant message's text, before the reply's content
    role: str = "assistant"  # chat: the answer's role (vLLM's: --response-role, or the final message's role)


@dataclass
class Prepared:
    """A validated request, ready for the router: ``len(prompts) * n`` choices."""

    request_id: str
    object_kind: str  # TEXT_COMPLETION | CHAT_COMPLETION
    model: str
    prompts: list[PromptInput]
    n: int
    output: Output
    stream: bool
    include_usage: bool
    response_id: str  # the id the response shows: request_id, or "<kind>-<client id>" where the client named it
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    beam: BeamSearchParams | None = None  # use_beam_search: n is the beam width (cluster/api/beam.py)
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ServerPolicy:
    """What the server's flags decide for every generation request (build_app makes one)."""

    tool_parser: ToolParser | None = None  # the model's tool-call format (tool_choice "auto", tools in the prompt)
    reasoning_parser: str | None = None  # the model's reasoning format (cluster/api/reasoning.py), for chat
    # That format's thinking markers as token ids (start, end), for thinking_token_budget: tokenized once per server
    thinking_markers: tuple[list[int], list[int]] | None = None
    media: MediaPolicy = MediaPolicy()  # where a chat's images may be fetched from (cluster/api/media_policy.py)
    defaults: SamplingDefaults = NO_DEFAULTS  # the model's sampling defaults (cluster/api/generation_defaults.py)
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: alternatives per position a request may ask for
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: every stream ends with its usage
    return_tokens_as_token_ids: bool = False  # vLLM's server flag: every request's logprob tokens as "token_id:<id>"
    kv_transfer: bool = False  # vLLM's --kv-transfer-config: requests' kv_transfer_params are served
    kv_role: str = ""  # its kv_role: SGLang's router's bootstrap fields read as a prefill or a decode server's
    response_role: str = "assistant"  # vLLM's --response-role: the role of a chat answer's message
    # vLLM's --trust-request-chat-template: a chat request's chat_template renders its prompt (in the sandbox every
    # template runs in); without it such a request is refused.
    trust_request_chat_template: bool = False


async def prepare(body: SamplingFields, router, served_names: tuple[str, ...], policy: ServerPolicy = ServerPolicy(),
                  header_request_id: str | None = None, images: list[bytes] | None = None) -> Prepared:
    """``body`` checked and turned into router requests under the server's ``policy``; ``header_request_id``: the
    X-Request-Id header's value. ``images``: a completions body's one prompt's images, fetched (SGLang's /generate
    ``image_data``; a chat's come in its messages)."""
    tool_parser, reasoning_parser, media, defaults = (policy.tool_parser, policy.reasoning_parser, policy.media,
                                                      policy.defaults)
    lora_name = check_model(body.model, served_names, router.lora_names)
    n = _check_n(body)
    if isinstance(body.kv_transfer_params, dict) and "bootstrap_room" in body.kv_transfer_params:
        raise _bad("kv_transfer_params", "bootstrap_room is a field of the request itself (SGLang's router sends "
                                         "it so), not of kv_transfer_params")
    if body.bootstrap_room is not None:
        body = _from_bootstrap(body, policy.kv_role)
    _reject_unsupported(body, policy.trust_request_chat_template)
    is_chat = isinstance(body, ChatCompletionRequest)
    output, extras = _output_and_extras(body, policy)
    tokenizer = router.tokenizer
    if is_chat:
        output = replace(output, role=_answer_role(body, policy.response_role))
        if body.chat_template is not None:  # trusted, or _reject_unsupported refused it
            tokenizer = await anyio.to_thread.run_sync(_request_template, tokenizer, body.chat_template)
    # Checking a schema and tokenising long prompts take a while: keep them off the event loop.
    spec, tool_calls = await anyio.to_thread.run_sync(structured_request, body, tool_parser)
    output = replace(output, tool_calls=tool_calls)
    # A grammar forces the output from its first token (structured output, a required or named tool): it
    # holds no reasoning. Tool calls read by a parser ("auto") are free text, reasoning first.
    if is_chat and reasoning_parser is not None and spec is None:
        output = replace(output, reasoning_parser=reasoning_parser, include_reasoning=body.include_reasoning is not False)
        if not output.include_reasoning and (output.num_logprobs is not None or output.return_token_ids):
            param = "logprobs" if output.num_logprobs is not None else "return_token_ids"
            raise _bad(param, "would show the reasoning's tokens, which include_reasoning false leaves out: ask for "
                              "one or the other")
    bad_words = bad_words_token_ids(body.bad_words, tokenizer) if body.bad_words else ()
    tool_parser_reads_special = (tool_calls is not None and tool_calls.parser is not None
                                 and tool_calls.parser.needs_special_tokens)
    keep_special = tool_parser_reads_special or needs_special_tokens(output.reasoning_parser)
    extras = replace(extras, structured_output=spec, lora_name=lora_name, bad_words_token_ids=bad_words,
                     keep_special_tokens=keep_special, defaults=defaults)
    if body.thinking_token_budget is not None and policy.thinking_markers is not None:
        if spec is not None:
            raise _bad("thinking_token_budget", "cannot be combined with response_format, structured outputs or a "
                                                "required or named tool: the grammar forces the output from its "
                                                "first token, which then holds no thinking")
        extras = replace(extras, thinking_markers=policy.thinking_markers)
    embedded, chat_embeds = [], None
    if is_chat:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
        template_kwargs = chat_template_kwargs(body.chat_template_kwargs)
        if body.reasoning_effort is not None:
            template_kwargs = {"reasoning_effort": body.reasoning_effort, **template_kwargs}
        if body.documents is not None:
            template_kwargs = {**template_kwargs, "documents": template_documents(body.documents, tokenizer)}
        images = await chat_images(body.messages, tokenizer, router.max_images_per_prompt, media)
        embeds_policy = (media.enable_prompt_embeds, model_hidden_size(getattr(tokenizer, "model_dir", None)))
        ids, chat_embeds = await anyio.to_thread.run_sync(
            lambda: chat_prompt_ids_and_embeds(body.messages, body.add_generation_prompt is not False, tokenizer,
                                               tools, tool_parser, template_kwargs, bool(body.add_special_tokens),
                                               bool(body.continue_final_message), embeds_policy))
        if chat_embeds is not None and output.num_prompt_logprobs is not None:
            raise _bad("prompt_logprobs", "is not compatible with prompt_embeds parts: their rows have no tokens")
        prompts = [(ids, None)]
    else:
        if body.prompt_embeds is not None:
            embedded = await anyio.to_thread.run_sync(lambda: given_prompt_embeds(
                body.prompt_embeds, enabled=media.enable_prompt_embeds, echo=output.echo,
                prompt_logprobs=output.num_prompt_logprobs is not None, keep=body.truncate_prompt_tokens,
                keep_first=body.truncation_side == "right", max_model_len=router.max_model_len,
                max_prompts=MAX_PROMPTS, hidden_size=model_hidden_size(getattr(tokenizer, "model_dir", None))))
        prompts = await anyio.to_thread.run_sync(_completion_prompts, body, n, output.echo, tokenizer, len(embedded))
        images = list(images or [])
        assert not images or (len(prompts) == 1 and not embedded), "images go with one prompt"
    prompts = _truncate_prompts(body.truncate_prompt_tokens, prompts, router.max_model_len, tokenizer,
                                body.truncation_side == "right")
    # Prompts given as embeddings first (vLLM's order): their ids are placeholders (engine/prompt_embeds.py).
    given = [*embedded, *[None] * len(prompts)] if not is_chat else [chat_embeds]
    prompts = [([PLACEHOLDER_TOKEN_ID] * e.num_tokens, None) for e in embedded] + prompts
    inputs = []
    for i, (ids, text) in enumerate(prompts):
        label = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if given[i] is not None:
            label = "prompt_embeds" if len(embedded) == 1 else f"prompt_embeds[{i}]"
        # A model that takes images: each image token widened to its placeholders (one without images is refused).
        ids, mm_inputs = (expand_images(ids, images, tokenizer, router.max_images_per_prompt,
                                        mm_processor_kwargs=router.mm_processor_kwargs) if is_chat
                          else expand_images(ids, images, tokenizer, router.max_images_per_prompt, "prompt", label,
                                             mm_processor_kwargs=router.mm_processor_kwargs))
        max_tokens = _max_tokens(body, len(ids), router.max_model_len, label, output, defaults.max_tokens)
        params = sampling_params(body, max_tokens, tokenizer.vocab_size, extras)
        if mm_inputs or given[i] is not None:
            params = replace(params, mm_inputs=mm_inputs, prompt_embeds=given[i])
        inputs.append(PromptInput(ids, params, text))
    prefix, kind = ("chatcmpl", CHAT_COMPLETION) if is_chat else ("cmpl", TEXT_COMPLETION)
    options = body.stream_options
    if options is not None and not body.stream and (options.include_usage or options.continuous_usage_stats):
        raise _bad("stream_options", "stream_options are for streamed responses: set stream=true or leave them out")
    include_usage = bool(body.stream and ((options and options.include_usage) or policy.force_include_usage))
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    beam = _beam_search(body, n, output, inputs, policy.max_logprobs) if body.use_beam_search else None
    if body.length_penalty not in (None, 1.0) and beam is None:
        raise _bad("length_penalty", f"applies to beam search only: set use_beam_search=true or leave it out, "
                                     f"got {body.length_penalty}")
    if body.kv_transfer_params is not None:
        _check_kv_transfer(body, n, len(inputs), beam is not None, policy.kv_transfer)
    client_id = client_request_id(header_request_id or body.request_id,
                                  "X-Request-Id" if header_request_id else "request_id")
    # Two requests may carry one client id: each runs under an id of its own, which starts with the client's.
    request_id = f"{prefix}-{client_id}-{uuid.uuid4().hex[:12]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"
    # Answers name the adapter for an adapter, else the first served name whichever alias was asked for (vLLM's
    # model_name()).
    return Prepared(request_id, kind, lora_name or served_names[0], inputs, n, output, bool(body.stream), include_usage,
                    f"{prefix}-{client_id}" if client_id else request_id, continuous_usage=continuous, beam=beam)


def _from_bootstrap(body: SamplingFields, kv_role: str) -> SamplingFields:
    """SGLang's router's request (wire/sglang_bootstrap.py) as its kv_transfer_params say it; on the prefill side one
    token is generated (the router shows the decode side's answer)."""
    if body.kv_transfer_params is not None:
        raise _bad("kv_transfer_params", "give kv_transfer_params (vLLM's proxies) or bootstrap_room (SGLang's "
                                         "router), not both")
    try:
        params = bootstrap_kv_params(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, kv_role)
    except ExternalKVError as e:
        raise APIError(400, str(e), param=str(e).split(":")[0]) from None
    update = {"kv_transfer_params": params}
    if wants_remote_decode(params):
        update.update(max_tokens=1, min_tokens=None)
        if isinstance(body, ChatCompletionRequest):
            update["max_completion_tokens"] = None
    return body.model_copy(update=update)


def _check_kv_transfer(body: SamplingFields, n: int, num_prompts: int, beam: bool, served: bool) -> None:
    """vLLM's kv_transfer_params (wire/external_kv.py): well formed, on a server that serves them, and on a request
    that is one engine request whose answer can carry them back (one prompt, one choice, no beam, not streamed for
    do_remote_decode)."""
    try:
        if "bootstrap_room" not in body.kv_transfer_params:  # SGLang's, checked as they were made (_from_bootstrap)
            check_kv_transfer_params(body.kv_transfer_params)
    except ExternalKVError as e:
        raise APIError(400, str(e), param="kv_transfer_params") from None
    if not served and asks_for_split(body.kv_transfer_params):
        raise _bad("kv_transfer_params", "this server takes no part in an external prefill/decode split: start it "
                                         "with --kv-transfer-config (vLLM's flag), e.g. "
                                         "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'")
    if n != 1 or num_prompts != 1 or beam:
        raise _bad("kv_transfer_params", f"apply to one prompt with n=1 and no beam search, got {num_prompts} "
                                         f"prompt(s), n={n}{' with use_beam_search' if beam else ''}")
    if body.stream and wants_remote_decode(body.kv_transfer_params) and "bootstrap_room" not in body.kv_transfer_params:
        raise _bad("kv_transfer_params", "do_remote_decode answers with kv_transfer_params in the JSON response: "
                                         "set stream=false (as vLLM's proxies do for the prefill request)")


_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(value: str | None, param: str) -> str | None:
    """The client's id for a request (vLLM's request_id, or the X-Request-Id header), checked: it names the
    request in every log line and becomes part of internal ids, so 1-128 letters, digits and ._:- only."""
    if value is None:
        return None
    if not _CLIENT_ID.fullmatch(value):
        raise _bad(param, f"must be 1-128 letters, digits, '.', '_', ':' or '-', got {short(value)}")
    return value


def _beam_search(body: SamplingFields, n: int, output: Output, inputs: list[PromptInput],
                 max_logprobs: int = MAX_LOGPROBS) -> BeamSearchParams:
    """The search's parameters, or a 400 for what it does not combine with: it returns whole beams (with their
    tokens' logprobs when asked), scored by their log-probabilities, ending at end tokens (vLLM's beam search
    ignores the sampling filters)."""
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what} with use_beam_search", param=param, code="unsupported_parameter")

    if n > max_logprobs // 2:
        raise _bad("n", f"is the beam width with use_beam_search, at most {max_logprobs // 2} (each step asks for "
                        f"2 x n alternatives, at most --max-logprobs {max_logprobs}), got {n}")
    if body.stream:
        no("stream", "beams are returned whole, not streamed: set stream=false")
    if output.num_prompt_logprobs is not None:
        no("prompt_logprobs", "the prompt's logprobs are not returned")
    if output.echo or output.chat_echo:
        no("echo", "the prompt is not echoed")
    if output.return_token_ids:
        no("return_token_ids", "token ids are not returned")
    if output.tool_calls is not None or inputs[0].params.structured_output is not None:
        no("response_format", "the output is not constrained (no structured output, no tool calls)")
    if inputs[0].params.stop:
        no("stop", "beams end at end tokens only (no stop strings)")
    if inputs[0].params.thinking_token_budget is not None:
        no("thinking_token_budget", "beams are scored by the model's own log-probabilities (nothing is forced)")
    params = inputs[0].params
    length_penalty = 1.0 if body.length_penalty is None else float(body.length_penalty)
    if not math.isfinite(length_penalty):
        raise _bad("length_penalty", f"must be a finite number, got {body.length_penalty}")
    return BeamSearchParams(beam_width=n, max_tokens=max(p.params.max_tokens for p in inputs),  # per prompt: beam.py
                            ignore_eos=params.ignore_eos, temperature=params.temperature,
                            length_penalty=length_penalty, num_logprobs=output.num_logprobs or 0)


def check_model(model: str | None, served_names: tuple[str, ...], lora_names: tuple[str, ...] = ()) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model, which every one of ``served_names`` names, as vLLM's
    --served-model-name NAME...); any other name is a 404, as OpenAI answers an unknown model."""
    if model in served_names:
        return None
    if model in lora_names:
        return model
    served = ", ".join(repr(m) for m in (*served_names, *lora_names))
    raise APIError(404, f"The model {model!r} does not exist: this server serves {served}",
                   param="model", code="model_not_found")


def _check_n(body: SamplingFields) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise _bad("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    if body.seed is not None and n > 1 and body.seed + n - 1 > INT64_MAX:  # choice j samples with seed + j
        raise _bad("seed", f"with n={n} the choices use seeds seed..seed+{n - 1}, which must fit in a signed "
                           f"64-bit integer: got seed={body.seed}")
    return n


# vLLM's fields served only at their defaults: field -> (default, what to do instead).
_VLLM_DEFAULTS_ONLY = {
    "logits_processors": (None, "custom logits processors are not loaded"),
    "spaces_between_special_tokens": (True, "special tokens are decoded as the tokenizer joins them"),
    "chat_template": (None, "the model's own chat template is used (a request's template would run as code "
                            "on the server: serve --trust-request-chat-template allows it)"),
}


def _answer_role(body: ChatCompletionRequest, response_role: str) -> str:
    """vLLM's: the server's response role for a new turn; the final message's role when the answer continues it
    (add_generation_prompt false)."""
    if body.add_generation_prompt is not False or not body.messages:
        return response_role
    return body.messages[-1].role


def _request_template(tokenizer, template: str):
    """The router's tokenizer rendering chats with a request's ``chat_template`` (a 400 naming it if it does not
    compile)."""
    if not hasattr(tokenizer, "with_chat_template"):
        raise APIError(400, "chat_template: this model's tokenizer renders its own template only",
                       param="chat_template", code="unsupported_parameter")
    try:
        return tokenizer.with_chat_template(template)
    except ChatTemplateError as e:
        raise APIError(400, f"chat_template: {e}", param="chat_template") from e


def _reject_unsupported(body: SamplingFields, trust_request_chat_template: bool = False) -> None:
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")

    for param, (default, instead) in _VLLM_DEFAULTS_ONLY.items():
        if param == "chat_template" and trust_request_chat_template:
            continue
        value = getattr(body, param, default)
        if value is not None and value != default:
            no(param, f"only {default!r} is supported, got {short(value)}: {instead}")
    if body.model_extra:
        # As vLLM: a field nothing here reads is ignored, and said so in the log (a client's typo shows).
        log.warning("request fields ignored (not OpenAI's or vLLM's, or not read here): %s",
                    ", ".join(sorted(body.model_extra)[:20]))

    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            no("best_of", f"only best_of=1 is supported, got {body.best_of}: use n={body.best_of} and pick "
                          "a choice yourself (with logprobs to score them)")
        if body.suffix:
            no("suffix", "suffix (insertion) is not supported (leave it out)")


def _num_logprobs_in_range(param: str, value: int, limit: int, note: str = "") -> int:
    if not 0 <= value <= limit:
        raise _bad(param, f"must be in [0, {limit}], got {value}{note}"
                          + (" (the server's --max-logprobs)" if limit != MAX_LOGPROBS else ""))
    return value


def _output_and_extras(body: SamplingFields, policy: ServerPolicy) -> tuple[Output, Extras]:
    limit = policy.max_logprobs
    num_prompt = _num_prompt_logprobs(body, limit)
    tokens_as_ids = (policy.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None
                     else bool(body.return_tokens_as_token_ids))
    ids = dict(num_prompt_logprobs=num_prompt, return_token_ids=bool(body.return_token_ids),
               tokens_as_ids=tokens_as_ids)
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs", f"needs logprobs=true, got top_logprobs={body.top_logprobs} with "
                                       f"logprobs={body.logprobs}")
        num = _num_logprobs_in_range("top_logprobs", body.top_logprobs or 0, limit) if body.logprobs else None
        echoed = _final_assistant_text(body.messages) if body.echo else ""
        return (Output(num_logprobs=num, chat_echo=echoed, **ids),
                Extras(logprobs=num, prompt_logprobs=num_prompt))
    num = None if body.logprobs is None else _num_logprobs_in_range("logprobs", body.logprobs, limit)
    echo = bool(body.echo)
    output = Output(num_logprobs=num, echo=echo, drop_output=echo and body.max_tokens == 0, **ids)
    # The engine computes the prompt's records once, for the most alternatives either view shows.
    wanted = [k for k in (num if echo else None, num_prompt) if k is not None]
    return output, Extras(logprobs=num, prompt_logprobs=max(wanted) if wanted else None)


def _final_assistant_text(messages: list[ChatMessage]) -> str:
    """What chat's echo shows before the reply (vLLM's): the final message's text where it is the assistant's (a
    reply the client began, continued with continue_final_message), else nothing."""
    final = messages[-1] if messages else None
    if final is None or final.role != "assistant" or final.content is None:
        return ""
    if isinstance(final.content, str):
        return final.content
    return "".join(getattr(part, "text", None) or "" for part in final.content)


def _num_prompt_logprobs(body: SamplingFields, limit: int) -> int | None:
    """vLLM's ``prompt_logprobs``, checked as vLLM checks it: at most MAX_LOGPROBS alternatives (vLLM's
    -1, the whole vocabulary, exceeds its default max_logprobs too), none in a stream (stream chunks have
    no field for them; 0 is accepted there and shows nothing, as vLLM)."""
    value = body.prompt_logprobs
    if value is None:
        return None
    _num_logprobs_in_range("prompt_logprobs", value, limit,
                           " (-1, the whole vocabulary, is not served)" if value == -1 else "")
    if body.stream:
        if value > 0:
            raise _bad("prompt_logprobs", "prompt_logprobs are not available when stream=true (send the request "
                                          "without streaming)")
        return None
    return value


def _completion_prompts(body: CompletionRequest, n: int, echo: bool, tokenizer,
                        num_embedded: int = 0) -> list[tuple[list[int], str | None]]:
    """The text prompts' (ids, text to echo); ``num_embedded`` prompts given as embeddings count towards the
    limits too."""
    prompt = body.prompt
    if prompt is None and not num_embedded:
        raise _bad("prompt", "field required: give prompt (text or token ids) or prompt_embeds")
    batch = ([] if prompt is None else
             prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt])
    num_prompts = len(batch) + num_embedded
    if num_prompts > MAX_PROMPTS:
        raise _bad("prompt" if batch else "prompt_embeds", f"a batch of at most {MAX_PROMPTS} prompts is supported, "
                                                           f"got {num_prompts}: split it over several requests")
    if num_prompts * n > MAX_CHOICES:
        raise _bad("n", f"{num_prompts} prompts x n={n} = {num_prompts * n} choices, more than the limit of "
                        f"{MAX_CHOICES}: lower n or split the batch")
    vocab_size = tokenizer.vocab_size
    out = []
    for i, one in enumerate(batch):
        label = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            ids, text = tokenizer.encode(one), one
        else:
            ids, text = list(one), None
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"{label}: token ids out of range [0, {vocab_size}): {short(bad[:5])}",
                               param="prompt")
        if not ids:
            raise APIError(400, f"{label} is empty: give at least one token of text", param="prompt")
        if echo and text is None:
            text = tokenizer.decode(ids)
        out.append((ids, text if echo else None))
    return out


def template_documents(documents: list[dict], tokenizer) -> list[dict]:
    """vLLM's ``documents`` (retrieval-augmented chat: Granite's, Command R's templates): handed to the chat template
    as its ``documents`` variable. A template that does not read that variable would drop them silently: a 400 says
    so instead."""
    if "documents" not in (getattr(tokenizer, "chat_template", None) or ""):
        raise _bad("documents", "this model's chat template does not render documents: put them in the messages")
    return documents


def chat_template_kwargs(kwargs: dict | None) -> dict:
    try:
        return check_template_kwargs(kwargs or {}, "chat_template_kwargs")
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from e


def _truncate_prompts(keep: int | None, prompts: list[tuple[list[int], str | None]], max_model_len: int,
                      tokenizer, from_right: bool = False) -> list[tuple[list[int], str | None]]:
    """vLLM's truncate_prompt_tokens: each prompt's last ``keep`` tokens (-1: max_model_len), its first with
    ``from_right`` (truncation_side "right"); echo then shows the tokens kept."""
    if keep is None:
        return prompts
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise _bad("truncate_prompt_tokens", f"must be >= 1 (or -1 for max_model_len), got {keep}")
    kept = [(ids[:keep] if from_right else ids[-keep:], ids, text) for ids, text in prompts]
    return [(ids, None if text is None or len(whole) <= keep else tokenizer.decode(ids)) for ids, whole, text in kept]


def chat_prompt_text(messages: list[ChatMessage], add_generation_prompt: bool, tokenizer,
                     tools: list[dict] | None = None, tool_parser: ToolParser | None = None,
                     template_kwargs: dict | None = None, continue_final_message: bool = False,
                     embeds_parts: list[str] | None = None) -> str:
    """``messages`` rendered by the model's chat template (also /tokenize's). ``continue_final_message`` (vLLM's):
    the text stops right after the final message's content, so generation continues it (engine/tokenizer.py).

    With ``tools`` and a ``tool_parser``: a template that renders ``tools`` itself gets them (when the
    tokenizer passes them on); any other template (SmolLM2's plain ChatML) gets them as HF's tool
    templates show them, in a system prompt of the parser's format (before the client's own system
    text), and past calls (an assistant's ``tool_calls``) written in that format as the message's text.
    ``embeds_parts``: where prompt_embeds parts' payloads go (their markers are in the text); None: refused.
    """
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    inject = bool(tools) and tool_parser is not None and not _template_takes_tools(tokenizer)
    rendered = []
    for m in messages:
        message = {"role": m.role, "content": _content(m.content, tokenizer, embeds_parts)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key):
                message[key] = getattr(m, key)
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:  # gpt-oss's template reads it as ``thinking``
            message["reasoning_content"] = message["thinking"] = reasoning
        if inject and m.role == "assistant" and m.tool_calls:
            message["content"] = "\n".join(x for x in (message["content"], tool_parser.render_calls(m.tool_calls)) if x)
        rendered.append(message)
    kwargs = dict(template_kwargs or {})
    if inject:
        prompt = tool_parser.system_prompt(tools)
        if rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": prompt + "\n\n" + rendered[0]["content"]}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    elif tools and _template_takes_tools(tokenizer):
        kwargs["tools"] = tools
    if continue_final_message:  # the tokenizer checks it (ContinueFinalMessageError)
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **kwargs)
    except ContinueFinalMessageError as e:  # its message names the field
        raise APIError(400, str(e), param="continue_final_message") from e
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages") from e


def _content(content, tokenizer, embeds_parts: list[str] | None = None) -> str | list[dict]:
    """A message's content for the chat template: its text, or with images, the parts as the template reads them
    (LLaVA's: {"type": "image"} where each goes) or, for a template that reads text only, the image token before
    the text (vLLM's "string" content format). prompt_embeds parts go in front of the text as markers, as vLLM puts
    its placeholders (cluster/api/prompt_embeds.py), their payloads onto ``embeds_parts`` (None: a route that takes
    none)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = [p.text for p in content if p.type == "text"]
    embeds = [p.data for p in content if p.type == "prompt_embeds"]
    if embeds:
        if embeds_parts is None:
            raise APIError(400, "messages: prompt_embeds parts are served on /v1/chat/completions", param="messages",
                           code="unsupported_content")
        if len(texts) + len(embeds) < len(content):
            raise APIError(400, "messages: prompt_embeds parts and images cannot be combined in one request",
                           param="messages", code="unsupported_content")
        markers = [chat_marker(len(embeds_parts) + i) for i in range(len(embeds))]
        embeds_parts += embeds
        return "\n".join(markers + texts)
    num_images = len(content) - len(texts)
    if not num_images:
        return "\n".join(texts)
    token = image_token_text(tokenizer)
    if token is None:
        raise APIError(400, "messages: this model takes no images (image_url parts); send text",
                       param="messages", code="unsupported_content")
    parts = [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in content]
    return chat_content(parts, getattr(tokenizer, "chat_template", None), token)


def _template_takes_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools`` and the tokenizer hands them to it."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template and "tools" in inspect.signature(tokenizer.apply_chat_template).parameters


def chat_prompt_ids(messages: list[ChatMessage], add_generation_prompt: bool, tokenizer,
                    tools: list[dict] | None = None, tool_parser: ToolParser | None = None,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    continue_final_message: bool = False) -> list[int]:
    ids, _ = chat_prompt_ids_and_embeds(messages, add_generation_prompt, tokenizer, tools, tool_parser,
                                        template_kwargs, add_special_tokens, continue_final_message)
    return ids


def chat_prompt_ids_and_embeds(messages: list[ChatMessage], add_generation_prompt: bool, tokenizer,
                               tools: list[dict] | None = None, tool_parser: ToolParser | None = None,
                               template_kwargs: dict | None = None, add_special_tokens: bool = False,
                               continue_final_message: bool = False, embeds_policy: tuple[bool, int | None] | None = None,
                               ) -> tuple[list[int], PromptEmbeds | None]:
    """The chat's prompt ids, and the rows of its prompt_embeds parts where ``embeds_policy`` (whether the server
    takes them, the model's hidden size) says the route serves them (chat completions); None: refused."""
    parts: list[str] | None = None if embeds_policy is None else []
    text = chat_prompt_text(messages, add_generation_prompt, tokenizer, tools, tool_parser, template_kwargs,
                            continue_final_message, parts)
    embeds = None
    if parts:
        enabled, hidden_size = embeds_policy
        if not enabled:
            raise APIError(400, f"messages: {PROMPT_EMBEDS_OFF.removeprefix('prompt_embeds: ')}", param="messages",
                           code="unsupported_content")
        ids, embeds = chat_prompt_embeds(text, parts, tokenizer, add_special_tokens, hidden_size=hidden_size)
    else:
        # The template writes its own special tokens: none are added unless asked for (vLLM's add_special_tokens).
        ids = tokenizer.encode(text, add_special_tokens=True) if add_special_tokens else tokenizer.encode(text)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    return ids, embeds


def _max_tokens(body: SamplingFields, num_prompt: int, max_model_len: int, label: str, output: Output,
                chat_default: int | None = None) -> int:
    """Tokens the router generates for one prompt (1 when scoring: max_tokens 0 with echo). ``chat_default``: a
    chat's when it names none (the model's max_new_tokens; None: up to the context's end)."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        default = chat_default
    else:
        # A body type may say its own (cluster/api/sglang_protocol.py: SGLang's max_new_tokens null, the context's end).
        max_tokens, param = body.max_tokens, "max_tokens"
        default = getattr(type(body), "default_max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if num_prompt >= max_model_len:
        raise APIError(400, f"{label if prompt_param == 'prompt' else 'prompt'} has {num_prompt} tokens, but "
                            f"this model's context (max_model_len) is {max_model_len} tokens: shorten the prompt "
                            f"to at most {max_model_len - 1} tokens",
                       param=prompt_param, code="context_length_exceeded")
    if output.drop_output:
        return 1  # the prompt's logprobs come with the first token, which is then dropped
    if max_tokens is None:  # the default never overflows the context
        max_tokens = min(default or max_model_len, max_model_len - num_prompt)
    elif max_tokens <= 0:
        hint = " (0 only with echo=true, to score the prompt)" if isinstance(body, CompletionRequest) else ""
        raise _bad(param, f"must be at least 1, got {max_tokens}{hint}")
    if num_prompt + max_tokens > max_model_len:
        raise APIError(
            400, f"{label if prompt_param == 'prompt' else 'prompt'} ({num_prompt} tokens) + {param} "
                 f"({max_tokens}) = {num_prompt + max_tokens} tokens exceeds this model's context "
                 f"(max_model_len) of {max_model_len} tokens: lower {param} to at most "
                 f"{max_model_len - num_prompt} or shorten the prompt",
            param=param, code="context_length_exceeded")
    return max_tokens
