"""What `pdcluster profile` measures (the grid of prompt sizes, batches and contexts), apart from how."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. The default takes about a minute and a half for smollm2 (float32, one thread,
    a quiet 2-core box); several times that when other work shares the cores."""

    prefill_sizes: tuple[int, ...] = (32, 128, 256, 512, 1024)
    prefill_batches: tuple[tuple[int, int], ...] = ((4, 128),)  # (prompts, tokens each)
    decode_contexts: tuple[int, ...] = (128, 512, 1024)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_steps: int = 4  # timed steps per grid point (the fastest counts: see least_disturbed)
    mixed: tuple[tuple[int, int, int], ...] = ((4, 512, 256), (16, 512, 128))  # (batch, context, prompt)
    transfer_blocks: tuple[int, ...] = (64, 16, 4, 1)
    reps: int = 2
    corun: bool = True
    served: bool = True  # time a real prefill/decode pair's steps too (served.py)

    @classmethod
    def quick(cls) -> "ProfileGrid":
        """A small grid (tests, tiny models): seconds, not minutes. Five prompt sizes over a 16x spread: with three, a
        busy box's timing noise could hand the whole prefill cost to the attention term (a token coefficient of 0)."""
        return cls(prefill_sizes=(16, 32, 64, 128, 256), prefill_batches=((2, 64),), decode_contexts=(64, 256),
                   decode_batches=(1, 4, 8), decode_steps=2, mixed=((4, 64, 64),), transfer_blocks=(8, 2),
                   reps=2, corun=False, served=False)


def with_grid_overrides(grid: ProfileGrid, **overrides) -> ProfileGrid:
    return replace(grid, **{k: v for k, v in overrides.items() if v is not None})
