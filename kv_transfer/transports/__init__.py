"""KV data-plane transports, selectable by name.

    cls = get_transport_class("shm")          # ValueError for unknown names, TransportUnavailable
    t = cls(kv_cache, "sender", TransportConfig())   # when the library is missing

Names: ``ucx`` (ucxx), ``nccl`` (torch.distributed p2p: NCCL for CUDA caches, gloo on CPU),
``tcp`` (pyzmq), ``shm`` (same-host shared memory), ``cuda_ipc`` (same host: the sender writes
into the receiver's cache, on a GPU through CUDA IPC; CPU caches through shared memory, for tests).
The interface is in base.py; each transport lives in its own folder (``tcp/``, ``ucx/``, ``nccl/``,
``shm/``, ``cuda_ipc/``) holding the files only it uses, and what two or more of them share is in
``common/``: connect, send, close and their threads (common/threaded.py), the one IO thread of all
but nccl (common/io_thread.py), and the sender that writes into a mapped receiver cache with the
receiver's side of it, shared by shm and cuda_ipc (common/mapped_push.py, common/inbox.py).
"""

from __future__ import annotations

import importlib

from .base import KVTransport, ShmOptions, TransportConfig, TransportUnavailable, UCXOptions

# name -> (module below this package, class, python modules the transport needs)
_REGISTRY: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "ucx": ("ucx.transport", "UCXTransport", ("ucxx._lib.libucxx",)),
    "nccl": ("nccl.transport", "TorchDistTransport", ("torch.distributed",)),
    "tcp": ("tcp.transport", "ZmqTransport", ("zmq",)),
    "shm": ("shm.transport", "ShmTransport", ()),
    "cuda_ipc": ("cuda_ipc.transport", "CudaIpcTransport", ("torch.multiprocessing.reductions",)),
}


def transport_names() -> list[str]:
    return list(_REGISTRY)


def _missing_reason(name: str) -> str | None:
    _, _, needs = _REGISTRY[name]
    for mod in needs:
        # Import, not just find: ucxx is found but fails to import when libucx is missing.
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            return f"python module {e.name or mod!r} is not installed"
        except Exception as e:  # noqa: BLE001 - any import failure makes the transport unusable
            return f"python module {mod!r} cannot be imported: {e}"
    if name == "nccl":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return "torch.distributed with the gloo backend is not available in this torch build"
    if name == "shm":
        import os
        import sys

        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            return "needs Linux memfd_create and abstract unix sockets"
    if name == "cuda_ipc":
        import sys

        if not sys.platform.startswith("linux"):
            return "needs Linux abstract unix sockets (and CUDA IPC or shared memory by file name)"
    return None


def available_transports() -> dict[str, str | None]:
    """Every known name -> None if usable here, else the reason it is not."""
    return {name: _missing_reason(name) for name in _REGISTRY}


def get_transport_class(name: str) -> type[KVTransport]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(_REGISTRY)}")
    reason = _missing_reason(name)
    if reason is not None:
        raise TransportUnavailable(f"KV transport {name!r} is unavailable: {reason}")
    module, cls, _ = _REGISTRY[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    except ImportError as e:  # e.g. a shared library the python package needs is missing
        raise TransportUnavailable(f"KV transport {name!r} is unavailable: {e}") from e


__all__ = [
    "KVTransport",
    "ShmOptions",
    "TransportConfig",
    "TransportUnavailable",
    "UCXOptions",
    "available_transports",
    "get_transport_class",
    "transport_names",
]
