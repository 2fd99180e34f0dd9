"""A step's image rows: which packed rows are image placeholders and the embeddings they take.

An image is encoded once, where the first chunk covering its placeholders runs, and kept by digest in a small
LRU cache: the chunks after it (chunked prefill), a preempted request's recompute and other requests with the
same image read it from there.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

# Embeddings kept (LLaVA 1.5: 576 x 4096 bf16 = 4.7 MB an image).
CACHE_IMAGES = 64


class ImageEmbeds:
    def __init__(self, encoder, capacity: int = CACHE_IMAGES):
        self.encoder = encoder
        self.capacity = capacity
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder (tests: the cache serves the rest)

    def clear(self) -> None:
        self._cache.clear()

    def for_step(self, starts_np: np.ndarray, q_lens_np: np.ndarray, params_of_row) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed row indices [n] int64 on the device, embeddings [n, hidden]) for the step's rows
        ``start .. start + q_len`` (``params_of_row(i)``: row i's SamplingParams), or None when no row reads an
        image placeholder."""
        rows: list[np.ndarray] = []
        pieces: list[tuple[str, int, int]] = []
        wanted: dict[str, dict] = {}
        first = 0
        for i, (start, q_len) in enumerate(zip(starts_np.tolist(), q_lens_np.tolist())):
            items = params_of_row(i).mm_inputs
            if items:
                end = start + q_len
                for item in items:
                    lo, hi = max(item["offset"], start), min(item["offset"] + item["length"], end)
                    if lo < hi:
                        rows.append(np.arange(first + lo - start, first + hi - start, dtype=np.int64))
                        pieces.append((item["digest"], lo - item["offset"], hi - item["offset"]))
                        if item["digest"] not in self._cache:
                            wanted[item["digest"]] = item
            first += q_len
        if not pieces:
            return None
        held = {d: self._cache[d] for d, _, _ in pieces if d in self._cache}
        given = [d for d, item in wanted.items() if "embeds" in item]  # embeddings given: no tower runs
        held.update((d, self._given(wanted[d])) for d in given)
        digests = [d for d in wanted if d not in held]
        if digests:
            held.update(zip(digests, self.encoder.encode([wanted[d]["data"] for d in digests])))
            self.num_encoded += len(digests)
        for digest in held:  # most recently used last
            self._cache[digest] = held[digest]
            self._cache.move_to_end(digest)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        embeds = torch.cat([held[d][lo:hi] for d, lo, hi in pieces])
        row_ids = torch.from_numpy(np.concatenate(rows)).to(embeds.device)
        return row_ids, embeds

    def _given(self, item: dict) -> torch.Tensor:
        """An image's embeddings as the request gave them, in the model's dtype on its device."""
        dtype, num_rows, hidden = item["embeds"]
        flat = torch.frombuffer(bytearray(item["data"]), dtype=torch.uint8).view(getattr(torch, dtype))
        return flat.reshape(num_rows, hidden).to(self.encoder.device, self.encoder.dtype)
