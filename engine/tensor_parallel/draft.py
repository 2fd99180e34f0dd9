"""MTP drafts on a split model: a checkpoint's own MTP layers, NemotronH's (engine/models/nemotron_mtp.py) and
DeepSeek-V3's (engine/models/deepseek_mtp.py), and on a Llama-family target our MTP head (engine/models/mtp.py, a
trained one or the seeded random one; on a hybrid target too), an EAGLE or an EAGLE-3 draft (engine/models/eagle.py,
eagle3.py). Every rank holds its slice of the MTP step's blocks, cut by the same rules as the model's
(shard_hybrid.py: ``mtp.layers.*`` by ``mtp_layer_types``; shard.py: DeepSeek's MTP layer, under
``model.layers.{num_hidden_layers}``, and a draft head's decoder layer, as a Llama layer), and the step's attention
writes each rank's KV heads (DeepSeek: the whole latent) into its own draft layers. An EAGLE-3 draft reads the
target's aux hidden states: every rank captures its own (the residual stream is whole on every rank) and fuses the
same rows of them.

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
from pdcluster.engine.models.eagle import EagleHead, is_eagle_weights
from pdcluster.engine.models.eagle3 import Eagle3Head, is_eagle3_weights
from pdcluster.engine.models.mtp import MTPHead
from pdcluster.engine.models.nemotron_mtp import NemotronMTP


def own_mtp_head(model, weights: dict[str, torch.Tensor]) -> NemotronMTP | DeepseekMTP:
    """``model``'s own MTP step from the checkpoint's tensors: this rank's slice of it where ``model`` is split
    (CausalLM.tp_shard), its blocks' output projections summed over the model's group."""
    deepseek = isinstance(model.arch, DeepseekArch)
    head_class = DeepseekMTP if deepseek else NemotronMTP
    if model.tp_shard is None:
        return head_class(model, weights)
    from pdcluster.engine.tensor_parallel.shard import shard_tensor, split_layer
    from pdcluster.engine.tensor_parallel.shard_hybrid import split_hybrid_blocks

    # shard_tensor cuts a hybrid's mtp.layers.* by shard_hybrid.py's rules, DeepSeek's MTP layer as any of its layers
    head = head_class(model, {name: shard_tensor(name, t, model.unsplit_arch, model.tp_shard)
                              for name, t in weights.items()})
    if deepseek:
        split_layer(head.block, model.tp_group)
    else:
        split_hybrid_blocks(head.blocks, model.tp_group)
    return head


def draft_head(model, weights: dict[str, torch.Tensor], draft_vocab_size: int,
               max_tokens: int) -> MTPHead | EagleHead | Eagle3Head:
    """The draft head ``weights`` are on ``model`` (a Llama-family one; our MTP head on a hybrid too): an EAGLE-3
    draft (``max_tokens``: its aux hidden state buffer, eagle3_buffer_tokens), an EAGLE draft or our MTP head; this
    rank's slice of its decoder layer where ``model`` is split (q/k/v rows, o_proj columns, MLP rows, cut as a Llama
    layer), the layer's sums over the model's group."""
    if is_eagle3_weights(weights):
        return _split_head(model, weights, "eagle3.layer.", lambda w: Eagle3Head(model, w, max_tokens))
    if is_eagle_weights(weights):
        return _split_head(model, weights, "eagle.layer.", lambda w: EagleHead(model, w, draft_vocab_size))
    return _split_head(model, weights, "mtp.layer.", lambda w: MTPHead(model, w, draft_vocab_size))


def eagle3_buffer_tokens(config) -> int:
    """An EAGLE-3 draft's aux hidden state buffer: the largest step (a prefill budget, a graph bucket of k + 1 a
    row)."""
    return max(config.max_num_batched_tokens, config.max_num_seqs * (1 + config.num_spec_tokens),
               config.mixed_cuda_graph_tokens)


def _split_head(model, weights: dict[str, torch.Tensor], layer_prefix: str, make):
    if model.tp_shard is None:
        return make(weights)
    from pdcluster.engine.tensor_parallel.shard import shard_layer_tensor, split_layer

    cut = {}
    for name, t in weights.items():
        if name.startswith(layer_prefix):  # cut as a Llama layer (a hybrid target's head too) of the model's heads
            t = shard_layer_tensor("model.layers.0." + name[len(layer_prefix):], t, model.unsplit_arch,
                                   model.tp_shard)
        cut[name] = t
    head = make(cut)
    split_layer(head.layer, model.tp_group)
    return head


def load_own_mtp_weights(model_dir: str | Path, arch) -> dict[str, torch.Tensor]:
    """The checkpoint's own MTP tensors, as the model's family stores them (``arch``: the whole model's)."""
    from pdcluster.engine.models import deepseek_mtp, nemotron_mtp

    module = deepseek_mtp if isinstance(arch, DeepseekArch) else nemotron_mtp
    return module.load_own_mtp_weights(model_dir, arch)
