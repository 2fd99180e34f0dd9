"""Capturing a CUDA graph, or falling back: what engine/cuda_graphs.py and engine/piecewise_graphs.py do when a
bucket's capture raises."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdcluster.kernels import launch_pdl

log = logging.getLogger(__name__)


def capture_or_eager(device: torch.device, capture: Callable[[], None], undo: Callable[[], None], what: str) -> bool:
    """Run ``capture``; on an exception ``undo`` what it left and return False (the bucket runs eager from then on: a
    forward that cannot be captured, e.g. a host synchronisation inside it). A capture that fails while the graph's
    Triton kernels launch with PDL is tried once more with plain launches, PDL then off for the process
    (kernels/launch_pdl.py): a driver that cannot capture such a launch costs PDL, not the graphs."""
    for attempt in range(2):
        try:
            capture()
            return True
        except Exception as e:  # noqa: BLE001 - such a bucket runs eager
            undo()
            if attempt == 0 and launch_pdl.active_on(device):
                log.warning("CUDA graph capture of %s failed with programmatic dependent launch (%s: %s): again "
                            "with plain launches, PDL off", what, type(e).__name__, e)
                launch_pdl.set_enabled(False)
                continue
            log.warning("CUDA graph capture of %s failed (%s: %s): it runs eager", what, type(e).__name__, e)
            return False
    return False
