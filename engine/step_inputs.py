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
MAX_CACHED_VIEWS = 512  # device-arena views kept for reuse (a steady decode batch asks the same ones each step)


def host_to_device(host: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the work queued there, for inputs outside a step's arena
    (the Mamba row plan, verification's state selection, MTP's metadata, LoRA rows): copied from pinned memory,
    non-blocking. From pageable memory a copy to a GPU waits for the stream, so for a step launched ahead too. The
    pinned block stays the allocator's until its copy ran. On a CPU: the array itself (numpy's as a tensor)."""
    tensor = torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


_TORCH_DTYPE = {np.dtype(d): t for d, t in ((np.int64, torch.int64), (np.int32, torch.int32), (np.int16, torch.int16),
                                            (np.int8, torch.int8), (np.uint8, torch.uint8), (np.bool_, torch.bool),
                                            (np.float64, torch.float64), (np.float32, torch.float32),
                                            (np.float16, torch.float16))}


def to_host_async(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: itself on a CPU, else a non-blocking copy into pinned memory (read it only
    after the copy finished, e.g. behind a CUDA event recorded after it)."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


class HostCopyRing:
    """The sampled ids' device-to-host copy, a step's one synchronisation, into pinned buffers reused round-robin,
    each with its CUDA event: a fresh pinned tensor and event a step cost ~25 us of host time on the H200
    (``torch.empty`` in bench/results/gpu_check_h200.json's decode profile). A slot is refilled NUM_SLOTS copies
    later, when the step that read it is long finished (at most two are in flight: launch-ahead); its event is
    waited for first all the same. On a CPU the tensor is returned as it is."""

    NUM_SLOTS = 4

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None] * self.NUM_SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.NUM_SLOTS
        self._views: list[dict] = [{} for _ in range(self.NUM_SLOTS)]  # (shape) -> view of the slot's buffer
        self._next = 0
        self.num_allocations = 0

    def copy(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(``x`` on the host, the event behind its copy): read the host tensor after ``event.synchronize()``.
        (``x``, None) on a CPU."""
        if x.device.type == "cpu":
            return x, None
        slot = self._next
        self._next = (slot + 1) % self.NUM_SLOTS
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # landed long ago: NUM_SLOTS steps back
        buffer = self._buffers[slot]
        if buffer is None or buffer.dtype != x.dtype or buffer.numel() < x.numel():
            buffer = self._buffers[slot] = torch.empty(max(x.numel(), 256), dtype=x.dtype, pin_memory=True)
            self._views[slot].clear()
            self.num_allocations += 1
        host = self._views[slot].get(x.shape)
        if host is None:
            host = self._views[slot][x.shape] = buffer[: x.numel()].view(x.shape)
        host.copy_(x, non_blocking=True)
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        # On x's device's stream: the runner's thread may have another current device (cuda:N).
        event.record(torch.cuda.current_stream(x.device))
        return host, event


class StepInputs:
    def __init__(self, device: str | torch.device, staged: bool | None = None):
        """``staged``: pack into arenas and copy (default: on any device but the CPU; the CPU tests
        force it to run the packing on host memory)."""
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else staged
        self._pin = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]  # uint8 arenas, one per alternating step
        self._host_np: list[np.ndarray | None] = [None, None]  # their numpy views (``.numpy()`` is 4 torch calls)
        self._dev: torch.Tensor | None = None  # uint8 arena
        self._set = 0
        # Per host arena: an event behind the last copy out of it (CUDA), waited for before it is refilled.
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._cursor = 0  # first free byte of this step's arenas
        self.num_copies = 0  # host-to-device copies launched (one per put_many)
        # (offset, dtype, shape) -> that view of the device arena: each view is three torch calls (~10 us of host
        # time a step on a GPU machine), and a steady decode batch asks the same ones step after step.
        self._views: dict[tuple, torch.Tensor] = {}
        # (tensor id, lo, hi) -> (the tensor, its [lo:hi]): the byte ranges each step's copies go between, the same
        # ones step after step in a steady batch (a slice is a torch call of host time). The tensor is held, so its
        # id is not reused while cached; cleared when an arena is replaced.
        self._ranges: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _range(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``t[lo:hi]``, cached."""
        key = (id(t), lo, hi)
        hit = self._ranges.get(key)
        if hit is None:
            if len(self._ranges) >= MAX_CACHED_VIEWS:
                self._ranges.clear()
            hit = self._ranges[key] = (t, t[lo:hi])
        return hit[1]

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
        host_np = self._host_np[self._set]
        for name, a in arrays.items():
            host_np[offsets[name] : offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
        if end > start:
            self._range(dev, start, end).copy_(self._range(host, start, end), non_blocking=True)  # the one copy
            self.num_copies += 1
            self._record_copy()
        self._cursor = end
        return {name: self._view(dev, offsets[name], a) for name, a in arrays.items()}

    def _view(self, dev: torch.Tensor, offset: int, a: np.ndarray) -> torch.Tensor:
        key = (offset, a.dtype, a.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            dtype = _TORCH_DTYPE.get(a.dtype) or torch.from_numpy(a[:0]).dtype
            view = self._views[key] = dev[offset : offset + a.nbytes].view(dtype).view(a.shape)
        return view

    def put_into(self, dst: torch.Tensor, parts: list[tuple[int, np.ndarray]]) -> None:
        """Each array of ``parts`` at its byte offset of ``dst`` (a persistent uint8 tensor on the device: a CUDA
        graph's static inputs), in one copy of the bytes from the first part's start to the last one's end. Bytes
        between the parts get whatever the host arena held: the caller's layout leaves only unread bytes there."""
        parts = [(offset, np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for offset, a in parts]
        lo = min(offset for offset, _ in parts)
        hi = max(offset + a.nbytes for offset, a in parts)
        if not self.staged:  # dst is host memory: written in place
            dst_np = dst.numpy()
            for offset, a in parts:
                dst_np[offset : offset + a.nbytes] = a
            return
        start = self._cursor
        end = start + -(-(hi - lo) // ALIGN_BYTES) * ALIGN_BYTES
        host = self._host_arena(end)
        host_np = self._host_np[self._set]
        for offset, a in parts:
            host_np[start + offset - lo : start + offset - lo + a.nbytes] = a
        self._range(dst, lo, hi).copy_(self._range(host, start, start + hi - lo), non_blocking=True)
        self.num_copies += 1
        self._record_copy()
        self._cursor = end

    def _record_copy(self) -> None:
        if self._pin:
            if self._copied[self._set] is None:
                self._copied[self._set] = torch.cuda.Event()
            self._copied[self._set].record(torch.cuda.current_stream(self.device))

    def _arenas(self, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's host arena and the device arena, at least ``num_bytes`` each. Growing keeps this
        step's earlier bytes: a copy of them may still be pending (host) or their tensors in use
        (device), so the new arenas start empty below the cursor and only later puts land there."""
        if self._dev is None or self._dev.numel() < num_bytes:
            size = max(MIN_ARENA_BYTES, num_bytes, 2 * (self._dev.numel() if self._dev is not None else 0))
            self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._views.clear()  # views of the old arena
            self._ranges.clear()
        return self._host_arena(num_bytes), self._dev

    def _host_arena(self, num_bytes: int) -> torch.Tensor:
        host = self._host[self._set]
        if host is None or host.numel() < num_bytes:
            size = max(MIN_ARENA_BYTES, num_bytes, 2 * (host.numel() if host is not None else 0))
            host = self._host[self._set] = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            self._host_np[self._set] = host.numpy()
            self._ranges.clear()  # ranges of the old arena (held there: freed now)
        return host
