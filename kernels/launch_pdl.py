"""When a decode step's Triton kernels launch with programmatic dependent launch (PDL, Hopper and later).

A CUDA graph of a batch-1 decode step replays ~200 small kernels one after another. Each one normally
starts only after the one before it has finished and its memory is flushed, so the GPU idles for the
start of every kernel: blocks placed, arguments read, addresses computed, the first loads issued. With
PDL a kernel may be placed on the GPU while the previous one still runs; it then runs up to a
``griddepcontrol.wait``, which returns once the previous kernel has completed and its writes are visible.

The rule that keeps this safe (kernels/triton_pdl.py, checked on the sm_90 build by tests/test_pdl.py):

- every kernel that launches with PDL waits before it writes anything, and before it reads anything
  but model weights (which no kernel of a forward writes);
- it lets the next kernel start (``griddepcontrol.launch_dependents``) only after its own wait. So a
  kernel's early part overlaps only the kernel just before it, never an earlier one;
- a kernel launched without PDL (cuBLAS, torch's own) waits for everything before it, as always.

Only inside a CUDA graph's forward (kernels/graph_region.py), only on CUDA devices of compute capability 9.0 and later, never under the Triton interpreter;
off with EngineConfig.pdl=False (``--no-pdl``). No triton import here: the engine imports this on CPUs.
"""

from __future__ import annotations

import os

import torch

from pdcluster.kernels.graph_region import in_graph_region

_enabled = True
_capability: dict[int, tuple[int, int]] = {}
# Read once, as the kernels' modules read it: options() runs at every launch of a forward's Triton kernels.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def set_enabled(enabled: bool) -> None:
    """The engine's EngineConfig.pdl (process-wide: the engine being built decides)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def supported(device: torch.device) -> bool:
    """A CUDA device that has PDL (compute capability 9.0 or later), with compiled (not interpreted) Triton."""
    if device.type != "cuda" or _INTERPRETED:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index][0] >= 9


def active_on(device: torch.device) -> bool:
    """Whether a CUDA graph's Triton kernels on ``device`` launch with PDL."""
    return _enabled and supported(device)


def wanted(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launched now uses PDL (the thread-local region first: eager launches stop there)."""
    return in_graph_region() and active_on(t.device)


def options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr (kernels/triton_pdl.py): both, or neither."""
    return {"USE_PDL": True, "launch_pdl": True} if wanted(t) else {}
