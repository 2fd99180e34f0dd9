"""A paged context for attention kernel tests: request 0 (the target) and other requests, their cached vectors in a
paged cache with scattered blocks (unused slots NaN: a kernel reading past a context turns its rows NaN). The
target's query for each position is fixed, the others' are drawn per call, so a test can put the target's rows in
any batch and compare their bits (tests/test_triton_deterministic.py: K and V planes; tests/test_triton_mla.py: one
latent plane)."""

from __future__ import annotations

import torch


class TargetContext:
    def __init__(self, lens: tuple[int, ...], block_size: int, num_planes: int, num_q_heads: int, num_kv_heads: int,
                 width: int, dtype: torch.dtype, device: str, seed: int):
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks) + 2
        pool = torch.randperm(num_blocks, generator=gen)
        self.cache = torch.full((num_planes, num_blocks, block_size, num_kv_heads, width), float("nan"), dtype=dtype)
        self.tables = torch.full((len(lens), max(blocks) + 1), int(pool[-1]), dtype=torch.int32)
        start = 0
        for r, (n, b) in enumerate(zip(lens, blocks)):
            ids = pool[start : start + b]
            start += b
            self.tables[r, :b] = ids.to(torch.int32)
            pos = torch.arange(n)
            slots = ids[pos // block_size] * block_size + pos % block_size
            for plane in range(num_planes):  # K then V, or the one latent vector
                vec = torch.randn(n, num_kv_heads, width, generator=gen).to(dtype)
                self.cache[plane].view(-1, num_kv_heads, width)[slots] = vec
        self.target_q = torch.randn(lens[0], num_q_heads, width, generator=gen).to(dtype)
        self.num_q_heads, self.width, self.dtype, self.device = num_q_heads, width, dtype, device
        self.scale = width**-0.5
        self.cache, self.tables = self.cache.to(device), self.tables.to(device)

    def batch(self, rows: list[tuple[int, int, int]]):
        """``rows``: (request, first position, number of query tokens) a request of one call. Returns the call's
        arguments (query, cache, tables, seq_lens, query_start_loc, scale) and, for the target's query positions,
        their row in the output."""
        gen = torch.Generator().manual_seed(11)
        queries, starts, seq_lens, target_at = [], [0], [], {}
        for req, first, q_len in rows:
            if req == 0:
                q = self.target_q[first : first + q_len]
                target_at.update({first + i: starts[-1] + i for i in range(q_len)})
            else:
                q = torch.randn(q_len, self.num_q_heads, self.width, generator=gen).to(self.dtype)
            queries.append(q)
            starts.append(starts[-1] + q_len)
            seq_lens.append(first + q_len)
        order = [req for req, _, _ in rows]
        args = (torch.cat(queries).to(self.device), self.cache, self.tables[order],
                torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                torch.tensor(starts, dtype=torch.int32, device=self.device), self.scale)
        return args, target_at

    def run(self, launch, rows: list[tuple[int, int, int]], *extra) -> dict[int, torch.Tensor]:
        """The target's output row for each of its query positions, from ``launch(*batch args, *extra)``."""
        args, target_at = self.batch(rows)
        out = launch(*args, *extra)
        return {pos: out[i] for pos, i in target_at.items()}


def invariance_failures(launch, ctx: TargetContext, scenarios, positions) -> list[str]:
    """Where the target's row for one of ``positions`` differs bitwise, in any of ``scenarios`` ((name, rows) a
    batch), from the same query as a decode step alone."""
    alone = {pos: ctx.run(launch, [(0, pos, 1)])[pos] for pos in positions}
    failures = []
    for name, rows in scenarios:
        for pos, row in ctx.run(launch, rows).items():
            if pos in alone and not torch.equal(row, alone[pos]):
                failures.append(f"{name}: position {pos}")
    return failures
