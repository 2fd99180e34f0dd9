"""An image's encoded bytes to pixels (Pillow), with the errors a client should see."""

from __future__ import annotations

import io
import os
from pathlib import Path

from pdcluster.engine.multimodal.inputs import EMBED_DTYPES, ImageEmbedding, ImageInputError

# Pillow refuses larger images as decompression bombs; we name the limit instead of a warning or a traceback.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def open_image(data: bytes, label: str = "image"):
    """The image as an RGB PIL image; ImageInputError for bytes that are no image Pillow reads, or too large."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageInputError(f"{label}: {width}x{height} pixels is more than the {MAX_IMAGE_PIXELS} "
                                      "an image may have")
            return image.convert("RGB")
    except ImageInputError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ImageInputError(f"{label}: cannot be read as an image ({exc})") from None


def image_size(data: bytes, label: str = "image") -> tuple[int, int]:
    """(width, height) of an encoded image, from its header (no decode); ImageInputError as ``open_image``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ImageInputError(f"{label}: cannot be read as an image ({exc})") from None


def image_inputs(images) -> list[bytes | ImageEmbedding]:
    """vLLM's ``multi_modal_data["image"]`` as a list: each image as encoded bytes (``image_bytes``), or, for a tensor
    of embeddings ([rows, hidden], or [images, rows, hidden]: vLLM's embedding inputs), one ImageEmbedding each."""
    out: list[bytes | ImageEmbedding] = []
    for image in images if isinstance(images, (list, tuple)) else [images]:
        if hasattr(image, "dim") and hasattr(image, "dtype"):  # a torch tensor
            out += _embeddings(image)
        else:
            out.append(image_bytes(image))
    return out


def _embeddings(tensor) -> list[ImageEmbedding]:
    import torch

    if tensor.dim() == 2:
        tensor = tensor[None]
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dim() != 3 or 0 in tensor.shape or dtype not in EMBED_DTYPES:
        raise ImageInputError(f"image embeddings must be a [rows, hidden] or [images, rows, hidden] tensor of "
                              f"{', '.join(EMBED_DTYPES)}, got {tuple(tensor.shape)} {dtype}")
    tensor = tensor.detach().to("cpu").contiguous()
    return [ImageEmbedding(t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.shape[0], t.shape[1], dtype)
            for t in tensor]


def image_bytes(image) -> bytes:
    """An image as the encoded bytes a request carries: bytes as they are, a path's file, a PIL image as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return Path(image).read_bytes()
    if hasattr(image, "save"):  # a PIL image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise ImageInputError(f"an image must be bytes, a file path or a PIL image, got {type(image).__name__}")
