"""Step inputs from the host to the model's device.

The runner builds each step's inputs (token ids, positions, slot mapping, block tables, ...) in numpy on
the host. On the CPU they are used as they are (``torch.from_numpy``: no copy). On a GPU a step's arrays
are packed into one persistent pinned host arena and go to one persistent device arena in one
non-blocking copy (``put_many``), so preparing a step never blocks on the GPU, never allocates, and
launches one copy instead of one per array (each a host call of ~10 us on the H100 machine):

- two pinned host arenas, alternating per step: the host may fill step n + 1's inputs while the GPU
  may still be reading step n's out of pinned memory. Step n + 2 reuses step n's arena only once an
  event recorded behind step n's last copy has passed: a step that samples nothing (a prompt's middle
  chunk) has no synchronisation of its own, and under async scheduling the host was seen on an H200
  refilling an arena whose copy had not run (the kernels then read another step's slots and block
  tables: an illegal address);
- within a step each ``put_many`` takes the arenas' next free bytes: a later put (the sampler's
  logprob rows) never overwrites pinned bytes whose copy may not have run yet;
- one device arena: a copy into it is queued on the stream behind the previous step's kernels, so it
  cannot overwrite inputs a running kernel still reads;
- arenas grow (doubling) when a step needs more; tensors handed out before keep the old storage alive,
  and torch holds a pinned block freed with a copy still pending until that copy ran.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN_BYTES = 16  # every array starts 16-byte aligned: any dtype's view, vector loads
MIN_ARENA_BYTES = 1 << 16


def to_host_async(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: itself on a CPU, else a non-blocking copy into pinned memory (read it only
    after the copy finished, e.g. behind a CUDA event recorded after it)."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


class StepInputs:
    def __init__(self, device: str | torch.device, staged: bool | None = None):
        """``staged``: pack into arenas and copy (default: on any device but the CPU; the CPU tests
        force it to run the packing on host memory)."""
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else staged
        self._pin = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]  # uint8 arenas, one per alternating step
        self._dev: torch.Tensor | None = None  # uint8 arena
        self._set = 0
        # Per host arena: an event behind the last copy out of it (CUDA), waited for before it is refilled.
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._cursor = 0  # first free byte of this step's arenas
        self.num_copies = 0  # host-to-device copies launched (one per put_many)

    def begin_step(self) -> None:
        """Switch to the other host arena (call once per step, before the first put); waits until the
        copies out of it two steps ago have run (at once, unless the GPU is that far behind)."""
        self._set ^= 1
        self._cursor = 0
        copied, self._copied[self._set] = self._copied[self._set], None
        if copied is not None:
            copied.synchronize()

    def put(self, name: str, array_np: np.ndarray) -> torch.Tensor:
        """``array_np`` as a tensor on the device (same shape and dtype)."""
        return self.put_many({name: array_np})[name]

    def put_many(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array as a tensor on the device (same shape and dtype), all in one copy."""
        arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
        if not self.staged:
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        offsets, end = {}, self._cursor
        for name, a in arrays.items():
            offsets[name] = end
            end += -(-a.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        host, dev = self._arenas(end)
        start = self._cursor
        host_np = host.numpy()
        for name, a in arrays.items():
            host_np[offsets[name] : offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
        if end > start:
            dev[start:end].copy_(host[start:end], non_blocking=True)
            self.num_copies += 1
            if self._pin:
                if self._copied[self._set] is None:
                    self._copied[self._set] = torch.cuda.Event()
                self._copied[self._set].record(torch.cuda.current_stream(self.device))
        self._cursor = end
        out = {}
        for name, a in arrays.items():
            dtype = torch.from_numpy(a[:0]).dtype
            out[name] = dev[offsets[name] : offsets[name] + a.nbytes].view(dtype).view(a.shape)
        return out

    def _arenas(self, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's host arena and the device arena, at least ``num_bytes`` each. Growing keeps this
        step's earlier bytes: a copy of them may still be pending (host) or their tensors in use
        (device), so the new arenas start empty below the cursor and only later puts land there."""
        host = self._host[self._set]
        if host is None or host.numel() < num_bytes:
            size = max(MIN_ARENA_BYTES, num_bytes, 2 * (host.numel() if host is not None else 0))
            host = self._host[self._set] = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        if self._dev is None or self._dev.numel() < num_bytes:
            size = max(MIN_ARENA_BYTES, num_bytes, 2 * (self._dev.numel() if self._dev is not None else 0))
            self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        return host, self._dev
