"""A NemotronH checkpoint's own MTP step on a split model (engine/models/nemotron_mtp.py): every rank holds its slice of
the step's blocks, cut by the same rules as the model's (shard_hybrid.py: ``mtp.layers.*`` by
``mtp_layer_types``), and the step's attention blocks write each rank's KV heads into its own draft layers.

Rank 0's proposer (engine/proposers/mtp.py) runs each MTP forward after handing the other ranks the same one
(``DraftForward``): which rows of the input hidden states to take, the next tokens, the positions and the attention
metadata. The hidden states themselves never travel: every rank holds the whole of them already (each block's sum
leaves every rank the whole hidden state, and the final norm is whole), the target's from its last forward and the
step's own from its previous MTP forward. Only rank 0 turns them into draft tokens (the LM head is its own)."""

from __future__ import annotations

import torch

from pdcluster.engine.models.nemotron_mtp import NemotronMTP


def own_mtp_head(model, weights: dict[str, torch.Tensor]) -> NemotronMTP:
    """``model``'s own MTP step from the checkpoint's ``mtp.*`` tensors: this rank's slice of it where ``model`` is
    split (CausalLM.tp_shard), its blocks' output projections summed over the model's group."""
    if model.tp_shard is None:
        return NemotronMTP(model, weights)
    from pdcluster.engine.tensor_parallel.shard_hybrid import shard_hybrid_tensor, split_hybrid_blocks

    cut = {name: shard_hybrid_tensor(name, t, model.unsplit_arch, model.tp_shard) for name, t in weights.items()}
    head = NemotronMTP(model, cut)
    split_hybrid_blocks(head.blocks, model.tp_group)
    return head
