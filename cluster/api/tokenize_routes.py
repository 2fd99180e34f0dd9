"""POST /tokenize and POST /detokenize, as vLLM serves them.

/tokenize: ``{"model"?, "prompt", "add_special_tokens"?: true}`` or ``{"model"?, "messages",
"add_generation_prompt"?: true, "continue_final_message"?: false, "add_special_tokens"?: false}`` (the chat
template rendered as chat completions renders it), ``"return_token_strs"?`` -> ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs``: the vocabulary's strings, null unless asked for).
/detokenize: ``{"model"?, "tokens"}`` -> ``{"prompt"}`` (special tokens kept, as vLLM).

Both sit next to /v1 (not under it, as vLLM) behind the same API key.
"""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import FastAPI
from pdcluster.cluster.api.images import chat_images, expand_images
from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import ChatMessage, one_of, StrictModel, short
from pdcluster.cluster.api.validation import chat_prompt_text, chat_template_kwargs, check_model


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    return_token_strs: bool | None = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[int], one_of("a list of token ids")]


def _tokenize(body: TokenizeRequest, tokenizer, images: list[bytes], max_images: int,
              mm_processor_kwargs: str = "") -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    text = chat_prompt_text(body.messages, body.add_generation_prompt is not False, tokenizer,
                            template_kwargs=chat_template_kwargs(body.chat_template_kwargs),
                            continue_final_message=bool(body.continue_final_message))
    # The template spells its own special tokens: by default none are added (as chat completions).
    ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    if images:  # each image as its placeholders, as the request would be (LLaVA-NeXT's count follows its size)
        ids, _ = expand_images(ids, images, tokenizer, max_images, mm_processor_kwargs=mm_processor_kwargs)
    return ids


def install_tokenize_routes(app: FastAPI, router, served_names: tuple[str, ...],
                            media: MediaPolicy = MediaPolicy()) -> None:
    tokenizer = router.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:  # an adapter shares the base model's tokenizer
            check_model(body.model, served_names, router.lora_names)
        max_images = router.max_images_per_prompt
        images = await chat_images(body.messages, tokenizer, max_images, media) if body.messages else []
        ids = await anyio.to_thread.run_sync(_tokenize, body, tokenizer, images, max_images,
                                             router.mm_processor_kwargs)
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": router.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            check_model(body.model, served_names, router.lora_names)
        vocab_size = tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: token ids out of range [0, {vocab_size}): {short(bad[:5])}",
                           param="tokens")
        text = await anyio.to_thread.run_sync(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
        return {"prompt": text}
