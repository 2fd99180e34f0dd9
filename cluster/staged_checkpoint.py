"""A checkpoint made of the one served now with some tensors replaced: how weights a trainer broadcast reach every
worker. The router's process writes it (the replaced tensors' files anew, every other file a link to the served
one's), and the workers take it as they take any checkpoint from disk (engine/weight_update.py: read, checked
against the served model, copied in place once all could). A worker Ray restarts later reads it again, so it stays
until another update replaces it.

Only tensors the served checkpoint has, of its shapes, are taken (their dtype may differ: the loader casts, as it
casts the served files). A tied model's ``lm_head.weight`` (transformers lists it in a state dict though the
checkpoint stores only the embedding) is left out, as SGLang's loader skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_TIED_HEAD = "lm_head.weight"


class StagedCheckpointError(ValueError):
    """The tensors do not fit the served checkpoint: nothing was written."""


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, the file holding it) of the directory's *.safetensors, read from their headers.
    StagedCheckpointError for a quantized checkpoint: a trainer's full-precision tensors of its names and shapes
    would be read as its quantized codes (beside the old scales)."""
    config = Path(model_dir) / "config.json"
    quantization = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if quantization:
        raise StagedCheckpointError(f"{model_dir}: the served checkpoint is quantized "
                                    f"({quantization.get('quant_method', 'quantization_config')}); a trainer's tensors "
                                    "replace full-precision checkpoints only: serve the unquantized one")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                found[name] = (tuple(tensors.get_slice(name).get_shape()), f.name)
    if not found:
        raise StagedCheckpointError(f"{model_dir}: the served checkpoint has no *.safetensors weight files to update")
    return found


def tied_embeddings(model_dir: str | Path) -> bool:
    config = Path(model_dir) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def check_names(model_dir: str | Path, shapes: dict[str, tuple[int, ...]],
                served: dict[str, tuple[tuple[int, ...], str]] | None = None) -> list[str]:
    """The names of ``shapes`` (name -> shape) the checkpoint at ``model_dir`` takes, a tied LM head left out;
    StagedCheckpointError naming the first few that it has not, or whose shape differs. ``served``: its
    ``checkpoint_shapes`` where the caller read them already."""
    served = checkpoint_shapes(model_dir) if served is None else served
    tied = tied_embeddings(model_dir)
    unknown, wrong, taken = [], [], []
    for name, shape in shapes.items():
        if name not in served:
            if not (tied and name == _TIED_HEAD):
                unknown.append(name)
        elif tuple(served[name][0]) != tuple(shape):
            wrong.append(f"{name} {list(shape)} (served {list(served[name][0])})")
        else:
            taken.append(name)
    if unknown:
        raise StagedCheckpointError(f"{len(unknown)} tensors are not in the served checkpoint (Hugging Face names, as "
                                    f"its *.safetensors hold them): {', '.join(sorted(unknown)[:4])}")
    if wrong:
        raise StagedCheckpointError(f"{len(wrong)} tensors differ in shape from the served checkpoint's: "
                                    + "; ".join(sorted(wrong)[:4]))
    return taken


def write_staged_checkpoint(base_dir: str | Path, tensors: dict[str, torch.Tensor], parent: str | Path | None) -> Path:
    """A new directory under ``parent`` (None: the system's temporary directory) holding ``base_dir``'s checkpoint
    with ``tensors`` in place of its tensors of those names (checked by ``check_names`` first). Files with none of
    them are links to the served ones (to their real paths: ``base_dir`` may be an earlier staged checkpoint that
    goes when this one is served)."""
    base = Path(base_dir)
    served = checkpoint_shapes(base)
    taken = set(check_names(base, {name: tuple(t.shape) for name, t in tensors.items()}, served))
    by_file: dict[str, list[str]] = {}
    for name, (_, file) in served.items():
        if name in taken:
            by_file.setdefault(file, []).append(name)
    out = Path(tempfile.mkdtemp(prefix="pdcluster-weights-", dir=parent))
    try:
        for entry in sorted(base.iterdir()):
            target = out / entry.name
            if entry.name in by_file:
                with safe_open(str(entry), framework="pt") as f:
                    merged = {name: (tensors[name] if name in taken else f.get_tensor(name)).contiguous()
                              for name in f.keys()}  # noqa: SIM118
                    metadata = f.metadata()
                save_file(merged, str(target), metadata=metadata)
            else:
                os.symlink(os.path.realpath(entry), target)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out

