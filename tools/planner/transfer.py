"""Transfer times of a request's KV through the real transport (part of `pdcluster profile`): layer by
layer between two endpoints in this process, end to end (send to the receiver's acknowledgement)."""

from __future__ import annotations

import time

import numpy as np
import torch

from pdcluster.kv_transfer.transports import TransportConfig, get_transport_class
from pdcluster.tools.planner.grid import ProfileGrid

TRANSFER_TIMEOUT_S = 15.0


def measure_transfer(kv_spec, transport: str, grid: ProfileGrid) -> list[dict]:
    """A request's KV, one send per layer as the prefill worker streams it, until acknowledged.

    Each size gets its own sender/receiver pair: the tcp sender's staging pool
    (kv_transfer/transports/common/staging.py) looks buffers up by tensor comparison and fails once it
    holds buffers of two sizes, which one pair moving several sizes would provoke."""
    points = []
    for blocks in grid.transfer_blocks:
        points += _transfer_points(kv_spec, transport, blocks, grid.reps + 1)
    return points


def _transfer_points(kv_spec, transport: str, blocks: int, reps: int) -> list[dict]:
    cls = get_transport_class(transport)
    shape = (kv_spec.num_layers, 2, blocks, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
    config = TransportConfig(timeout_s=TRANSFER_TIMEOUT_S, secret="pdcluster-profile", admit_unexpected=True)
    src = cls.allocate_kv_cache(shape, kv_spec.dtype)
    dst = cls.allocate_kv_cache(shape, kv_spec.dtype)
    src.view(torch.uint8).random_(0, 255)
    receiver = cls(dst, "receiver", config)
    sender = cls(src, "sender", config)
    points = []
    try:
        sender.connect("decode", receiver.local_descriptor())
        ids = np.arange(blocks)
        for i in range(reps + 1):  # the first one only warms the buffers up
            t0 = time.perf_counter()
            for layer in range(kv_spec.num_layers):
                sender.send("decode", f"t{i}", [layer], ids, ids)
            delivered, failed = _wait_delivered(sender, f"t{i}")
            seconds = time.perf_counter() - t0
            receiver.poll_received()
            if failed or not delivered:
                raise RuntimeError(f"profile: {transport} transfer of {blocks} blocks failed: {failed}")
            if i:
                points.append({"bytes": blocks * kv_spec.bytes_per_block, "blocks": blocks, "seconds": seconds})
    finally:
        sender.close()
        receiver.close()
    return points


def _wait_delivered(sender, transfer_id: str) -> tuple[bool, list]:
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S + 5
    while time.monotonic() < deadline:
        delivered, failed = sender.poll_sent()
        if transfer_id in delivered or failed:
            return transfer_id in delivered, failed
        time.sleep(0.0002)
    return False, [(transfer_id, "no answer within the bound")]
