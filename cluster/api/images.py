"""Images in chat messages (OpenAI's ``image_url`` parts, vLLM's ``image_embeds``): what the model takes, fetching
each image or decoding its embeddings, and the prompt's image tokens widened to the model's placeholders
(engine/multimodal/).

A ``data:`` URL carries the image itself (base64); an http(s) URL is fetched by this process, within
``VLLM_IMAGE_FETCH_TIMEOUT`` seconds (vLLM's variable, default 5) and ``MAX_IMAGE_BYTES``, from the hosts the
server's MediaPolicy allows (cluster/api/media_policy.py); a ``file:`` URL is read from under its
--allowed-local-media-path, when one is set. A prompt's image count is checked before anything is fetched. Every
image is opened here once, so an unreadable one is a 400 naming it, never a failed step on a worker.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import anyio
import httpx

from pdcluster.cluster.api.media_policy import MediaPolicy
from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.tensor_payload import load_tensor
from pdcluster.engine.multimodal.images import image_inputs, open_image
from pdcluster.engine.multimodal.limits import image_processor_kwargs
from pdcluster.engine.multimodal.spec import ImageEmbedding, ImageInputError, ImageSpec, check_image_count

MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 5.0
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer image_data item is no path


@functools.lru_cache(maxsize=8)
def _spec_of_dir(model_dir: str, mm_processor_kwargs: str) -> ImageSpec | None:
    return ImageSpec.from_dir(model_dir, image_processor_kwargs(mm_processor_kwargs))


def image_spec(tokenizer, mm_processor_kwargs: str = "") -> ImageSpec | None:
    """The served model's image spec (None: it takes no images), read from its directory's config.json, under the
    workers' --mm-processor-kwargs (Router.mm_processor_kwargs: the placeholders an image takes may follow it)."""
    model_dir = getattr(tokenizer, "model_dir", None)
    return None if model_dir is None else _spec_of_dir(str(model_dir), mm_processor_kwargs)


def image_parts(messages) -> list:
    """The messages' image parts (image_url and image_embeds), in order."""
    return [part for m in messages if isinstance(m.content, list) for part in m.content
            if part.type in ("image_url", "image_embeds")]


def _fetch_timeout_s() -> float:
    try:
        return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", DEFAULT_FETCH_TIMEOUT_S))
    except ValueError:
        return DEFAULT_FETCH_TIMEOUT_S


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param="messages")


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad(where, "a data URL must be base64: data:image/png;base64,...")
    return _base64_image(payload, where, "the data URL's base64 does not decode")


def _base64_image(payload: str, where: str, undecodable: str) -> bytes:
    """An image's bytes from its base64 (``undecodable``: what a 400 says when it is not base64)."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, undecodable) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _bad(where, f"the image has {len(data)} bytes, more than {MAX_IMAGE_BYTES}")
    return data


def _local_file(url: str, where: str, root: Path | None) -> bytes:
    if root is None:
        raise _bad(where, "file: URLs are off: serve with --allowed-local-media-path DIR to read images under DIR")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _bad(where, f"a file: URL names a file of this machine (file:///path), got host {parts.netloc!r}")
    name = url2pathname(parts.path)
    if "\x00" in name:  # %00: no file has it in its name (and resolving it would raise)
        raise _bad(where, f"{url} holds a NUL byte")
    path = Path(name).resolve()
    if not path.is_relative_to(root):
        raise _bad(where, f"{url} is outside --allowed-local-media-path {root}")
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise _bad(where, f"{url} holds {size} bytes, more than {MAX_IMAGE_BYTES}")
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise _bad(where, f"{url}: no such file") from None
    except OSError as e:
        raise _bad(where, f"{url} cannot be read: {e.strerror or e}") from None


async def _http(url: str, where: str, media: MediaPolicy) -> bytes:
    timeout = _fetch_timeout_s()

    async def check_host(request: httpx.Request) -> None:  # the URL's and each redirect's
        if not media.allows_host(request.url.host):
            raise _bad(where, f"{request.url} is not on an allowed host (--allowed-media-domains: "
                              f"{', '.join(media.allowed_media_domains)})")

    try:
        with anyio.fail_after(timeout):
            async with httpx.AsyncClient(follow_redirects=True, timeout=timeout,
                                         event_hooks={"request": [check_host]}) as client:
                async with client.stream("GET", url) as answer:
                    if answer.status_code != 200:
                        raise _bad(where, f"fetching {url} answered HTTP {answer.status_code}")
                    body = bytearray()
                    async for chunk in answer.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_IMAGE_BYTES:
                            raise _bad(where, f"{url} holds more than {MAX_IMAGE_BYTES} bytes")
                    return bytes(body)
    except TimeoutError:
        raise _bad(where, f"fetching {url} took more than {timeout:g} s (VLLM_IMAGE_FETCH_TIMEOUT)") from None
    except httpx.HTTPError as exc:
        raise _bad(where, f"fetching {url} failed: {exc}") from None


async def fetch_image(url: str, where: str, media: MediaPolicy = MediaPolicy()) -> bytes:
    """The image a URL names, as encoded bytes, checked to open as an image."""
    if url.startswith("data:"):
        data = _data_url(url, where)
    elif url.startswith(("http://", "https://")):
        data = await _http(url, where, media)
    elif url.startswith("file:"):
        data = await anyio.to_thread.run_sync(_local_file, url, where, media.allowed_local_media_path)
    else:
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise _bad(where, f"image URLs are data: (base64), http(s): or file: (under --allowed-local-media-path) "
                          f"URLs, got {scheme!r}")
    return await _opened(data, where)


async def _opened(data: bytes, where: str) -> bytes:
    """``data``, checked to open as an image (an unreadable one is a 400 naming it, never a failed step)."""
    try:
        await anyio.to_thread.run_sync(open_image, data, where)
    except ImageInputError as e:
        raise _bad(where, str(e).removeprefix(f"{where}: ")) from None
    return data


def _spec_taking(tokenizer, num_images: int, max_images: int, param: str, parts: str = "") -> ImageSpec:
    """The served model's image spec, where it takes images and ``num_images`` of them (vLLM's
    --limit-mm-per-prompt), else a 400 naming ``param``: checked before anything is fetched or decoded."""
    spec = image_spec(tokenizer)
    if spec is None:
        raise APIError(400, f"{param}: this model takes no images{parts}; send text", param=param,
                       code="unsupported_content")
    try:
        check_image_count(num_images, max_images)
    except ImageInputError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_content") from None
    return spec


async def chat_images(messages, tokenizer, max_images: int,
                      media: MediaPolicy = MediaPolicy()) -> list[bytes | ImageEmbedding]:
    """The messages' images, fetched, or given as embeddings (400 for a model that takes none, or for more than
    ``max_images``: vLLM's --limit-mm-per-prompt, checked before anything is fetched or decoded)."""
    parts = image_parts(messages)
    if not parts:
        return []
    spec = _spec_taking(tokenizer, len(parts), max_images, "messages", " (image_url parts)")
    kinds = {part.type for part in parts}
    if "image_embeds" in kinds:
        if not media.enable_mm_embeds:
            raise APIError(400, "messages: image_embeds parts are off on this server: serve with --enable-mm-embeds",
                           param="messages", code="unsupported_content")
        if len(kinds) > 1:  # as vLLM: one request's images are all images or all embeddings
            raise APIError(400, "messages: mixing image_url and image_embeds parts in one request is not allowed",
                           param="messages")
    out: list[bytes | ImageEmbedding] = []
    for i, part in enumerate(parts):
        where = f"messages: image {i}"
        if part.type == "image_url":
            out.append(await fetch_image(part.image_url.url, where, media))
        else:
            out.append(await anyio.to_thread.run_sync(decode_embeds, part.image_embeds, where, spec))
    return out


async def generate_images(items: list[str], tokenizer, max_images: int, param: str,
                          media: MediaPolicy = MediaPolicy()) -> list[bytes]:
    """SGLang's ``image_data`` of one prompt (POST /generate), fetched. Each item is what SGLang takes: an http(s)
    URL, a data URL, a ``file:`` URL or a local path (read under --allowed-local-media-path only), or an image's bytes
    in base64; the same checks as a chat's images, errors naming ``param[j]``."""
    if not items:
        return []
    _spec_taking(tokenizer, len(items), max_images, param)
    out = []
    for j, item in enumerate(items):
        try:
            out.append(await _generate_image(item, f"{param}[{j}]", media))
        except APIError as e:
            e.param = param
            raise
    return out


async def _generate_image(item: str, where: str, media: MediaPolicy) -> bytes:
    if item.startswith(("data:", "http://", "https://", "file:")):
        return await fetch_image(item, where, media)
    # A path where local files may be read (SGLang reads any the server can), else base64 (a JPEG's starts with "/").
    # Only a path under the allowed directory is taken as one, judged by its text alone (no file is looked at for
    # megabytes of base64, and a refusal never tells whether a file exists); reading it resolves it (_local_file).
    root = media.allowed_local_media_path
    if root is not None and item.startswith("/") and len(item) <= MAX_PATH_CHARS and "\x00" not in item:
        path = Path(os.path.normpath(item))
        if path.is_relative_to(root):
            return await fetch_image(path.as_uri(), where, media)
    return await _opened(_base64_image("".join(item.split()), where, (
        f"an image is an http(s), data: or file: URL, a local path (with --allowed-local-media-path), or base64 of "
        f"its bytes; got {item[:40]!r}")), where)


def decode_embeds(payload, where: str, spec: ImageSpec) -> ImageEmbedding:
    """An image_embeds part's tensor (base64 of a torch.save'd tensor, unpickled weights-only as vLLM does, or of a
    .npy array, never with pickles: cluster/api/tensor_payload.py), as the ImageEmbedding the engine takes in place of
    the image."""
    if not isinstance(payload, str):
        raise _bad(where, "image_embeds must be one base64 string (a tensor's torch.save or .npy bytes); the dict "
                          "form (extra tensors for a model's processor) is not supported")
    tensor = load_tensor(payload, "image_embeds", where, "messages")
    if tensor.dim() != 2:
        raise _bad(where, f"image_embeds must be one image's [rows, hidden] tensor, got shape {tuple(tensor.shape)}")
    if spec.hidden_size is not None and tensor.shape[1] != spec.hidden_size:
        raise _bad(where, f"image_embeds are {tensor.shape[1]} wide, but this model's hidden size is "
                          f"{spec.hidden_size}")
    try:
        (embedding,) = image_inputs(tensor)
    except ImageInputError as e:
        raise _bad(where, str(e)) from None
    return embedding


def expand_images(ids: list[int], images: list[bytes | ImageEmbedding], tokenizer, max_images: int,
                  param: str = "messages", label: str = "messages",
                  mm_processor_kwargs: str = "") -> tuple[list[int], list[dict]]:
    """The rendered prompt's image tokens widened to the model's placeholders, and the images for the params (a
    prompt with image tokens and no images is a 400: completions take no images)."""
    spec = image_spec(tokenizer, mm_processor_kwargs)
    if spec is None:
        return ids, []
    try:
        return spec.expand(ids, images, max_images)
    except ImageInputError as e:
        raise APIError(400, f"{label}: {e}", param=param) from None


def image_token_text(tokenizer) -> str | None:
    spec = image_spec(tokenizer)
    return None if spec is None else tokenizer.id_to_token(spec.image_token_id)
