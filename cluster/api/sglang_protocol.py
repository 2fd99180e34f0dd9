"""SGLang's native POST /generate body (its io_struct.GenerateReqInput and SamplingParams, the fields served here),
checked and turned into one completions body per prompt (cluster/api/protocol.py's CompletionRequest), so a /generate
request is validated exactly as a /v1/completions one: the context length, token ids in the vocabulary, every
sampling value, the grammar.

A body holds one prompt (``text`` or ``input_ids``) or a batch (a list of either). ``sampling_params``,
``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``rid`` and ``lora_path`` are one value for all, or a
list with one per prompt. The answer's logprob layout (``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``return_text_in_logprobs``) is one for the whole batch here: a batch that asks for different ones is refused (send
them as separate requests). ``image_data`` gives a prompt's images (for a model that takes them): an image or a list
of them for one prompt, one entry per prompt (an image, a list, or null) for a batch; each a URL, a data URL, base64
or a local path, taken in order by the prompt's image tokens (cluster/api/images.py ``generate_images``). SGLang's
fields for what is not served here (video, audio, sessions, hidden states, custom logit processors) are refused by
name (``input_embeds`` is served with --enable-prompt-embeds: cluster/api/prompt_embeds.py); a field nothing here reads (routing hints such as
routed_dp_rank, logging switches) is ignored and named in the log, as SGLang's server ignores what it does not know.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import ConfigDict, ValidationError

from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import CompletionRequest, StrictModel, short
from pdcluster.cluster.api.validation import client_request_id

log = logging.getLogger(__name__)

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class GenerateCompletion(CompletionRequest):
    """A /generate prompt as a completions body: ``max_tokens`` None runs to the context's end (SGLang's
    ``max_new_tokens: null``), not OpenAI's 16."""

    default_max_tokens: ClassVar[int | None] = None


class SGLangSamplingParams(StrictModel):
    """SGLang's ``sampling_params`` (its defaults; what a field means is SGLang's)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    max_new_tokens: int | None = SGLANG_MAX_NEW_TOKENS
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None  # accepted: a stream here carries every piece as it comes


# SGLang's sampling fields not served here, and what to do instead.
_SAMPLING_REFUSED = {
    "stop_regex": "stop at a regular expression is not served: use stop strings or stop_token_ids",
    "structural_tag": "structural tags are not served: use json_schema, regex or ebnf",
    "custom_params": "custom logit processors are not served",
}

# SGLang's request fields not served here, and what to do instead.
_REQUEST_REFUSED = {
    "video_data": "video is not served",
    "audio_data": "audio is not served",
    "session_params": "sessions are not served: send the whole context as the prompt (the prefix cache reuses it)",
    "return_hidden_states": "hidden states are not returned",
    "custom_logit_processor": "custom logit processors are not served",
    "token_ids_logprob": "logprobs of chosen token ids are not served: use top_logprobs_num",
    "return_routed_experts": "routed experts are not returned",
    "return_entropy": "entropies are not returned: compute them from top_logprobs_num alternatives",
    "return_sampling_mask": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "the flat layout is not served: top logprobs come as per-position lists",
    "positional_embed_overrides": "embedding overrides are not served",
    "multi_item_delimiter_indices": "multi-item scoring is not served: POST /v1/score",
    "max_thinking_tokens": "thinking budgets are served on /v1/chat/completions (thinking_token_budget)",
    "require_reasoning": "served on /v1/chat/completions with --reasoning-parser",
}


class GenerateRequest(StrictModel):
    """SGLang's /generate body, the fields served here."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # A prompt as embeddings ([num_tokens][hidden] numbers), or a batch of them (served with --enable-prompt-embeds:
    # each becomes vLLM's prompt_embeds, cluster/api/prompt_embeds.py).
    input_embeds: list | None = None
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None
    log_metrics: bool = True
    priority: int | None = None
    extra_key: str | None = None  # SGLang's cache namespace: vLLM's cache_salt
    bootstrap_host: str | None = None  # SGLang's router's prefill/decode fields (wire/sglang_bootstrap.py)
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    cache_salt: str | None = None  # SGLang's newer name for a cache namespace
    model: str | None = None  # not SGLang's; accepted: a served name or an adapter


@dataclass
class LogprobLayout:
    """What the answer's ``meta_info`` shows of logprobs (one for the whole request)."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # prompt positions from here get input_token_logprobs; -1: none
    top_logprobs_num: int = 0  # alternatives per position (0: output_top_logprobs left out)
    return_text_in_logprobs: bool = False
    # A decode leg of SGLang's router (bootstrap fields on a kv_consumer server): the router puts the prefill
    # server's input_token_logprobs before this server's, so this one shows none (and computes none: it pulls the KV).
    prompt_elsewhere: bool = False

    @property
    def shows_prompt(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.prompt_elsewhere


@dataclass
class GenerateItem:
    """One prompt of the request: its completions body, its client id and its images (as given: URLs, base64 or
    paths, fetched by the route)."""

    body: GenerateCompletion
    rid: str | None
    images: list[str] = field(default_factory=list)


@dataclass
class GenerateInput:
    items: list[GenerateItem]
    n: int
    logprobs: LogprobLayout
    stream: bool
    batch: bool  # the client sent a list of prompts: the answer is a list


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _per_item(req: GenerateRequest, name: str, num_items: int, batch: bool) -> list:
    """``name``'s value for each prompt: a list (one per prompt, only for a batch) or one value for all."""
    value = getattr(req, name)
    if not isinstance(value, list):
        return [value] * num_items
    if not batch:
        raise _bad(name, "a list is for a batch of prompts (text or input_ids a list); this request has one")
    if len(value) != num_items:
        raise _bad(name, f"has {len(value)} values for {num_items} prompts: give one per prompt, or one for all")
    return list(value)


def _images(req: GenerateRequest, num_items: int, batch: bool) -> list[list[str]]:
    """Each prompt's images: one prompt takes an image or a list of them; a batch one entry per prompt (an image, a
    list, or null), or one image for every prompt."""
    value = req.image_data
    if value is None:
        return [[] for _ in range(num_items)]
    if isinstance(value, str):
        per_item = [[value] for _ in range(num_items)]
    elif not batch:
        if not all(isinstance(image, str) for image in value):
            raise _bad("image_data", "for one prompt: an image (a URL, data URL, base64 or path) or a list of them; a "
                                     "list of lists is for a batch of prompts")
        per_item = [list(value)]
    else:
        if len(value) != num_items:
            raise _bad("image_data", f"has {len(value)} entries for {num_items} prompts: give one per prompt (an "
                                     "image, a list of them, or null)")
        per_item = [[] if each is None else [each] if isinstance(each, str) else list(each) for each in value]
    for images in per_item:
        if any(not image for image in images):
            raise _bad("image_data", "an empty string is not an image")
    return per_item


def _one_layout(req: GenerateRequest, num_items: int, batch: bool) -> LogprobLayout:
    values = {}
    for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
        per_item = _per_item(req, name, num_items, batch)
        if any(v != per_item[0] for v in per_item):
            raise _bad(name, "differs between the prompts of this batch: a batch here shows one logprob layout; send "
                             "the prompts as separate requests")
        values[name] = per_item[0]
    top = values["top_logprobs_num"] or 0
    start = -1 if values["logprob_start_len"] is None else values["logprob_start_len"]
    if top < 0:
        raise _bad("top_logprobs_num", f"must be >= 0, got {top}")
    if start < -1:
        raise _bad("logprob_start_len", f"must be >= -1 (-1: output tokens only), got {start}")
    return LogprobLayout(bool(values["return_logprob"]), start, top, req.return_text_in_logprobs)


def _prompts(req: GenerateRequest) -> tuple[list, bool]:
    """Each prompt: text, token ids, or an EmbedsPrompt; and whether the body held a batch."""
    if sum(x is not None for x in (req.text, req.input_ids, req.input_embeds)) != 1:
        raise APIError(400, "give exactly one of text, input_ids and input_embeds", param="text")
    if req.input_embeds is not None:
        embeds = req.input_embeds
        batch = bool(embeds) and isinstance(embeds[0], list) and bool(embeds[0]) and isinstance(embeds[0][0], list)
        prompts = ([EmbedsPrompt(rows, f"input_embeds[{i}]") for i, rows in enumerate(embeds)] if batch
                   else [EmbedsPrompt(embeds, "input_embeds")])
        if not embeds:
            raise _bad("input_embeds", "an empty batch")
        return prompts, batch
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts = list(req.text) if batch else [req.text]
    else:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = [list(p) for p in req.input_ids] if batch else [list(req.input_ids)]
    if not prompts:
        raise _bad("text" if req.text is not None else "input_ids", "an empty batch")
    return prompts, batch


def _sampling(raw: dict | None, param: str) -> SGLangSamplingParams:
    raw = dict(raw or {})
    for name, why in _SAMPLING_REFUSED.items():
        if raw.get(name) not in (None, {}, ""):
            raise APIError(400, f"{param}.{name}: {why}", param=f"{param}.{name}", code="unsupported_parameter")
        raw.pop(name, None)
    try:
        sp = SGLangSamplingParams.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise _bad(f"{param}.{where}", f"{err['msg']} (got {short(err.get('input'))})") from None
    if sp.model_extra:
        name = sorted(sp.model_extra)[0]
        raise APIError(400, f"{param}.{name}: not a sampling parameter of SGLang's /generate (served: "
                            f"{', '.join(SGLangSamplingParams.model_fields)})", param=f"{param}.{name}",
                       code="unsupported_parameter")
    if sum(x is not None for x in (sp.json_schema, sp.regex, sp.ebnf)) > 1:
        raise _bad(param, "give at most one of json_schema, regex and ebnf")
    return sp


def _structured(sp: SGLangSamplingParams, param: str) -> dict:
    if sp.json_schema is not None:
        try:
            schema = json.loads(sp.json_schema)
        except json.JSONDecodeError as e:
            raise _bad(f"{param}.json_schema", f"is not JSON: {e}") from None
        return {"structured_outputs": {"json": schema}}
    if sp.regex is not None:
        return {"structured_outputs": {"regex": sp.regex}}
    if sp.ebnf is not None:
        return {"structured_outputs": {"grammar": sp.ebnf}}
    return {}


@dataclass(frozen=True)
class EmbedsPrompt:
    """One prompt of ``input_embeds``: its rows as the client sent them (JSON numbers), and its name in errors."""

    rows: list
    param: str

    def as_prompt_embeds(self) -> str:
        """The rows as vLLM's prompt_embeds (base64 of a .npy array); a 400 for anything but a [num_tokens, hidden]
        list of numbers."""
        import numpy as np

        try:
            array = np.asarray(self.rows, dtype=np.float32)
        except (TypeError, ValueError):
            array = None
        if array is None or array.ndim != 2 or 0 in array.shape:
            raise _bad(self.param, "a prompt's input_embeds are a non-empty [num_tokens][hidden_size] list of numbers")
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode()


def _completion_body(prompt, sp: SGLangSamplingParams, model: str, layout: LogprobLayout, req: GenerateRequest,
                     param: str) -> GenerateCompletion:
    given = sp.model_fields_set
    fields: dict[str, Any] = {"model": model, "stream": False, "n": sp.n if sp.n is not None else 1,
                              # unset: SGLang's 128; null: to the context's end
                              "max_tokens": sp.max_new_tokens}
    if isinstance(prompt, EmbedsPrompt):
        fields["prompt_embeds"] = prompt.as_prompt_embeds()
    else:
        fields["prompt"] = prompt
    if sp.max_new_tokens == 0:  # SGLang's prefill only (scoring a sequence): completions' max_tokens 0 with echo
        fields["echo"] = True
    renamed = {"min_new_tokens": "min_tokens", "sampling_seed": "seed", "no_stop_trim": "include_stop_str_in_output"}
    for name in ("min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "logit_bias", "sampling_seed"):
        if name in given and getattr(sp, name) is not None:  # unset: the server's defaults (generation_config.json)
            fields[renamed.get(name, name)] = getattr(sp, name)
    fields.update(_structured(sp, param))
    if layout.return_logprob:
        fields["logprobs"] = layout.top_logprobs_num
        if layout.shows_prompt:
            fields["prompt_logprobs"] = layout.top_logprobs_num
    if req.priority is not None:
        fields["priority"] = req.priority
    if req.extra_key is not None or req.cache_salt is not None:
        if req.extra_key is not None and req.cache_salt is not None and req.extra_key != req.cache_salt:
            raise _bad("cache_salt", "give the cache namespace as extra_key or as cache_salt, not two different ones")
        fields["cache_salt"] = req.cache_salt if req.cache_salt is not None else req.extra_key
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    try:
        return GenerateCompletion.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise _bad(param, f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None


def generate_input(req: GenerateRequest, served_model: str, kv_role: str = "") -> GenerateInput:
    """``req`` checked: one completions body per prompt, their client ids, the logprob layout; APIError (400) naming
    the field otherwise. ``kv_role``: the server's (--kv-transfer-config), which makes a request with SGLang's
    bootstrap fields a prefill or a decode leg."""
    for name, why in _REQUEST_REFUSED.items():
        value = (req.model_extra or {}).get(name)
        if value not in (None, False, [], {}, ""):
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    ignored = sorted(set(req.model_extra or {}) - set(_REQUEST_REFUSED))
    if ignored:
        # As SGLang's own server and vLLM's: a field nothing here reads (a routing hint such as routed_dp_rank or
        # session_id, a logging switch, a newer field) is ignored, and said so in the log (a client's typo shows).
        log.warning("/generate fields ignored (not read here): %s", ", ".join(ignored[:20]))
    prompts, batch = _prompts(req)
    layout = _one_layout(req, len(prompts), batch)
    layout.prompt_elsewhere = req.bootstrap_room is not None and kv_role == "kv_consumer"
    samplings = _per_item(req, "sampling_params", len(prompts), batch)
    rids = _per_item(req, "rid", len(prompts), batch)
    loras = _per_item(req, "lora_path", len(prompts), batch)
    images = _images(req, len(prompts), batch)
    if req.input_embeds is not None and req.image_data is not None:
        raise _bad("image_data", "a prompt given as input_embeds holds no images")
    if req.model is not None and any(lora is not None for lora in loras):
        raise _bad("lora_path", "give the adapter as lora_path or as model, not both")
    items, n = [], None
    for i, (prompt, raw, rid, lora, item_images) in enumerate(zip(prompts, samplings, rids, loras, images)):
        param = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
        if raw is not None and not isinstance(raw, dict):
            raise _bad(param, f"must be an object, got {short(raw)}")
        sp = _sampling(raw, param)
        if n is not None and sp.n != n:
            raise _bad("sampling_params", "n differs between the prompts of this batch: send them as separate requests")
        n = sp.n
        if rid is not None and not isinstance(rid, str):
            raise _bad("rid", f"must be a string, got {short(rid)}")
        client_request_id(rid, "rid")  # it names the request in logs and in its router ids: the OpenAI ids' rule
        items.append(GenerateItem(_completion_body(prompt, sp, lora or req.model or served_model, layout, req, param),
                                  rid, item_images))
    rids_given = [item.rid for item in items if item.rid is not None]
    if len(set(rids_given)) != len(rids_given):
        raise _bad("rid", "the same rid names two prompts of this batch")
    return GenerateInput(items, n if n is not None else 1, layout, req.stream, batch)
