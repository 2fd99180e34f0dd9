"""A checkpoint of the same architecture with other weights: what a training step writes, for checking weight
updates (engine/weight_update.py) in the tests, bench/weight_update.py and bench/gpu_check.py without a trainer."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def perturb_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 1,
                       scale: float = 0.5) -> Path:
    """A copy of the Hugging Face directory ``src_dir`` at ``out_dir`` whose every floating tensor is multiplied per
    element by 1 + ``scale`` x a normal draw of one seeded CPU generator (in file and name order: always the same
    bytes). Tensors equal in the source stay equal (a tied LM head stays tied). An existing ``out_dir`` is kept as
    it is; the copy is written beside it and renamed into place, so a reader never sees half of it."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    if out_dir.exists():
        return out_dir
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + "."))
    try:
        shutil.copytree(src_dir, tmp, dirs_exist_ok=True)
        gen = torch.Generator().manual_seed(seed)
        for f in sorted(tmp.glob("*.safetensors")):
            tensors = load_file(str(f))
            done: list[tuple[torch.Tensor, torch.Tensor]] = []  # (before, after)
            for name in sorted(tensors):
                t = tensors[name]
                if not t.is_floating_point():
                    continue
                same = next((after for before, after in done if before.shape == t.shape and torch.equal(before, t)),
                            None)
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[name] = same if same is not None else (t.float() * (1 + scale * noise)).to(t.dtype)
                done.append((t, tensors[name]))
            save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
