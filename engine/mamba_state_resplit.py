"""A prompt's Mamba state, packed in blocks by ranks of one split, re-packed for the ranks of another.

With tensor parallelism each rank holds its heads' state (engine/tensor_parallel/shard_hybrid.py): per Mamba layer a
conv state over its channels ``x_r | B_r | C_r`` (its heads' x, its groups' B and C) and an SSM state over its heads,
packed float32 into its own cache's state blocks (engine/mamba_state_blocks.py). A decode worker split another number
of ways reads its ranks' states the same way, so the prefill side (kv_transfer/transports/resplit.py) reads every
rank's state, puts the whole model's together (x, B and C each side by side over the ranks; heads side by side) and
packs each peer rank's slice into the staging cache laid out for it. The number of state blocks does not change with
the split: a rank's state and a rank's block both shrink by the same factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pdcluster.engine.mamba_state import MambaStateShape
from pdcluster.engine.mamba_state_blocks import read_state_floats, write_state_floats


def _layers(flat: torch.Tensor, shape: MambaStateShape) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One rank's packed floats as its conv states [conv_dim, conv_width] and SSM states [H, P, N], per layer."""
    conv_n = shape.conv_dim * shape.conv_width
    ssm_n = shape.num_heads * shape.head_dim * shape.state_size
    num_layers = shape.num_mamba_layers
    conv = [flat[i * conv_n:(i + 1) * conv_n].view(shape.conv_dim, shape.conv_width) for i in range(num_layers)]
    base = num_layers * conv_n
    ssm = [flat[base + i * ssm_n:base + (i + 1) * ssm_n].view(shape.num_heads, shape.head_dim, shape.state_size)
           for i in range(num_layers)]
    return conv, ssm


def _conv_parts(conv: torch.Tensor, shape: MambaStateShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's conv state as its x, B and C channels."""
    x = shape.num_heads * shape.head_dim
    groups = (shape.conv_dim - x) // 2  # B's channels (C's as many)
    return conv[:x], conv[x:x + groups], conv[x + groups:]


def split_shape(shape: MambaStateShape, num_ranks: int, num_peer_ranks: int) -> MambaStateShape:
    """The state shape a rank holds where the model is split ``num_peer_ranks`` ways, from ours (``num_ranks``)."""
    whole = replace(shape, conv_dim=shape.conv_dim * num_ranks, num_heads=shape.num_heads * num_ranks)
    if whole.num_heads % num_peer_ranks or whole.conv_dim % num_peer_ranks:
        raise ValueError(f"{whole.num_heads} Mamba heads do not split {num_peer_ranks} ways")
    return replace(whole, conv_dim=whole.conv_dim // num_peer_ranks, num_heads=whole.num_heads // num_peer_ranks)


def resplit_state(caches: Sequence[torch.Tensor], peer_caches: Sequence[torch.Tensor], block_ids,
                  shape: MambaStateShape) -> None:
    """Read the state packed in ``block_ids`` of our rank ``caches`` (each rank's state of ``shape``) and pack each
    peer rank's slice of it into the same blocks of ``peer_caches`` (one per peer rank)."""
    peer_shape = split_shape(shape, len(caches), len(peer_caches))
    ranks = [_layers(read_state_floats(cache, block_ids, shape), shape) for cache in caches]
    peer_layers: list[list[torch.Tensor]] = [[] for _ in peer_caches]
    peer_ssm: list[list[torch.Tensor]] = [[] for _ in peer_caches]
    for layer in range(shape.num_mamba_layers):
        x, b, c = (torch.cat(parts) for parts in zip(*(_conv_parts(conv[layer], shape) for conv, _ in ranks)))
        ssm = torch.cat([rank_ssm[layer] for _, rank_ssm in ranks])
        for d, (x_d, b_d, c_d, ssm_d) in enumerate(zip(*(t.chunk(len(peer_caches)) for t in (x, b, c, ssm)))):
            peer_layers[d].append(torch.cat([x_d, b_d, c_d]))
            peer_ssm[d].append(ssm_d)
    for cache, conv, ssm in zip(peer_caches, peer_layers, peer_ssm):
        flat = torch.cat([t.reshape(-1) for t in conv + ssm])
        assert flat.numel() * 4 == peer_shape.bytes_per_slot
        write_state_floats(cache, block_ids, flat)
