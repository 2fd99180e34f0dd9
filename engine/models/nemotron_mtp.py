"""NemotronH's own multi-token-prediction layers (config ``num_nextn_predict_layers``, ``mtp_layers_block_type``)
as the MTP draft model, computed as vLLM's NemotronHMTP computes them (vllm/model_executor/models/nemotron_h_mtp.py):
transformers' NemotronH has no MTP modules (it ignores ``mtp.*`` at load), so vLLM is the reference.

One MTP step at position ``p`` takes the target's final hidden state ``h_p`` (after ``norm_f``: what the LM head
reads) and the embedding of the next token ``t_{p+1}``::

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])     # 2H -> H; the embedding half first
    x = the blocks of mtp_layers_block_type (default attention, moe), each x + mixer(norm(x)), residual fused
    g = final_layernorm(x)                                # -> t_{p+2} through the target's LM head

The embedding and the LM head are the target's (shared, as vLLM shares them). Blocks are the target's block
kinds with the target's code (engine/models/nemotron_blocks.py): attention without rotary embedding, MoE on the
fused MoE core. Each attention block of the step is one *draft layer* of the paged KV cache, after the target's
attention layers (engine/kv_cache.py), so its KV travels with the target's in a KV transfer (S2);
engine/proposers/mtp.py drives it (pass 1 over the verified positions, then the k-step chain, feeding ``g`` and
the draft back in).

Weights, as the published Nemotron-3 checkpoints name them: ``mtp.layers.0.{enorm,hnorm,eh_proj}.weight`` on the
first block, ``mtp.layers.{j}.norm.weight`` and ``mtp.layers.{j}.mixer.*`` per block (the target's mixer names:
``q/k/v/o_proj``; ``gate.*``, ``experts.{e}.up_proj/down_proj``, ``shared_experts.*``, ``fc1/fc2_latent_proj``),
``mtp.layers.{last}.final_layernorm.weight``. One MTP step (``num_nextn_predict_layers`` 1), as vLLM supports;
attention, MoE and MLP blocks (a Mamba block would need its own recurrent state: refused, as in vLLM).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.nemotron_blocks import ATTENTION, MAMBA, TYPE_NAMES, build_blocks, run_blocks
from pdcluster.kernels import ops

PREFIX = "mtp.layers"


def own_mtp_problem(arch) -> str | None:
    """Why the arch's own MTP layers cannot draft (one line naming the field), or None."""
    if arch.num_nextn_predict_layers != 1:
        return (f"num_nextn_predict_layers {arch.num_nextn_predict_layers}: only 1 MTP step is supported "
                "(as in vLLM's NemotronH MTP)")
    if MAMBA in arch.mtp_layer_types:
        kinds = [TYPE_NAMES[c] for c in arch.mtp_layer_types]
        return (f"mtp_layers_block_type {kinds}: a mamba MTP block is not supported (attention, moe and mlp "
                "blocks are)")
    return None


def mtp_prefix(arch=None) -> str:
    """Where the checkpoint keeps its MTP layers (``arch``: for the interface DeepSeek's module shares)."""
    return "mtp"


def is_own_mtp_weights(weights: dict) -> bool:
    """Whether ``weights`` are a NemotronH checkpoint's MTP layers (and not our Llama-style head's ``mtp.layer.*``)."""
    return f"{PREFIX}.0.eh_proj.weight" in weights


def own_mtp_weight_names(model_dir: str | Path, arch=None) -> list[str]:
    """The ``mtp.*`` tensor names in the directory's safetensors files (headers only: nothing is read)."""
    from safetensors import safe_open

    return sorted(name for f in sorted(Path(model_dir).glob("*.safetensors"))
                  for name in safe_open(str(f), "pt").keys() if name.startswith("mtp."))


def load_own_mtp_weights(model_dir: str | Path, arch=None) -> dict[str, torch.Tensor]:
    """The directory's ``mtp.*`` tensors as stored (on the host; NemotronMTP casts them to the model's dtype),
    read from only the files that hold them."""
    from safetensors import safe_open

    weights = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.startswith("mtp."):
                    weights[name] = st.get_tensor(name)
    return weights


class NemotronMTP:
    """Inference form of one MTP step (module docstring), with MTPHead's interface (engine/models/mtp.py), so
    engine/proposers/mtp.py drives either."""

    def __init__(self, target, weights: dict[str, torch.Tensor]):
        arch = target.arch
        problem = own_mtp_problem(arch)
        if problem is not None:
            raise ValueError(problem)
        weights = {n: t.to(target.device, target.dtype) for n, t in weights.items() if n.startswith(PREFIX + ".")}

        def take(key: str, kind: str | None = None) -> torch.Tensor:
            if key not in weights:
                what = f" (mtp_layers_block_type makes it {TYPE_NAMES[kind]!r})" if kind else ""
                raise ValueError(f"NemotronH MTP weights lack {key!r}{what}")
            return weights.pop(key)

        det = target.deterministic
        last = len(arch.mtp_layer_types) - 1
        self.target = target
        self.eps = arch.rms_norm_eps
        self.enorm = take(f"{PREFIX}.0.enorm.weight")
        self.hnorm = take(f"{PREFIX}.0.hnorm.weight")
        self.eh_proj = Linear(take(f"{PREFIX}.0.eh_proj.weight"), deterministic=det)
        self.final_norm = take(f"{PREFIX}.{last}.final_layernorm.weight")
        self.blocks = build_blocks(arch, arch.mtp_layer_types, PREFIX, weights, take, det)
        #: Draft layers in the paged KV cache: one per attention block.
        self.num_draft_layers = arch.mtp_layer_types.count(ATTENTION)

    def draft_cache(self, kv_cache: torch.Tensor, first_layer: int) -> torch.Tensor:
        """This head's layers of the paged cache: the draft layers from ``first_layer`` on."""
        return kv_cache[first_layer : first_layer + self.num_draft_layers]

    def fuse(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(next_token_ids, self.target.embed_tokens)
        x = torch.cat([ops.rms_norm(emb, self.enorm, self.eps), ops.rms_norm(hidden, self.hnorm, self.eps)], dim=-1)
        return self.eh_proj(x)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, H] target (or previous MTP step) final hidden at position p
        next_token_ids: torch.Tensor,  # int64 [n]: token at p + 1
        positions: torch.Tensor,  # int64 [n]: p (unused: NemotronH attention has no positional encoding)
        draft_cache: torch.Tensor,  # draft_cache(kv_cache, num_target_layers)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the draft layers' KV at ``meta.slot_mapping`` and returns ``g`` [n, H] (after final_layernorm)."""
        return run_blocks(self.blocks, self.fuse(hidden, next_token_ids), draft_cache, meta, self.final_norm,
                          self.eps)

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(g)

    def draft_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """Greedy drafts over the whole vocabulary (the checkpoint's MTP layers were trained on all of it)."""
        return self.target.lm_head_proj(g).argmax(dim=-1)

    def reference_kv(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor):
        """K and V [n, Hkv, D] the first attention block writes for these inputs, without a cache (tests)."""
        x, residual = self.fuse(hidden, next_token_ids), None
        for block in self.blocks:
            if residual is None:
                residual = x.clone()
                y = ops.rms_norm(x, block.norm, self.eps)
            else:
                y = ops.rms_norm(x, block.norm, self.eps, residual=residual)
            if block.kind == ATTENTION:
                _, k, v = block.mixer.qkv(y)
                return k.contiguous(), v.contiguous()
            x = block.mixer(y)
        raise ValueError("the MTP step has no attention block")
