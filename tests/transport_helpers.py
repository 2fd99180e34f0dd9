"""Small helpers the transport-level tests share: random cache contents, byte views, bounded waits."""

from __future__ import annotations

import time

import torch


def fill(cache: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b = cache.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)  # random bytes hold NaNs: always compare bytes


def wait_sent(t, ids: set[str], timeout_s: float) -> tuple[set[str], dict[str, str]]:
    """Poll a sender until every id in ``ids`` is delivered or failed, or ``timeout_s`` passes."""
    done: set[str] = set()
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while ids - done - set(failed) and time.monotonic() < deadline:
        d, f = t.poll_sent()
        done.update(d)
        failed.update(dict(f))
        time.sleep(0.002)
    return done, failed


def wait_until(pred, timeout_s: float = 5.0) -> bool:
    """True as soon as ``pred()`` is (called once per try: it may consume, e.g. poll_received)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True
