"""Step inputs from the host to the model's device.

The runner builds each step's inputs (token ids, positions, slot mapping, block tables, ...) in numpy on
the host. On the CPU they are used as they are (``torch.from_numpy``: no copy). On a GPU each goes
through a persistent pinned host buffer into a persistent device buffer with one non-blocking copy, so
preparing a step never blocks on the GPU and never allocates:

- two sets of pinned host buffers, alternating per step: the host may fill step n + 1's inputs while
  the GPU may still be reading step n's out of pinned memory (the step's one synchronisation, on the
  sampled ids, happens before step n + 2 reuses a set);
- one set of device buffers: a copy into them is queued on the stream behind the previous step's
  kernels, so it cannot overwrite inputs a running kernel still reads;
- buffers grow (doubling) when a step needs more; a CUDA graph captured over them must be re-captured
  then, which ``generation`` tells.
"""

from __future__ import annotations

import numpy as np
import torch


def to_host_async(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: itself on a CPU, else a non-blocking copy into pinned memory (read it only
    after the copy finished, e.g. behind a CUDA event recorded after it)."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


class StepInputs:
    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.on_host = self.device.type == "cpu"
        self._host: list[dict[str, torch.Tensor]] = [{}, {}]
        self._dev: dict[str, torch.Tensor] = {}
        self._set = 0
        self.generation = 0  # bumped whenever a device buffer is reallocated

    def begin_step(self) -> None:
        """Switch to the other pinned set (call once per step, before the first ``put``)."""
        self._set ^= 1

    def put(self, name: str, array_np: np.ndarray) -> torch.Tensor:
        """``array_np`` as a tensor on the device (same shape and dtype)."""
        array_np = np.ascontiguousarray(array_np)
        src = torch.from_numpy(array_np)
        if self.on_host:
            return src
        n = src.numel()
        dev = self._buffer(name, n, src.dtype)
        host = self._host[self._set][name][:n]
        host.copy_(src.view(-1))
        out = dev[:n]
        out.copy_(host, non_blocking=True)
        return out.view(src.shape)

    def device_buffer(self, name: str) -> torch.Tensor | None:
        """The whole device buffer behind ``name`` (for graph capture), if it exists."""
        return self._dev.get(name)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        dev = self._dev.get(name)
        if dev is None or dev.numel() < numel or dev.dtype != dtype:
            capacity = max(numel, 2 * dev.numel() if dev is not None and dev.dtype == dtype else 256)
            self._dev[name] = dev = torch.empty(capacity, dtype=dtype, device=self.device)
            for host_set in self._host:
                host_set[name] = torch.empty(capacity, dtype=dtype, pin_memory=True)
            self.generation += 1
        return dev
