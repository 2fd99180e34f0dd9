"""The device side of programmatic dependent launch (kernels/launch_pdl.py has the rule and when it is used).

A kernel with a ``USE_PDL: tl.constexpr = False`` parameter calls ``wait_then_release(USE_PDL)`` after
loading whatever model weights it wants early and before any other memory access. Without PDL the call
compiles to nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    if USE_PDL:
        # Wait for the previous kernel to complete (its writes visible), then let the next one be placed:
        # in this order, the next kernel's early part overlaps only this kernel's (launch_pdl.py).
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
