"""Inside a :func:`triton_compile_helpers.compile_for_cuda` script (uninterpreted, no GPU): one Triton kernel compiled
for an H100 / H200 (sm_90) as a launch specialises it, with what the tests read off the result.

    from sm90_build import build
    got = build(kernel, {"out_ptr": "*bf16", "eps": "fp32"}, dict(BLOCK=1024), aligned=("N",), spills=True)

- constexpr parameters left out of ``constexprs`` take their defaults; the other parameters not typed in
  ``pointer_types`` are i32 (triton's specialisation of an integer argument);
- the typed pointers, and the integer parameters named in ``aligned``, are 16-divisible, as a launch with
  16-byte-aligned tensors and a 2,048-wide model's shapes and strides specialises them (without that the compiler
  can neither vectorise the loads nor pipeline them);
- ``launch_pdl``: the option a programmatic-dependent launch compiles with (kernels/launch_pdl.py).

Returns ``{"ptx", "ttgir", "shared_bytes", "params", "pointers", "spill_bytes"}``: ``params`` the non-constexpr
parameters in order, ``pointers`` those typed as pointers, ``spill_bytes`` ptxas's spill stores (``spills``; None
where this triton ships no ptxas).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(fn, pointer_types: dict[str, str], constexprs: dict, *, aligned: tuple[str, ...] = (), num_warps: int = 4,
          num_stages: int = 3, launch_pdl: bool = False, spills: bool = False) -> dict:
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    divisible = [n for n in names if signature[n].startswith("*")] + [n for n in aligned if signature[n] == "i32"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if launch_pdl:
        options["launch_pdl"] = True
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=options)
    return {"ptx": kernel.asm["ptx"], "ttgir": kernel.asm["ttgir"], "shared_bytes": kernel.metadata.shared,
            "params": [n for n in names if signature[n] != "constexpr"],
            "pointers": [n for n in names if signature[n].startswith("*")],
            "spill_bytes": _spill_bytes(kernel.asm["ptx"]) if spills else None}


def _spill_bytes(ptx: str) -> int | None:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info.stderr))
