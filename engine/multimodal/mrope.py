"""Qwen2-VL's M-RoPE for image prompts, on the engine's one-position rotary kernels.

M-RoPE gives every token three positions (time, row, column) and rotates each frequency of a head by one of them:
the config's ``mrope_section`` splits the head's frequencies into three runs, the first rotated by the time
position, the second by the row, the third by the column (transformers' ``recomposition_frequencies``; Qwen3-VL
interleaves them: ``frequency_axes``). A text token's
three positions are equal, so for text it is plain RoPE at one position; an image's placeholders take the image's
start position in time, start + row in height and start + column in width (one per merged patch), and the text after
an image continues from start + max(rows, columns), not from start + rows * columns: every position from the first
image on is shifted by each earlier image's ``max(rows, cols) - rows * cols`` (never positive).

So the engine keeps one position a token (its rotary kernels, the decode CUDA graphs' buffers, the KV slots, none
changed) and:
- a text or decode token's rotary position is its sequence position plus the shift of the images before it
  (``rope_positions``; a request's total shift, ``RopeLayout.delta``, is what its decode steps add);
- an image placeholder computed in this step points past the table's positions at a scratch row, into which the
  step writes that token's mixed cos / sin (the time section's from the time position's row, and so on). Image rows
  only occur in prompt chunks, which run eagerly: the graphs never read a scratch row.
The layout is a function of the request's images and their sizes, so a preempted request's recompute, the decode
worker of a disaggregated pair (it gets the request's images in its SamplingParams) and a resumed request give every
token the positions the first run gave it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.multimodal.images import image_size
from pdcluster.engine.multimodal.spec import ImageInputError, ImageSpec


@dataclass(frozen=True)
class RopeLayout:
    """A request's images as M-RoPE sees them: each image's (offset, length, columns, shift before it, shift after
    it) in prompt order, and ``delta``, the shift of every position after the last image."""

    images: tuple[tuple[int, int, int, int, int], ...]
    delta: int
    end: int  # the last image's end: sequence positions from here on all shift by ``delta``


def rope_layout(spec: ImageSpec, mm_inputs: list[dict]) -> RopeLayout | None:
    """The layout of a request's images (None without images)."""
    if not mm_inputs:
        return None
    images, shift = [], 0
    for i, item in enumerate(mm_inputs):
        if "embeds" in item:
            raise ImageInputError(spec.embeddings_refused(i))
        width, height = image_size(item["data"], f"image {i}")
        rows, cols = spec.patches.merged_grid(height, width)
        if rows * cols != item["length"]:
            raise ImageInputError(f"image {i}: {item['length']} placeholders for a {rows} x {cols} grid")
        after = shift + max(rows, cols) - rows * cols
        images.append((item["offset"], item["length"], cols, shift, after))
        shift = after
    last = images[-1]
    return RopeLayout(tuple(images), shift, last[0] + last[1])


def mrope_sections(cfg: dict, head_dim: int, where: str = "config.json") -> tuple[tuple[int, int, int], bool]:
    """(``mrope_section``, interleaved) of a Qwen-VL config (text_config's rope_scaling / rope_parameters, or the top
    level's); Qwen3-VL's are interleaved (its own model type, or ``mrope_interleaved``)."""
    interleaved = cfg.get("model_type") in ("qwen3_vl", "qwen3_vl_moe")
    for scope in (cfg.get("text_config") or {}, cfg):
        for key in ("rope_parameters", "rope_scaling"):
            params = scope.get(key)
            if isinstance(params, dict) and "mrope_section" in params:
                sections = tuple(int(n) for n in params["mrope_section"])
                if len(sections) != 3 or sum(sections) != head_dim // 2:
                    raise ValueError(f"{where}: mrope_section {list(sections)} must be three runs summing to "
                                     f"head_dim / 2 = {head_dim // 2}")
                return sections, bool(params.get("mrope_interleaved", interleaved))
    raise ValueError(f"{where}: no mrope_section in rope_scaling / rope_parameters")


def frequency_axes(sections: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """The axis (0 time, 1 row, 2 column) each of a head's frequencies turns by: three runs (Qwen2-VL's
    ``recomposition_frequencies``), or interleaved t, h, w, t, h, w, ... while each axis has frequencies left, then
    time (Qwen3-VL's ``apply_interleaved_mrope``: frequency j is the row's where j % 3 == 1 and j < 3 * sections[1],
    the column's where j % 3 == 2 and j < 3 * sections[2])."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    j = torch.arange(sum(sections))
    axis = torch.zeros_like(j)
    for dim in (1, 2):
        axis[(j % 3 == dim) & (j < 3 * sections[dim])] = dim
    return axis


class MRope:
    """The scratch rows of a model's rotary tables and the rotary positions of each step."""

    def __init__(self, spec: ImageSpec, rope, sections: tuple[int, int, int], scratch_rows: int,
                 interleaved: bool = False):
        self.spec, self.rope = spec, rope
        self.num_positions = rope.cos_sin.shape[0]
        self.scratch_rows = scratch_rows
        half = rope.cos_sin.shape[1] // 2
        # The axis each frequency turns by, for the [cos | sin] row and HF's [f | f] row.
        axis = frequency_axes(sections, interleaved)
        self._axis_of_col = torch.cat((axis, axis)).to(rope.cos_sin.device)
        if axis.numel() != half:
            raise ValueError(f"mrope_section {list(sections)} does not cover the head's {half} frequencies")
        # Widened once, before any CUDA graph is captured: graphs hold the tables' addresses.
        rope.cos_sin = torch.cat((rope.cos_sin, rope.cos_sin.new_zeros(scratch_rows, rope.cos_sin.shape[1])))
        rope.cos = torch.cat((rope.cos, rope.cos.new_zeros(scratch_rows, rope.cos.shape[1])))
        rope.sin = torch.cat((rope.sin, rope.sin.new_zeros(scratch_rows, rope.sin.shape[1])))

    def layout(self, params) -> RopeLayout | None:
        return rope_layout(self.spec, params.mm_inputs)

    def rope_positions(self, positions_np: np.ndarray, query_start_loc_np: np.ndarray, deltas_np: np.ndarray,
                       ends_np: np.ndarray, layout_of) -> np.ndarray:
        """Each packed token's rotary position: ``positions_np`` (sequence positions) shifted by ``deltas_np`` (each
        row's request's ``delta``), and for the rows that start before their request's last image ends
        (``ends_np``; ``layout_of(row)`` their layout), per token, the image placeholders at scratch rows this call
        fills. A decode step (every row past its images) is two numpy operations."""
        out = positions_np + np.repeat(deltas_np, np.diff(query_start_loc_np)) if deltas_np.any() else positions_np
        covering = np.flatnonzero(positions_np[query_start_loc_np[:-1]] < ends_np) if len(positions_np) else ()
        scratch: list[np.ndarray] = []  # [3, n] (time, row, column) of each image token, in packed order
        num_scratch = 0
        for r in np.asarray(covering).tolist():
            layout = layout_of(r)
            lo, hi = int(query_start_loc_np[r]), int(query_start_loc_np[r + 1])
            if out is positions_np:
                out = positions_np.copy()
            seq = positions_np[lo:hi]
            rope = seq.copy()  # text before the first image: its own position
            for offset, length, _, _, after in layout.images:  # text after an image: the shift so far
                past = seq >= offset + length
                rope[past] = seq[past] + after
            for offset, length, cols, shift, _ in layout.images:
                inside = (seq >= offset) & (seq < offset + length)
                if not inside.any():
                    continue
                k = seq[inside] - offset
                start = offset + shift
                tokens = np.stack((np.full_like(k, start), start + k // cols, start + k % cols))
                rope[inside] = self.num_positions + num_scratch + np.arange(tokens.shape[1])
                scratch.append(tokens)
                num_scratch += tokens.shape[1]
            out[lo:hi] = rope
        if scratch:
            self._fill(np.concatenate(scratch, axis=1))
        return out

    def _fill(self, thw_np: np.ndarray) -> None:
        """Scratch rows 0.. of the tables: each image token's mixed cos / sin from its three positions' rows."""
        n = thw_np.shape[1]
        if n > self.scratch_rows:
            raise RuntimeError(f"{n} image tokens in one step, more than the {self.scratch_rows} M-RoPE scratch rows")
        rope = self.rope
        thw = torch.from_numpy(thw_np).to(rope.cos_sin.device)
        rows = slice(self.num_positions, self.num_positions + n)
        for table in (rope.cos_sin, rope.cos, rope.sin):
            per_axis = table[thw.reshape(-1)].view(3, n, table.shape[1])  # [axis, token, column]
            pick = self._axis_of_col.to(table.device)[None, None, :].expand(1, n, table.shape[1])
            table[rows] = per_axis.gather(0, pick)[0]
