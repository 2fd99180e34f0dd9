"""Builds the C kernels (kernels/csrc/*.c, listed in SOURCES) once per machine into one library and
loads it with ctypes.

Why C through ctypes rather than a torch C++ extension: the file needs no torch headers, so a build
takes about a second with gcc (a torch extension takes minutes on a 2-core box), and a missing compiler
costs nothing but speed: :func:`load` returns None and the engine runs the torch reference kernels.

Each source is compiled to an object file cached under ``~/.cache/pdcluster/kernels/`` keyed by that
source, the compiler and the CPU's feature flags (the build uses ``-march=native``), so editing one
source recompiles only that one; the objects are linked into ``cpu_kernels-<key>.so``, keyed by all of
them. Concurrent builders (Ray workers starting together) each write a temporary file and rename it
into place, so nobody loads half a file. The first source (cpu_kernels.c) is required: if it fails to
build, :func:`load` returns None. A later one that fails is left out with a warning and its functions
are missing from the library (its wrapper checks ``hasattr``). ``PDCLUSTER_CPU_KERNELS=0`` turns the C
kernels off.
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

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.c"
# -fno-trapping-math (not -ffast-math: results stay IEEE, no reassociation): lets GCC if-convert the
# selects in exp_nonpos and silu, so the softmax and silu loops vectorise on CPUs without the
# hand-written avx512 paths. We never read floating-point exception flags.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-std=gnu11"]

_c_int, _c_i64, _c_f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
CORE_SIGNATURES = {
    "pd_paged_attention": [_c_int, _c_int, _ptr, _c_i64, _c_i64, _ptr, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_i64, _ptr,
                           _ptr, _c_int, _c_int, _c_int, _c_int, _c_int, _c_f32, _c_int, _c_int, _c_f32, _ptr, _ptr,
                           _c_int, _c_i64, _c_i64, _c_int],
    "pd_attention_amx": [],
    "pd_rms_norm": [_c_int, _ptr, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_f32, _c_int],
    "pd_rotary": [_c_int, _ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_int, _ptr, _ptr, _c_int],
    "pd_silu_and_mul": [_c_int, _ptr, _ptr, _c_i64, _c_int, _c_int],
    "pd_argmax_rows": [_c_int, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_int],
    "pd_linear_small_m": [_ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_int],
    "pd_write_kv": [_ptr, _ptr, _c_i64, _c_i64, _ptr, _ptr, _ptr, _c_i64, _c_int, _c_int, _c_int, _c_int, _c_int,
                    _c_int, _c_i64, _c_i64, _c_i64, _c_i64],
}
GEMM_BI_SIGNATURES = {  # kernels/csrc/gemm_bi.c: the batch-invariant linear (kernels/cpu_gemm.py)
    "pd_gemm_bi": [_c_int, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_int, _c_int, _c_int],
    "pd_gemm_bi_bias": [_c_int, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_int, _c_int, _c_int,
                        _ptr],
    "pd_gemm_bi_isa": [_c_int],
}
GROUPED_GEMM_BI_SIGNATURES = {  # kernels/csrc/grouped_gemm_bi.c: the MoE's grouped linear (kernels/cpu_grouped_mm.py)
    "pd_grouped_gemm_bi": [_c_int, _ptr, _c_i64, _ptr, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_int, _c_int,
                           _c_int],
}
LORA_BI_SIGNATURES = {  # kernels/csrc/lora_bi.c: multi-LoRA updates (kernels/cpu_lora.py)
    "pd_lora_bi": [_c_int, _ptr, _c_i64, _ptr, _ptr, _c_i64, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _ptr, _ptr, _c_i64,
                   _c_int, _c_int],
}
# source -> the functions it defines; the first is required, the others optional (see the docstring)
SOURCES = {SOURCE: CORE_SIGNATURES, CSRC / "gemm_bi.c": GEMM_BI_SIGNATURES,
           CSRC / "grouped_gemm_bi.c": GROUPED_GEMM_BI_SIGNATURES, CSRC / "lora_bi.c": LORA_BI_SIGNATURES}
SIGNATURES = {name: argtypes for signatures in SOURCES.values() for name, argtypes in signatures.items()}


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


def _run_to(cmd: list[str], out: Path) -> None:
    """Runs ``cmd`` with its output file a temporary beside ``out``, then renames it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cmd, "-o", tmp], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(cc: str, source: Path, machine: bytes) -> Path:
    """The cached object file of one source (compiled now if missing)."""
    key = hashlib.sha256(source.read_bytes() + machine).hexdigest()[:16]
    obj = _cache_dir() / f"{source.stem}-{key}.o"
    if not obj.exists():
        _run_to([cc, *FLAGS, "-c", str(source)], obj)
    return obj


def _link(cc: str, objects: list[Path]) -> Path:
    key = hashlib.sha256("".join(o.name for o in objects).encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_kernels-{key}.so"
    if not path.exists():
        _run_to([cc, *FLAGS, "-shared", *map(str, objects), "-lm"], path)
    return path


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
        machine = " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()
        # Headers (csrc/*.h) count as part of every source: they are few and small, and a changed one must rebuild.
        machine += b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
        objects, built = [], {}
        for i, (source, signatures) in enumerate(SOURCES.items()):
            try:
                objects.append(_compile(cc, source, machine))
                built.update(signatures)
            except (OSError, subprocess.SubprocessError) as exc:
                if i == 0:
                    raise
                logger.warning("building %s failed (%s): its kernels are left out", source.name, _detail(exc))
        lib = ctypes.CDLL(str(_link(cc, objects)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("building the CPU kernels failed (%s): falling back to the torch reference", _detail(exc))
        return None
    for name, argtypes in built.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def _detail(exc: Exception) -> str:
    return getattr(exc, "stderr", "") or str(exc)
