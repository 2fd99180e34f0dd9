"""The OpenAI wire format the HTTP API speaks: pydantic models of the request bodies, and the JSON of
responses, stream chunks (SSE) and errors.

A completions ``prompt`` is a string, a list of token ids, or a batch (a list of strings or of token-id
lists; cluster/api/validation.py caps its size). Parameters OpenAI defines that we do not support are
accepted here and refused there with a message that says so. Log-probability fields are built by
cluster/api/logprobs.py, tool calls by cluster/api/structured.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WrapValidator


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: client values quoted in error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ================================================================================== request bodies


def one_of(hint: str) -> WrapValidator:
    """Replace a union's one-error-per-branch by one message that says what is accepted."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {hint}, got {short(value)}") from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    one_of("a string, a list of token ids, or a batch: a list of strings or of token-id lists"),
]
Stop = Annotated[str | list[str] | None, one_of("a string or a list of strings")]


class StrictModel(BaseModel):
    # Strict: "5" is not 5, 5.0 is not an int, 1 is not true; NaN and infinities are refused.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, the usage so far on every chunk


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: str  # "text" | "json_object" | "json_schema"; anything else is refused with its name
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` (one constraint of: json, regex, choice, grammar, json_object)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


class SamplingFields(StrictModel):
    """What completions and chat completions share."""

    # Fields no model here declares are kept (not dropped unseen): the API logs them as ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (as vLLM): 0 or -1 = off
    seed: int | None = None
    stop: Stop = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the client's id for the request (an X-Request-Id header wins): the response's id is "<kind>-<it>", and
    # every worker's log names the request by it (each request still runs under an id of its own).
    request_id: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # completions too, as vLLM
    # Extensions, as vLLM names them:
    ignore_eos: bool | None = False
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True  # only true (tokenizers' decode has no such switch)
    include_stop_str_in_output: bool | None = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first k tokens instead
    cache_salt: str | None = None
    # vLLM's external prefill/decode protocol (wire/external_kv.py; a server started with --kv-transfer-config):
    # do_remote_decode on the prefill instance, its answer's kv_transfer_params on the decode instance.
    kv_transfer_params: dict | None = None
    # SGLang's router's prefill/decode fields (wire/sglang_bootstrap.py), turned into kv_transfer_params.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # Structured output, vLLM's two spellings (cluster/api/structured.py):
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar serves every kind here
    guided_whitespace_pattern: str | None = None
    # vLLM's per-position prompt logprobs: the prompt token's and the N most likely at each position
    # (``prompt_logprobs`` of a completion choice, of a chat response); not streamed (as vLLM).
    prompt_logprobs: int | None = None
    # vLLM's token-id views (what RL and evaluation frameworks read): ``return_token_ids`` adds the prompt's
    # and each choice's token ids; ``return_tokens_as_token_ids`` names logprob tokens "token_id:<id>".
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    priority: int | None = 0  # lower first (engine/waiting_queue.py)
    # vLLM's beam search (cluster/api/beam.py): n is the beam width; the score divides the cumulative
    # logprob by (prompt + output tokens) ** length_penalty.
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    # vLLM's: at most this many tokens inside the model's thinking section, then its end marker is forced
    # (engine/thinking_budget.py; the markers come from the server's --reasoning-parser).
    thinking_token_budget: int | None = None
    # vLLM fields served only at their defaults (anything else is a 400 naming the field):
    logits_processors: list | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt | None = None
    # vLLM's: prompts given as embeddings, base64 of a torch.save'd [num_tokens, hidden] tensor each (served with
    # --enable-prompt-embeds: cluster/api/prompt_embeds.py); with ``prompt`` too, these come first.
    prompt_embeds: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str  # a data: URL (base64) or an http(s) URL the server fetches
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; one resolution is served whatever it says


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL
    # vLLM's: the client's key for the image in its caches. Accepted and not needed: an image's digest (its bytes'
    # hash) keys our caches and its KV.
    uuid: str | None = None


class ImageEmbedsPart(StrictModel):
    """vLLM's image_embeds part (served with --enable-mm-embeds): an image's embeddings, base64 of a torch.save'd
    tensor or of a .npy array. (vLLM's dict form, extra tensors a model's processor reads, is refused by name.)"""

    type: Literal["image_embeds"]
    image_embeds: str | dict | None = None
    uuid: str | None = None


class PromptEmbedsPart(StrictModel):
    """vLLM's prompt_embeds part (served with --enable-prompt-embeds): rows that stand in the prompt where the part
    is, base64 of a torch.save'd [num_tokens, hidden] tensor or of a .npy array (cluster/api/prompt_embeds.py)."""

    type: Literal["prompt_embeds"]
    data: str


# The other names vLLM's chat takes for a text part, with the fields each may carry: the Responses API's (clients
# replay a Responses conversation in chat) and an assistant's refusal, whose text is the message's.
_TEXT_PARTS = {"input_text": ("text", {"type", "text"}),
               "output_text": ("text", {"type", "text", "annotations", "logprobs"}),
               "refusal": ("refusal", {"type", "refusal"})}


def _canonical_parts(value):
    """input_text / output_text / refusal parts as text parts, input_image (the Responses API's: a URL string) as an
    image_url part, as vLLM's chat reads them; a part with fields they do not have is left to fail validation."""
    if not isinstance(value, list):
        return value
    out = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and set(part) <= _TEXT_PARTS[kind][1]:
            part = {"type": "text", "text": part.get(_TEXT_PARTS[kind][0])}
        elif kind == "input_image" and isinstance(part.get("image_url"), str) and set(part) <= {
                "type", "image_url", "detail"}:
            part = {"type": "image_url", "image_url": {"url": part["image_url"], **(
                {"detail": part["detail"]} if "detail" in part else {})}}
        out.append(part)
    return out


Content = Annotated[
    str | list[Annotated[TextPart | ImagePart | ImageEmbedsPart | PromptEmbedsPart, Field(discriminator="type")]]
    | None,
    one_of('a string or a list of parts: {"type": "text", "text": "..."} (or input_text, output_text, refusal) or '
           '{"type": "image_url", "image_url": {"url": "..."}} (or input_image; images for a model that takes them; '
           '{"type": "image_embeds", "image_embeds": BASE64} with --enable-mm-embeds) or {"type": "prompt_embeds", '
           '"data": BASE64} (with --enable-prompt-embeds); audio and file parts are not supported'),
    BeforeValidator(_canonical_parts),
]


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    # A conversation that already holds tool calls: handed to the chat template as they are.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning (what --reasoning-parser gave back, under either of vLLM's names): handed to
    # the chat template as reasoning_content, the name thinking models' templates read (Qwen3's, DeepSeek's).
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice | None,
    one_of('"none", "auto", "required" or {"type": "function", "function": {"name": "..."}}'),
]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True  # extension (as vLLM)
    # vLLM's: the prompt stops inside the final message (an assistant reply the client began), which the model then
    # continues; needs add_generation_prompt false.
    continue_final_message: bool | None = False
    # vLLM's chat extensions: extra variables for the chat template (e.g. Qwen3's enable_thinking), special
    # tokens added when tokenizing the rendered text (the template writes its own by default).
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = False
    # OpenAI's: how hard a reasoning model thinks; reaches the chat template as ``reasoning_effort`` (gpt-oss's
    # template writes it into its system message), unless chat_template_kwargs names it.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: false leaves the reasoning (with --reasoning-parser) out of the answer, whole and streamed.
    include_reasoning: bool | None = True
    # vLLM's: documents for a retrieval-augmented chat, the chat template's ``documents`` variable (a template that
    # does not render them is a 400).
    documents: list[dict[str, str]] | None = None
    # ... and those served only at their defaults:
    chat_template: str | None = None
    echo: bool | None = False


# ================================================================================== response bodies

TEXT_COMPLETION, CHAT_COMPLETION = "text_completion", "chat.completion"


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def header(request_id: str, object_kind: str, created: int, model: str, chunk: bool) -> dict:
    kind = object_kind + (".chunk" if chunk and object_kind == CHAT_COMPLETION else "")
    return {"id": request_id, "object": kind, "created": created, "model": model}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    """A choice of a text completion, or of one of its stream chunks (same layout)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, content: str | None, logprobs: dict | None, finish_reason: str | None,
                tool_calls: list[dict] | None = None, role: str = "assistant") -> dict:
    message: dict = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      first: bool = False, role: str = "assistant") -> dict:
    """A choice of a chat stream chunk (``first``: the choice's first chunk, which carries the ``role``)."""
    delta = {"role": role, "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    """A choice of a chat stream chunk with a ready ``delta`` (tool calls: cluster/api/tool_parsers/stream.py)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def sse(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``), after ``event: <event>`` when
    given (the Responses API names each event's type)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()
