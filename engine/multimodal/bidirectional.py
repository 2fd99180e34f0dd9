"""Gemma 3's image attention: an image's soft tokens attend to each other both ways.

transformers masks Gemma 3's attention with OR(causal, same image) on its full layers and AND(sliding window,
OR(causal, same image)) on its sliding ones: a soft token also sees the image's later soft tokens. The paged kernels
are causal; a step with image rows runs them as they are and then computes those rows again here: each image's
queries against its request's cached keys up to the image's last token, keys inside the window where the layer
slides (what vLLM's first Gemma 3 did with its masked attention over the prompt's images). The scheduler never ends a
prefill chunk inside an image (engine/scheduler.py), so a step holding an image's rows holds its last one, and the
keys they need are in the cache when the layer's kernel has written them. One image a call, over its own request:
a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pdcluster.kernels.reference import gather_context


@dataclass(frozen=True)
class ImageSpan:
    """One image's soft tokens in a step: packed query rows ``first_row .. end_row``, their request's batch row
    ``req``, and the image's last position + 1 (``end_pos``) in its sequence."""

    req: int
    first_row: int
    end_row: int
    end_pos: int


def image_spans(image_row_ids: torch.Tensor, query_start_loc_np: np.ndarray, seq_lens_np: np.ndarray) -> list[ImageSpan]:
    """The step's image spans: runs of consecutive image rows within one request (the frame's <start_of_image> and
    <end_of_image> keep two images of a prompt apart)."""
    rows = image_row_ids.cpu().numpy()
    if rows.size == 0:
        return []
    reqs = np.searchsorted(query_start_loc_np, rows, side="right") - 1
    cuts = np.flatnonzero((np.diff(rows) != 1) | (np.diff(reqs) != 0)) + 1
    out = []
    for first, last in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [rows.size]])):
        lo, hi, r = int(rows[first]), int(rows[last - 1]) + 1, int(reqs[first])
        q_len = int(query_start_loc_np[r + 1] - query_start_loc_np[r])
        start_pos = int(seq_lens_np[r]) - q_len + (lo - int(query_start_loc_np[r]))
        out.append(ImageSpan(r, lo, hi, start_pos + hi - lo))
    return out


def attend_images_both_ways(query: torch.Tensor, out: torch.Tensor, layer_cache: torch.Tensor,
                            block_tables: torch.Tensor, spans: list[ImageSpan], scale: float, window: int = 0) -> None:
    """``out``'s image rows (from the causal kernel) replaced: each span's queries [rows, Hq, D] over its request's
    keys ``0 .. end_pos - 1``, within the last ``window`` positions of each query where > 0."""
    group = query.shape[1] // layer_cache.shape[3]
    for span in spans:
        k, v = gather_context(layer_cache, block_tables[span.req], span.end_pos)
        q = query[span.first_row:span.end_row].transpose(0, 1)  # [Hq, n, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)  # [Hq, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
        n = span.end_row - span.first_row
        q_pos = torch.arange(span.end_pos - n, span.end_pos, device=q.device).unsqueeze(1)
        k_pos = torch.arange(span.end_pos, device=q.device).unsqueeze(0)
        mask = k_pos <= span.end_pos - 1  # every key up to the image's last (causal keys included)
        if window > 0:
            mask = mask & (k_pos > q_pos - window)
        else:
            mask = mask.expand(n, -1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[span.first_row:span.end_row] = o.transpose(0, 1)
