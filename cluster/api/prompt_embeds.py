"""vLLM's ``prompt_embeds`` (served with --enable-prompt-embeds): on /v1/completions one prompt, or a batch, given as
embeddings; in a chat's messages ``{"type": "prompt_embeds", "data": BASE64}`` parts, rows that stand where the part is
among the chat template's tokens. Each is base64 of a torch.save'd [num_tokens, hidden] tensor (or of a .npy array),
decoded here, in the API process; the engine takes them in place of its embedding table's rows
(engine/prompt_embeds.py).

As vLLM: such prompts come before the text prompts of the same request (their choices' indexes first), echo and
prompt_logprobs are refused (the prompt has no tokens to show), and truncate_prompt_tokens keeps the last (or, with
truncation_side "right", the first) rows."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.tensor_payload import load_tensor
from pdcluster.engine.prompt_embeds import (PLACEHOLDER_TOKEN_ID, PromptEmbeds, prompt_embeds_from_pieces,
                                            prompt_embeds_from_tensor)

PROMPT_EMBEDS_OFF = ("prompt_embeds: prompts as embeddings are off on this server: serve with "
                     "--enable-prompt-embeds")


def _bad(message: str) -> APIError:
    return APIError(400, message, param="prompt_embeds")


@functools.lru_cache(maxsize=8)
def model_hidden_size(model_dir: str | None) -> int | None:
    """The language model's hidden size, from the checkpoint's config.json (its text_config's for a model that
    takes images); None where it does not say (the workers check the width then)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (TypeError, OSError, ValueError):
        return None
    hidden = {**cfg, **(cfg.get("text_config") or {})}.get("hidden_size")
    return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None


def given_prompt_embeds(payload, *, enabled: bool, echo: bool, prompt_logprobs: bool, keep: int | None,
                        keep_first: bool, max_model_len: int, max_prompts: int,
                        hidden_size: int | None) -> list[PromptEmbeds]:
    """The request's ``prompt_embeds`` (one base64 string or a list of them) decoded, in order; a 400 naming the
    entry for anything wrong. ``keep``: vLLM's truncate_prompt_tokens (-1: max_model_len); ``hidden_size``: the
    model's (None: not known here)."""
    if not enabled:
        raise APIError(400, PROMPT_EMBEDS_OFF, param="prompt_embeds", code="unsupported_parameter")
    if echo:
        raise _bad("echo is not supported with prompt_embeds: the prompt has no text to echo")
    if prompt_logprobs:
        raise APIError(400, "prompt_logprobs is not compatible with prompt_embeds: the prompt has no tokens to score",
                       param="prompt_logprobs")
    batch = payload if isinstance(payload, list) else [payload]
    if not batch:
        raise _bad("prompt_embeds is an empty list: give at least one prompt's embeddings")
    if len(batch) > max_prompts:
        raise _bad(f"a batch of at most {max_prompts} prompts is supported, got {len(batch)} in prompt_embeds: split "
                   "it over several requests")
    if keep == -1:
        keep = max_model_len
    out = []
    for i, one in enumerate(batch):
        where = "prompt_embeds" if len(batch) == 1 else f"prompt_embeds[{i}]"
        tensor = loaded_rows(one, where, "prompt_embeds", hidden_size)
        if tensor.dim() == 2 and keep is not None and keep >= 1:  # another value is refused by its own check
            tensor = tensor[:keep] if keep_first else tensor[-keep:]
        try:
            out.append(prompt_embeds_from_tensor(tensor, where))
        except ValueError as e:
            raise _bad(str(e)) from None
    return out


# A chat's prompt_embeds part is rendered by the chat template as this marker (its index among the request's parts),
# then the rendered text is tokenized piece by piece around the markers and each marker's place takes the part's
# rows (vLLM registers a special token for the same purpose: a boundary the tokenizer does not merge across).
_MARKER = "<|pdcluster_prompt_embeds_{}|>"
_MARKER_RE = re.compile(r"<\|pdcluster_prompt_embeds_(\d+)\|>")


def chat_marker(index: int) -> str:
    return _MARKER.format(index)


def chat_prompt_embeds(text: str, payloads: list[str], tokenizer, add_special_tokens: bool, *,
                       hidden_size: int | None) -> tuple[list[int], PromptEmbeds]:
    """The rendered chat ``text`` holding one marker per prompt_embeds part (``payloads``: each part's base64) as the
    prompt's ids, each part's rows standing where its marker was (placeholder ids there), and the rows."""
    tensors = [loaded_rows(payload, f"messages: prompt_embeds part {i}", "messages", hidden_size)
               for i, payload in enumerate(payloads)]
    ids, offsets, found, last = [], [], [], 0
    for match in _MARKER_RE.finditer(text):
        ids += tokenizer.encode(text[last:match.start()], add_special_tokens=add_special_tokens and not ids)
        index = int(match.group(1))
        if index >= len(tensors) or index in found:
            raise _chat_bad(f"a prompt_embeds part's marker {_MARKER.format('N')!r} appears where no part put it: "
                            "text may not hold it (nor may a chat template repeat a message's content)")
        found.append(index)
        offsets.append(len(ids))
        ids += [PLACEHOLDER_TOKEN_ID] * tensors[index].shape[0]
        last = match.end()
    ids += tokenizer.encode(text[last:], add_special_tokens=add_special_tokens and not ids)
    if sorted(found) != list(range(len(tensors))):  # (a repeated one was refused above: text may have written it)
        raise _chat_bad("the chat template did not render each prompt_embeds part (a template that drops a "
                        "message's content cannot take them)")
    names = [f"messages: prompt_embeds part {i}" for i in found]
    try:
        return ids, prompt_embeds_from_pieces([tensors[i] for i in found], offsets, names)
    except ValueError as e:
        raise _chat_bad(str(e)) from None


def loaded_rows(payload, where: str, param: str, hidden_size: int | None):
    """One prompt_embeds payload (a completion's or a chat part's) as its tensor, [1, n, hidden] taken as [n, hidden];
    a 400 naming ``where`` (``param`` the field) for bytes that are no tensor or rows of another width than the
    model's (``hidden_size``; None: not known here, the workers check)."""
    tensor = load_tensor(payload, "prompt_embeds", where, param)
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() == 2 and hidden_size is not None and tensor.shape[1] != hidden_size:
        raise APIError(400, f"{where}: hidden size {tensor.shape[1]} does not match the model's hidden size "
                            f"{hidden_size}", param=param)
    return tensor


def _chat_bad(message: str) -> APIError:
    return APIError(400, message if message.startswith("messages") else f"messages: {message}", param="messages")
