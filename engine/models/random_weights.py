"""Random weights at a scale where every block matters, for a NemotronH made by transformers
(``NemotronHForCausalLM(config)``): transformers' own std-0.02 init gives near-flat logits, so greedy
tokens would hinge on ties. The tests' transformers-made NemotronH models (tests/test_hybrid_model.py,
tests/test_nemotron_moe.py) and bench/gpu_check.py's draw theirs here, so both check the same kind of
model. A_log and dt_bias keep transformers' init (A = 1..H, dt in [time_step_min, time_step_max]). ``pin_dt_limit``
makes such a model's dt clamp the same on every transformers version."""

from __future__ import annotations

import torch

# Norm weights and D: uniform in [NORM_LOW, NORM_LOW + NORM_WIDTH), not all ones, so a loader that forgets one
# is caught.
NORM_LOW, NORM_WIDTH = 0.8, 0.4
EMBED_STD = 0.5
OUTPUT_GAIN = 3.0  # out_proj, o_proj, down_proj: the blocks outweigh the token's own embedding
INPUT_GAIN = 1.5  # every other matrix


def redraw_nemotron_h(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraws ``model``'s parameters in place from one seeded CPU generator, in parameter order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name or name.endswith(".D"):
                p.copy_(NORM_LOW + NORM_WIDTH * torch.rand(p.shape, generator=gen))
            elif name.endswith("embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * EMBED_STD)
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                output = name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight"))
                gain = OUTPUT_GAIN if output else INPUT_GAIN
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[-1] ** 0.5)


def pin_dt_limit(model: torch.nn.Module) -> torch.nn.Module:
    """Every Mamba mixer of a transformers NemotronH clamps dt at its config's ``time_step_limit``, as transformers
    >= 5.25, vLLM and mamba_ssm do (and our engine: engine/models/nemotron_h.py). Older transformers clamped its
    chunked path at ``time_step_min`` (the dt_bias init's lower end); the oracle means the same on either version.
    Returns the model."""
    from pdcluster.engine.models.granite_hybrid import _number  # a saved config may spell inf {"__float__": ...}

    limit = tuple(_number(x) for x in getattr(model.config, "time_step_limit", (0.0, float("inf"))))
    for module in model.modules():
        if hasattr(module, "time_step_limit") and hasattr(module, "dt_bias"):
            module.time_step_limit = limit
    return model
