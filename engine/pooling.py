"""Embeddings: what becomes of a pooled vector (RequestOutput.pooled) before a client sees it.

The engine pools (engine/model_runner.py ``_pooling_step``: the last prompt position's final hidden state, or
their mean); these are the steps after it, shared by ``LLMEngine.embed`` and the HTTP API's /v1/embeddings.
"""

from __future__ import annotations

import numpy as np

_NORM_EPS = 1e-12  # torch.nn.functional.normalize's: a zero vector stays zero


def finish_embedding(pooled: np.ndarray, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """``pooled`` cut to its first ``dimensions`` entries (a matryoshka model's shorter embedding), then scaled to
    unit L2 norm where ``normalize`` (as vLLM's embed pooler and sentence-transformers' Normalize, in that order)."""
    vec = np.asarray(pooled, dtype=np.float32)
    if vec.ndim != 1:
        raise ValueError(f"a pooled vector is one-dimensional, got shape {vec.shape}")
    if dimensions is not None:
        if not 0 < dimensions <= vec.shape[0]:
            raise ValueError(f"dimensions must be in [1, {vec.shape[0]}], got {dimensions}")
        vec = vec[:dimensions]
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), _NORM_EPS)
    return vec


def finish_token_embeddings(rows: np.ndarray, normalize: bool = True) -> np.ndarray:
    """A "token_embed" request's rows [num_tokens, hidden], each scaled to unit L2 norm where ``normalize`` (vLLM's
    token_embed head)."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"token embeddings are [num_tokens, hidden], got shape {rows.shape}")
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), _NORM_EPS) if normalize else rows


def pooled_bytes(pooled: np.ndarray | None) -> bytes:
    """A pooled vector as it crosses processes (worker events, the control plane): float32 little-endian; b"" for
    none. A fraction of a msgpack float list's size, and no float64 round trip."""
    return b"" if pooled is None else np.asarray(pooled, dtype="<f4").tobytes()


def pooled_vector(data: bytes) -> np.ndarray:
    """``pooled_bytes``' inverse."""
    if len(data) % 4:
        raise ValueError(f"a pooled vector is float32: {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)
