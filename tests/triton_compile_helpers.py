"""Compiling Triton kernels ahead of time for a GPU target, with no GPU: the tests' interpreter
(TRITON_INTERPRET=1, set in conftest.py) runs kernels as Python and skips Triton's compiler, which is
stricter (types of loop-carried values, constexpr use, dot shapes). A test hands a script that calls
``triton.compile`` to :func:`compile_for_cuda`, which runs it in a subprocess that does not interpret; there
``from sm90_build import build`` compiles a kernel for an H100 / H200 as a launch specialises it (tests/sm90_build.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_for_cuda(script: str, tmp_path: Path, args: list[str] = (), timeout_s: float = 300) -> str:
    """Runs ``python -c script *args`` uninterpreted, with its Triton cache under ``tmp_path``; asserts it
    exits 0 and returns its stdout. Skips where this triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # not the user's ~/.triton
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's default-change warning
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
