"""Pipeline parallelism (vLLM's ``--pipeline-parallel-size``): a model's layers cut into consecutive stages, one rank
each, for a model too large for one device. Rank 0 (the engine's process) holds the first stage with the embedding and
the head, and schedules and samples as it does whole; ranks 1 .. n-1 are the tensor-parallel machinery's worker
processes (engine/tensor_parallel/driver.py and worker.py: spawned, handed each forward's inputs, stopped with the
engine), each loading only its stage's layers and a KV cache for those layers alone (block ids are every rank's: the
same block tables reach every rank with each forward).

A forward: every rank gets the step's inputs; stage 0 embeds and runs its layers; each stage hands its hidden states
and residual to the next (``TPGroup.broadcast_``: NCCL's broadcast on GPUs, the shared-memory all-reduce with zeros
from the others on CPUs, bit for bit); the last stage's final norm comes back to rank 0, which computes the logits.
Stages run one after another (no micro-batches in flight): the point is the memory, each rank holding 1/n of the
layers' weights and KV. The split is exact: every layer runs the kernels it runs whole, so tokens and logprobs equal
the whole model's.

What it does not combine with is refused by name (engine/pipeline_checks.py for the settings, ``check_model`` for
the model): tensor parallelism within the same engine, draft layers (MTP, EAGLE, a draft model; n-gram runs), LoRA,
the KV offload tiers and KV transfer (they read rank 0's cache, which holds its stage's layers only), hybrids and
latent attention, images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Stage:
    index: int  # the rank
    num_stages: int
    first_layer: int
    end_layer: int  # one past the last

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_of(index: int, num_stages: int, num_layers: int) -> Stage:
    """Stage ``index`` of ``num_layers`` layers cut into ``num_stages`` consecutive runs as equal as they come, the
    remainder to the later stages (rank 0 also embeds, computes the logits and schedules; vLLM gives its first
    stage no more than the others either)."""
    base, extra = divmod(num_layers, num_stages)
    first = index * base + max(0, index - (num_stages - extra))
    size = base + (1 if index >= num_stages - extra else 0)
    return Stage(index, num_stages, first, first + size)


def check_model(model_class, arch, num_stages: int, takes_images: bool) -> None:
    """ValueError naming why the model does not cut into ``num_stages`` stages here (a model class says it cuts with
    ``PIPELINE_PARALLEL`` of its own: LlamaModel)."""
    if not vars(model_class).get("PIPELINE_PARALLEL"):
        raise ValueError(f"pipeline_parallel_size {num_stages}: {model_class.__name__} models are not cut into stages "
                         "here (the Llama family is: Llama, Qwen, Mistral, Mixtral, Qwen-MoE, ...); use "
                         "--tensor-parallel-size")
    if arch.num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages}: the model has {arch.num_layers} layers, fewer than "
                         "the stages")
    if takes_images:
        raise ValueError(f"pipeline_parallel_size {num_stages}: images are not served on a pipeline split yet; serve "
                         "text with --limit-mm-per-prompt '{\"image\": 0}'")


def forward_stage(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta,
                  on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
    """One forward of ``model``'s stage (LlamaModel.forward with ``pp_stage`` set): every rank takes part in every
    hand-over, in stage order. Returns the final hidden states [num_tokens, hidden] on every rank (rank 0 computes the
    logits from them). ``kv_cache`` holds this stage's layers, index 0 its first."""
    stage, group = model.pp_stage, model.pp_group
    num_tokens, width = input_ids.shape[0], model.arch.hidden_size
    hidden = residual = None
    if stage.index == 0:
        hidden = F.embedding(input_ids, model.embed_tokens)
        model.put_prompt_rows(hidden)
        if model.arch.embedding_multiplier != 1.0:
            hidden.mul_(model.arch.embedding_multiplier)
        hidden, residual = _run_layers(model, hidden, None, positions, kv_cache, meta, on_layer_done)
    dtype, device = model.dtype, positions.device
    for src in range(stage.num_stages - 1):
        if src == stage.index:
            handed = torch.cat([hidden, residual], dim=1)
        else:
            handed = torch.empty(num_tokens, 2 * width, dtype=dtype, device=device)
        group.broadcast_(handed, src)
        if src + 1 == stage.index:
            hidden, residual = handed[:, :width].contiguous(), handed[:, width:].contiguous()
            hidden, residual = _run_layers(model, hidden, residual, positions, kv_cache, meta, on_layer_done)
    if stage.is_last:
        out = model.final_norm(hidden, residual).contiguous()
    else:
        out = torch.empty(num_tokens, width, dtype=dtype, device=device)
    return group.broadcast_(out, stage.num_stages - 1)


def _run_layers(model, hidden, residual, positions, kv_cache, meta, on_layer_done):
    for local, layer in enumerate(model.layers):
        rope = model.sliding_rope if model.sliding_rope is not None and layer.window else model.rope
        hidden, residual = layer.forward(hidden, residual, positions, rope, kv_cache[local], meta)
        if on_layer_done is not None:
            on_layer_done(model.pp_stage.first_layer + local)
    return hidden, residual
