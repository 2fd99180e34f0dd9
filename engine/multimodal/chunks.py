"""Prefill chunks around images whose tokens attend to each other both ways (Gemma 3: spec.ImageSpec.bidirectional).

A soft token's attention reads the image's later soft tokens, so their keys must be in the cache by the step that
computes it: a chunk may start inside an image (its earlier tokens came from a prefix-cache hit, computed with the
whole image), but never ends inside one. vLLM's --disable-chunked-mm-input, always on for such a model.
"""

from __future__ import annotations


def chunk_outside_images(mm_inputs: list[dict], num_computed: int, num_new: int) -> int:
    """``num_new`` (the tokens a step would compute from ``num_computed`` on) cut back to the start of the image the
    chunk would end inside; 0 when that image starts at ``num_computed`` (the step has no room for it: the request
    waits for a step that has)."""
    end = num_computed + num_new
    for item in mm_inputs:
        start, stop = item["offset"], item["offset"] + item["length"]
        if start < end < stop:
            return max(0, start - num_computed)
    return num_new


def check_images_fit_a_chunk(tokens_per_image: int, prefill_chunk_tokens: int, max_num_batched_tokens: int,
                             model: str) -> None:
    """A step must hold a whole image (ValueError naming the flags otherwise)."""
    room = min(prefill_chunk_tokens, max_num_batched_tokens)
    if tokens_per_image > room:
        raise ValueError(f"{model}: an image's {tokens_per_image} tokens attend to each other both ways, so one step "
                         f"computes them together, but a step holds {room} prompt tokens: raise "
                         "--max-num-batched-tokens (and --long-prefill-token-threshold, where set) to at least "
                         f"{tokens_per_image}, or serve text only with --limit-mm-per-prompt '{{\"image\": 0}}'")
