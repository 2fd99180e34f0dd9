"""Building a transformers vision module for the engine: on the meta device, then given the checkpoint's tensors.

A module built on "meta" and moved with ``to_empty`` has no values in the buffers transformers computes in
``__init__`` rather than reads from a checkpoint: the rotary frequency tables (``inv_freq``), the position indices of
a learned position embedding (SigLIP's ``position_ids``). ``loaded_module`` builds them again: each rotary module
from its own config, in float32; position indices as the arange they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdcluster.engine.multimodal.llava import read_tensors


def loaded_module(build, model_dir: Path, prefixes: tuple[str, ...], dtype: torch.dtype, device: torch.device,
                  what: str) -> torch.nn.Module:
    """``build()`` (the module, called on the meta device) with the checkpoint's tensors under ``prefixes`` (every
    one of its parameters and persistent buffers; ValueError naming the missing), in ``dtype`` on ``device``."""
    with torch.device("meta"):
        module = build()
    expected = module.state_dict()
    state = read_tensors(model_dir, prefixes)
    missing = set(expected) - set(state)
    if missing:
        raise ValueError(f"{model_dir}: the {what}'s weights lack {', '.join(sorted(missing)[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}")
    module = module.to_empty(device=device)
    module.load_state_dict({k: state[k] for k in expected}, strict=True)
    module = module.to(dtype).eval()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "config"):
                setattr(parent, name, type(child)(child.config).to(device))
    computed = {n for n, _ in module.named_buffers()} - set(module.state_dict())
    for name, buf in module.named_buffers():
        if name in computed and name.rsplit(".", 1)[-1] == "position_ids":
            buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))
    # Any other computed buffer would hold whatever the memory held: refused rather than run.
    rebuilt = {n for n in computed if n.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq", "position_ids")}
    if computed - rebuilt:
        raise ValueError(f"{model_dir}: the {what} computes buffers this loader does not rebuild: "
                         f"{', '.join(sorted(computed - rebuilt)[:3])}")
    return module
