"""A request's Mamba state carried in paged-KV blocks, so a KV transfer moves it like any block.

Every transport moves *rows* of the paged cache (kv_transfer/transports/common/layout.py): one layer's K or
V slice of one block. A block's *stripe* is all of its rows (every layer, K and V), and a stripe is as
good as any buffer: the prefill worker writes a finished prompt's state (conv + SSM, all Mamba
layers, float32 bytes) into the stripes of ``num_state_blocks`` extra blocks right after the prompt's
blocks, after the draft proposer has run and before ``post_forward`` sends them (S2); the decode
worker reserved the same number of extra blocks after the prompt's, and reads the state into the
request's state slot when the request first runs, before anything writes KV there. From then on those
blocks are ordinary KV blocks for the tokens that follow the prompt, so they cost the decode side
nothing. Reservations, admission, revocation, authentication and the router's block accounting all
apply to the state unchanged, on every transport; both sides must agree on the state's shape (the
handshake compares it, naming the differing field).
"""

from __future__ import annotations

import numpy as np
import torch

from pdcluster.engine.mamba_state import MambaStatePool, MambaStateShape


def num_state_blocks(shape: MambaStateShape, bytes_per_block: int) -> int:
    """Blocks whose stripes hold one request's state (``bytes_per_block``: all layers, K and V)."""
    return -(-shape.bytes_per_slot // bytes_per_block)


def tokens_with_state(num_prompt_tokens: int, block_size: int, num_blocks: int) -> int:
    """Token slots that cover a prompt's blocks and the ``num_blocks`` state blocks after them."""
    return (-(-num_prompt_tokens // block_size) + num_blocks) * block_size


def state_block_ids(block_ids: list[int], num_prompt_tokens: int, block_size: int, num_blocks: int) -> list[int]:
    """The state blocks of a request: the ``num_blocks`` blocks right after its prompt's."""
    first = -(-num_prompt_tokens // block_size)
    ids = list(block_ids[first : first + num_blocks])
    if len(ids) != num_blocks:
        raise ValueError(f"request has {len(block_ids)} blocks; its state needs blocks {first}..{first + num_blocks - 1}")
    return ids


def _stripes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as bytes, [num_layers * 2, num_blocks, block_bytes] (a view)."""
    num_layers, two, num_blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).view(num_layers * two, num_blocks, -1)


def pack_state(pool: MambaStatePool, slot: int, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Write slot ``slot``'s state into the stripes of ``block_ids`` (layer by layer, conv then ssm)."""
    write_state_floats(kv_cache, block_ids, torch.cat([t[slot].reshape(-1) for t in pool.conv + pool.ssm]))


def write_state_floats(kv_cache: torch.Tensor, block_ids, flat: torch.Tensor) -> None:
    """``flat`` (a state's floats, in pack_state's order) into the stripes of ``block_ids``, zero-padded."""
    payload = flat.to(torch.float32).contiguous().view(torch.uint8)
    rows = _stripes(kv_cache)
    stripe_bytes = rows.shape[0] * rows.shape[2]
    buf = torch.zeros(len(block_ids) * stripe_bytes, dtype=torch.uint8, device=kv_cache.device)
    buf[: payload.numel()] = payload
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=kv_cache.device)
    rows[:, ids, :] = buf.view(len(block_ids), rows.shape[0], rows.shape[2]).transpose(0, 1)


def read_state_floats(kv_cache: torch.Tensor, block_ids, shape: MambaStateShape) -> torch.Tensor:
    """The state ``pack_state`` wrote into ``block_ids`` (of a cache whose state has ``shape``), as float32."""
    rows = _stripes(kv_cache)
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=kv_cache.device)
    payload = rows[:, ids, :].transpose(0, 1).reshape(-1)
    return payload[: shape.bytes_per_slot].clone().view(torch.float32)


def unpack_state(kv_cache: torch.Tensor, block_ids: list[int], pool: MambaStatePool, slot: int) -> None:
    """Read the state written by :func:`pack_state` (on another worker) into slot ``slot``."""
    flat = read_state_floats(kv_cache, block_ids, pool.shape)
    offset = 0
    for t in pool.conv + pool.ssm:
        n = t[slot].numel()
        t[slot].copy_(flat[offset : offset + n].view(t[slot].shape))
        offset += n
