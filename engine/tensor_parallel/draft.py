"""MTP drafts on a split model: a checkpoint's own MTP layers, NemotronH's (engine/models/nemotron_mtp.py) and
DeepSeek-V3's (engine/models/deepseek_mtp.py), and our MTP head on a Llama-family target (engine/models/mtp.py, a
trained one or the seeded random one). Every rank holds its slice of the MTP step's blocks, cut by the same rules as
the model's (shard_hybrid.py: ``mtp.layers.*`` by ``mtp_layer_types``; shard.py: DeepSeek's MTP layer, under
``model.layers.{num_hidden_layers}``, and our head's ``mtp.layer.*``, as any layer of the family), and the step's
attention writes each rank's KV heads (DeepSeek: the whole latent) into its own draft layers.

Rank 0's proposer (engine/proposers/mtp.py) runs each MTP forward after handing the other ranks the same one
(``DraftForward``): which rows of the input hidden states to take, the next tokens, the positions and the attention
metadata. The hidden states themselves never travel: every rank holds the whole of them already (each block's sum
leaves every rank the whole hidden state, and the final norm is whole), the target's from its last forward and the
step's own from its previous MTP forward. Only rank 0 turns them into draft tokens (the LM head is its own)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdcluster.engine.models.deepseek import DeepseekArch
from pdcluster.engine.models.deepseek_mtp import DeepseekMTP
from pdcluster.engine.models.mtp import MTPHead
from pdcluster.engine.models.nemotron_mtp import NemotronMTP

HEAD_PREFIX = "mtp.layer."  # our MTP head's decoder layer (engine/models/mtp.py mtp_param_shapes)


def own_mtp_head(model, weights: dict[str, torch.Tensor]) -> NemotronMTP | DeepseekMTP:
    """``model``'s own MTP step from the checkpoint's tensors: this rank's slice of it where ``model`` is split
    (CausalLM.tp_shard), its blocks' output projections summed over the model's group."""
    deepseek = isinstance(model.arch, DeepseekArch)
    head_class = DeepseekMTP if deepseek else NemotronMTP
    if model.tp_shard is None:
        return head_class(model, weights)
    if deepseek:
        from pdcluster.engine.tensor_parallel.shard import shard_tensor, split_layer

        head = DeepseekMTP(model, {name: shard_tensor(name, t, model.unsplit_arch, model.tp_shard)
                                   for name, t in weights.items()})
        split_layer(head.block, model.tp_group)
        return head
    from pdcluster.engine.tensor_parallel.shard_hybrid import shard_hybrid_tensor, split_hybrid_blocks

    head = NemotronMTP(model, {name: shard_hybrid_tensor(name, t, model.unsplit_arch, model.tp_shard)
                               for name, t in weights.items()})
    split_hybrid_blocks(head.blocks, model.tp_group)
    return head


def mtp_head(model, weights: dict[str, torch.Tensor], draft_vocab_size: int) -> MTPHead:
    """Our MTP head on ``model``: this rank's slice of its decoder layer where ``model`` is split (its q/k/v rows,
    o_proj columns, MLP rows, cut as a layer of the model's family), the layer's sums over the model's group."""
    if model.tp_shard is None:
        return MTPHead(model, weights, draft_vocab_size)
    from pdcluster.engine.tensor_parallel.shard import shard_tensor, split_layer

    cut = {}
    for name, t in weights.items():
        if name.startswith(HEAD_PREFIX):  # cut by the name a layer of the model has
            t = shard_tensor("model.layers.0." + name[len(HEAD_PREFIX):], t, model.unsplit_arch, model.tp_shard)
        cut[name] = t
    head = MTPHead(model, cut, draft_vocab_size)
    split_layer(head.layer, model.tp_group)
    return head


def load_own_mtp_weights(model_dir: str | Path, arch) -> dict[str, torch.Tensor]:
    """The checkpoint's own MTP tensors, as the model's family stores them (``arch``: the whole model's)."""
    from pdcluster.engine.models import deepseek_mtp, nemotron_mtp

    module = deepseek_mtp if isinstance(arch, DeepseekArch) else nemotron_mtp
    return module.load_own_mtp_weights(model_dir, arch)
