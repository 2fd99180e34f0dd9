"""What a request hands in for an image besides its encoded bytes (its embeddings, vLLM's embedding inputs), and the
error a client is shown for images that do not fit. Below spec.py and images.py, which both read them."""

from __future__ import annotations

from dataclasses import dataclass


class ImageInputError(ValueError):
    """A request's images do not fit its prompt or cannot be read (a 400 at the API)."""


EMBED_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes an element


@dataclass(frozen=True)
class ImageEmbedding:
    """An image given as its embeddings, [rows, hidden] in ``dtype`` (vLLM's embedding inputs: what the projector
    would make of it), ``data`` their raw little-endian bytes: its placeholders are its rows, no tower runs."""

    data: bytes
    rows: int
    hidden: int
    dtype: str
