"""The cuda_ipc transport's cache handle: what lets a prefill worker map a decode worker's KV cache.

The handle is made by ``torch.multiprocessing.reductions.reduce_tensor``, the function torch itself
uses to send a tensor to another process, and rebuilt with the rebuild function it returns:

* a CUDA cache: ``rebuild_cuda_tensor`` and a CUDA IPC memory handle (plus torch's reference
  counter and the event the consumer waits for before it touches the memory);
* a CPU cache in shared memory (tests, and CPU-only hosts): ``rebuild_tensor`` over a storage that
  torch shares by file name (the "file_system" strategy), rebuilt with ``rebuild_typed_storage`` and
  ``rebuild_storage_filename``.

torch sends that pair through pickle. We never unpickle what came from another process
(tests/test_no_pickle.py), so the pair travels as plain msgpack values::

    {"version": 1, "device": "cuda" | "cpu", "gpu_uuid": str, "pid": int, "token": str,
     "tensor": {"fn": name, "args": [value, ...]}}

where ``fn`` is a name from :data:`FUNCTIONS` (an allow-list, nothing is looked up by name
anywhere else), a class is ``{"class": name}`` from :data:`CLASSES`, a dtype ``{"dtype": name}``,
a nested rebuild ``{"fn": ..., "args": ...}``, and everything else an int, bool, None, bytes or a
list. :func:`open_handle` checks the whole tree against one fixed signature per function before it
calls anything (types, ranges, the shape of torch's shared-memory names), rebuilds the tensor, and
checks it is the cache the peer's layout announced. A handle that fails any check raises
:class:`HandleError`; nothing of it has been mapped by then, except that a well-formed handle whose
memory cannot be opened fails in the rebuild itself (also a HandleError).

The device index inside a CUDA handle is the decode process's; the prefill process may number its
GPUs differently (CUDA_VISIBLE_DEVICES), so the handle names the GPU by UUID and :func:`open_handle`
substitutes the local index of that GPU, or refuses when it is not visible here.

A process cannot open its own CUDA IPC handle; when both ends live in one process (tests), the
handle's ``pid`` and ``token`` find the exported CUDA tensor in this process instead. (A CPU handle is
rebuilt in one process too: torch finds the storage in its own cache.)

Only the CUDA driver calls (``storage._share_cuda_``, ``_new_shared_cuda``) are specific to the
CUDA path; the encoding, the checks and the rebuild dispatch run on CPU caches in tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from ..common.layout import KVLayout
from ..common.tensor_registry import TensorRegistry

HANDLE_VERSION = 1

# The only functions a handle may name, and the only classes it may mention.
FUNCTIONS: dict[str, Callable[..., object]] = {
    "rebuild_cuda_tensor": reductions.rebuild_cuda_tensor,
    "rebuild_tensor": reductions.rebuild_tensor,
    "rebuild_typed_storage": reductions.rebuild_typed_storage,
    "rebuild_storage_filename": reductions.rebuild_storage_filename,
}
CLASSES: dict[str, type] = {
    "Tensor": torch.Tensor,
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}
_TOP_LEVEL = ("rebuild_cuda_tensor", "rebuild_tensor")
_MAX_COUNT = 1 << 50  # sizes, offsets, device numbers: plain non-negative ints below this
_MAX_BLOB = 4096  # CUDA IPC memory / event handles are 64 bytes (plus a type byte in newer torch)
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")  # torch's file_system segment names (libshm)
_MANAGER_SOCKET = re.compile(rb"/[\w./-]{1,240}/manager\.sock")  # torch_shm_manager's socket


class HandleError(ValueError):
    """A handle that is malformed, names something outside the allow-list, or cannot be opened."""


# ------------------------------------------------------------------ CPU caches in shared memory

_strategy_lock = threading.Lock()
_cpu_caches: TensorRegistry[int] = TensorRegistry()  # data_ptr -> nbytes of caches made by shared_cpu_cache()


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch's "file_system" sharing strategy for the duration (process-wide, so briefly and under
    a lock): a storage shared so is named by a file, which plain values can carry; the default
    "file_descriptor" strategy passes a descriptor, which only pickling over a socket can."""
    with _strategy_lock:
        old = torch.multiprocessing.get_sharing_strategy()
        if old != "file_system":
            torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            if old != "file_system":
                torch.multiprocessing.set_sharing_strategy(old)


def shared_cpu_cache(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in shared memory named by a file, which a cuda_ipc receiver can hand out.
    Shared at birth: sharing later would move the storage under views already taken of it."""
    tensor = torch.zeros(tuple(int(d) for d in shape), dtype=dtype)
    with _file_system_sharing():
        tensor.share_memory_()
    _cpu_caches.add(tensor, tensor.numel() * tensor.element_size())
    return tensor


def is_shared_cpu_cache(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies inside a cache made by :func:`shared_cpu_cache`."""
    return any(True for _ in _cpu_caches.find(tensor, lambda nbytes: nbytes))


# ------------------------------------------------------------------ export

_exported: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_handle(tensor: torch.Tensor) -> dict:
    """The msgpack-able handle of ``tensor`` (module docstring). On CUDA, each call shares the
    memory once more: make one per peer that will open it (torch counts the openings)."""
    if tensor.is_cuda:
        device, uuid = "cuda", gpu_uuid(tensor.device)
    elif is_shared_cpu_cache(tensor):
        device, uuid = "cpu", ""
    else:
        raise HandleError("a CPU cache handed out by cuda_ipc must come from shared_cpu_cache()")
    token = secrets.token_hex(8)
    if device == "cuda":
        _exported[token] = tensor  # for a sender in this very process (open_handle)
    return {
        "version": HANDLE_VERSION,
        "device": device,
        "gpu_uuid": uuid,
        "pid": os.getpid(),
        "token": token,
        "tensor": _encode_call(*reductions.reduce_tensor(tensor)),
    }


def _encode_call(fn: Callable[..., object], args: tuple) -> dict:
    name = getattr(fn, "__name__", "")
    if FUNCTIONS.get(name) is not fn:
        raise HandleError(f"torch reduced the cache with {name or fn!r}, which is not on the allow-list")
    return {"fn": name, "args": [_encode(a) for a in args]}


def _encode(value: object) -> object:
    if isinstance(value, torch.storage.TypedStorage):
        return _encode_call(*reductions.reduce_typed_storage(value))
    if isinstance(value, torch.UntypedStorage):
        with _file_system_sharing():
            return _encode_call(*reductions.reduce_storage(value))
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        if CLASSES.get(value.__name__) is not value:
            raise HandleError(f"class {value.__name__} is not on the allow-list")
        return {"class": value.__name__}
    if isinstance(value, (tuple, list)):  # torch.Size too
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, bytes, str)):
        return value
    raise HandleError(f"cannot carry a {type(value).__name__} in a cuda_ipc handle")


# ------------------------------------------------------------------ checking and opening


@dataclass
class _Call:
    fn: str
    args: list


def _count(v: object) -> int:
    if type(v) is not int or not 0 <= v < _MAX_COUNT:
        raise HandleError(f"expected a non-negative int, got {v!r:.60}")
    return v


def _boolean(v: object) -> bool:
    if type(v) is not bool:
        raise HandleError(f"expected a bool, got {v!r:.60}")
    return v


def _false(v: object) -> bool:
    if v is not False:
        raise HandleError(f"requires_grad must be False, got {v!r:.60}")
    return v


def _shape(v: object) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8:
        raise HandleError(f"expected a list of at most 8 sizes, got {v!r:.60}")
    return tuple(_count(x) for x in v)


def _blob(v: object) -> bytes:
    if not isinstance(v, bytes) or not 0 < len(v) <= _MAX_BLOB:
        raise HandleError(f"expected 1-{_MAX_BLOB} bytes, got {v!r:.60}")
    return v


def _optional_blob(v: object) -> bytes | None:
    return None if v is None else _blob(v)


def _dtype(v: object) -> torch.dtype:
    if not isinstance(v, dict) or set(v) != {"dtype"} or not isinstance(v["dtype"], str):
        raise HandleError(f"expected {{'dtype': name}}, got {v!r:.60}")
    dtype = getattr(torch, v["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise HandleError(f"unknown dtype {v['dtype']!r:.40}")
    return dtype


def _cls(*names: str) -> Callable[[object], type]:
    def check(v: object) -> type:
        if not isinstance(v, dict) or set(v) != {"class"} or v["class"] not in names:
            raise HandleError(f"expected a class among {names}, got {v!r:.60}")
        return CLASSES[v["class"]]

    return check


def _matching(pattern: re.Pattern[bytes], what: str) -> Callable[[object], bytes]:
    def check(v: object) -> bytes:
        if not isinstance(v, bytes) or not pattern.fullmatch(v) or b".." in v:
            raise HandleError(f"{what} {v!r:.80} does not look like torch's")
        return v

    return check


def _call(*names: str) -> Callable[[object], _Call]:
    return lambda v: _check_call(v, names)


def _metadata(v: object) -> tuple:
    if not isinstance(v, list) or len(v) != 4:
        raise HandleError(f"expected [offset, size, stride, requires_grad], got {v!r:.80}")
    return (_count(v[0]), _shape(v[1]), _shape(v[2]), _false(v[3]))


# One signature per allowed function: the checker of each positional argument.
SIGNATURES: dict[str, tuple[Callable[[object], object], ...]] = {
    # (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device, handle, storage_size_bytes,
    #  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
    #  event_sync_required): torch.multiprocessing.reductions.reduce_tensor's CUDA branch
    "rebuild_cuda_tensor": (
        _cls("Tensor"), _shape, _shape, _count, _cls("TypedStorage", "UntypedStorage"), _dtype, _count,
        _blob, _count, _count, _false, _blob, _count, _optional_blob, _boolean,
    ),
    "rebuild_tensor": (_cls("Tensor"), _call("rebuild_typed_storage"), _metadata),
    "rebuild_typed_storage": (_call("rebuild_storage_filename"), _dtype),
    "rebuild_storage_filename": (
        _cls("UntypedStorage"), _matching(_MANAGER_SOCKET, "shm manager socket"),
        _matching(_SHM_NAME, "shared memory name"), _count,
    ),
}
_CUDA_DEVICE_ARG = 6  # rebuild_cuda_tensor's device index: the producer's numbering


def _check_call(node: object, names: Sequence[str]) -> _Call:
    if not isinstance(node, dict) or set(node) != {"fn", "args"}:
        raise HandleError(f"expected {{'fn': ..., 'args': [...]}}, got {node!r:.80}")
    fn, args = node["fn"], node["args"]
    if fn not in names:
        raise HandleError(f"function {fn!r:.60} is not allowed here (allowed: {', '.join(names)})")
    signature = SIGNATURES[fn]
    if not isinstance(args, list) or len(args) != len(signature):
        raise HandleError(f"{fn} takes {len(signature)} arguments, the handle gives {args!r:.80}")
    return _Call(fn, [check(a) for check, a in zip(signature, args)])


def _build(call: _Call) -> object:
    args = [_build(a) if isinstance(a, _Call) else a for a in call.args]
    return FUNCTIONS[call.fn](*args)


def check_handle(handle: object) -> tuple[str, str, _Call]:
    """Check a handle's whole tree without opening anything: ``(device, gpu_uuid, call)``."""
    if not isinstance(handle, dict):
        raise HandleError(f"a handle is a map, got {type(handle).__name__}")
    if handle.get("version") != HANDLE_VERSION:
        raise HandleError(f"handle version {handle.get('version')!r:.20}, this build reads {HANDLE_VERSION}")
    device, uuid = handle.get("device"), handle.get("gpu_uuid")
    if device not in ("cuda", "cpu") or not isinstance(uuid, str) or len(uuid) > 64:
        raise HandleError(f"bad device {device!r:.20} / gpu_uuid {uuid!r:.70}")
    call = _check_call(handle.get("tensor"), _TOP_LEVEL)
    if (call.fn == "rebuild_cuda_tensor") != (device == "cuda"):
        raise HandleError(f"a {device} handle cannot be rebuilt with {call.fn}")
    if not isinstance(handle.get("pid"), int) or not isinstance(handle.get("token"), str):
        raise HandleError("handle without pid and token")
    return device, uuid, call


def local_gpu(uuid: str) -> int:
    """This process's index of the GPU named ``uuid``; HandleError when it is not visible here."""
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if gpu_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise HandleError(
        f"the decode worker's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES): cuda_ipc "
        "needs prefill and decode on the same GPU, or the decode worker's GPU visible to the prefill worker"
    )


def open_handle(handle: object, layout: KVLayout) -> torch.Tensor:
    """The peer's cache, mapped into this process, after checking the handle and the result against
    the peer's ``layout`` (module docstring). Raises HandleError."""
    device, uuid, call = check_handle(handle)
    assert isinstance(handle, dict)
    in_process = device == "cuda" and handle["pid"] == os.getpid()
    tensor = _exported.get(handle["token"]) if in_process else None
    if tensor is None:
        if device == "cuda":
            call.args[_CUDA_DEVICE_ARG] = local_gpu(uuid)
        try:
            tensor = _build(call)
        except Exception as e:  # noqa: BLE001 - torch's open/map errors: the handle is unusable here
            raise HandleError(f"cannot open the peer's cache: {type(e).__name__}: {e}") from e
    check_cache(tensor, layout)
    return tensor


def check_cache(tensor: object, layout: KVLayout) -> None:
    """The rebuilt tensor must be the whole cache the peer's layout describes, contiguous."""
    want = (layout.num_layers, layout.num_planes, layout.num_blocks, *layout.block_shape)
    if not isinstance(tensor, torch.Tensor):
        raise HandleError(f"the handle rebuilt a {type(tensor).__name__}, not a tensor")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tuple(tensor.shape) != want or dtype != layout.dtype or not tensor.is_contiguous():
        raise HandleError(
            f"the handle maps a {dtype} tensor of shape {tuple(tensor.shape)}, but the peer's layout "
            f"announced a contiguous {layout.dtype} cache of shape {want}"
        )
