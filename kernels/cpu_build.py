"""Builds kernels/csrc/cpu_kernels.c once per machine and loads it with ctypes.

Why C through ctypes rather than a torch C++ extension: the file needs no torch headers, so a build
takes about a second with gcc (a torch extension takes minutes on a 2-core box), and a missing compiler
costs nothing but speed: :func:`load` returns None and the engine runs the torch reference kernels.

The shared object is cached under ``~/.cache/pdcluster/kernels/`` keyed by the source, the compiler
and the CPU's feature flags (the build uses ``-march=native``). Concurrent builders (Ray workers
starting together) each write a temporary file and rename it into place, so nobody loads half a file.
``PDCLUSTER_CPU_KERNELS=0`` turns the C kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# -fno-trapping-math (not -ffast-math: results stay IEEE, no reassociation): lets GCC if-convert the
# selects in exp_nonpos and silu, so the softmax and silu loops vectorise on CPUs without the
# hand-written avx512 paths. We never read floating-point exception flags.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]

_c_int, _c_i64, _c_f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "pd_paged_attention": [_c_int, _ptr, _c_i64, _c_i64, _ptr, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_i64, _ptr,
                           _ptr, _c_int, _c_int, _c_int, _c_int, _c_int, _c_f32, _ptr, _c_i64, _c_i64, _c_int],
    "pd_rms_norm": [_c_int, _ptr, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_f32, _c_int],
    "pd_rotary": [_c_int, _ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_int, _ptr, _ptr, _c_int],
    "pd_silu_and_mul": [_c_int, _ptr, _ptr, _c_i64, _c_int, _c_int],
    "pd_argmax_rows": [_c_int, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_int],
    "pd_linear_small_m": [_ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_int],
    "pd_write_kv": [_ptr, _ptr, _c_i64, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_int, _c_int, _c_int],
}


def _cache_dir() -> Path:
    root = os.environ.get("PDCLUSTER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when turned off or unbuildable (logged once)."""
    if os.environ.get("PDCLUSTER_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU kernels fall back to the (slower) torch reference")
        return None
    import torch  # noqa: F401  -- its libgomp must be loaded first, so ours resolves to the same one

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()
        ).hexdigest()[:16]
        path = _cache_dir() / f"cpu_kernels-{key}.so"
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU kernels failed (%s): falling back to the torch reference", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib
