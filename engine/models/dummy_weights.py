"""vLLM's ``--load-format dummy``: the model served with random weights, no checkpoint read. For benchmarks and
capacity planning of a model whose weights are not at hand (or not worth the download): the step times, the KV
budget and the memory are the real model's, the tokens are noise.

The model directory is seen through an overlay (engine/models/overlay.py, ``<cache>/dummy/<digest>/``): the model's
configs and tokenizer, no weight file, a config.json without ``quantization_config`` (the random weights are the
model's dtype, dense), and ``DUMMY_MARKER``. Every process that resolves the model alike (the router, each worker,
each tensor-parallel rank, a level-2 sleep reading the weights again) sees the marker, and ``load_weights``
(engine/models/causal_lm.py) and an image tower's reader (engine/multimodal/llava.py) draw instead of reading.

The names and shapes are those of the checkpoint transformers would save for the config: its model class built on
the meta device (no memory), in the saved layout (transformers >= 5 fuses MoE experts in memory and splits them
again on save: ``revert_weight_conversion``), an output embedding tied to the input one left out as a checkpoint
leaves it out. Each tensor is uniform in [LOW, HIGH) (vLLM's range) from a generator seeded by its name, so every
rank of a split model draws the same whole tensor before cutting its slice, and a reload draws the same weights.
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .overlay import place_overlay

if TYPE_CHECKING:  # torch is imported where tensors are drawn: the registry (and the CLI's parsing) imports this file
    import torch

DUMMY_MARKER = "pdcluster_dummy_weights.json"
LOW, HIGH = -1e-3, 1e-3  # vLLM's initialize_dummy_weights
SEED = 1234
# What a checkpoint's weights are in, left out of the overlay: the overlay holds no weights at all.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf",
                   ".ckpt", ".h5", ".msgpack")
# Keys of config.json that describe how stored weights are encoded (quantized, packed): the random weights are dense.
ENCODING_KEYS = ("quantization_config", "compression_config")


class DummyWeightsError(ValueError):
    """The model's config names no model transformers can build: there are no names and shapes to draw."""


def is_dummy(model_dir: str | Path) -> bool:
    return (Path(model_dir) / DUMMY_MARKER).is_file()


def with_dummy_weights(model_dir: Path, cache_dir: Path) -> Path:
    """``model_dir`` seen with random weights: its configs and tokenizer linked, no weight file, config.json without
    the weights' encoding, the marker."""
    import hashlib

    model_dir = Path(model_dir).resolve()
    config = json.loads((model_dir / "config.json").read_text())
    dense = _without_encoding(config)
    marker = json.dumps({"low": LOW, "high": HIGH, "seed": SEED, "source": str(model_dir)}, sort_keys=True)
    files = {"config.json": json.dumps(dense, indent=2, sort_keys=True), DUMMY_MARKER: marker}
    links = {f.name: f for f in model_dir.iterdir()
             if f.name not in files and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.startswith(".")}
    key = json.dumps({"model": str(model_dir), "files": files}, sort_keys=True)
    target = Path(cache_dir) / "dummy" / hashlib.sha256(key.encode()).hexdigest()[:24]
    return place_overlay(target, links, files)


def _without_encoding(config: dict) -> dict:
    out = {k: v for k, v in config.items() if k not in ENCODING_KEYS}
    for sub in ("text_config", "language_config", "llm_config"):  # a multimodal config's language model
        if isinstance(out.get(sub), dict):
            out[sub] = _without_encoding(out[sub])
    return out


def dummy_tensors(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                  keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor of the checkpoint the config describes (those ``keep(name)`` takes), drawn
    in ``dtype`` on ``device`` (integer tensors: zeros)."""
    import torch

    for name, (shape, stored) in checkpoint_shapes(str(Path(model_dir).resolve())).items():
        if keep is not None and not keep(name):
            continue
        if not stored.is_floating_point:
            yield name, torch.zeros(shape, dtype=stored, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(SEED + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, dtype=dtype, device=device).uniform_(LOW, HIGH, generator=gen)


def dummy_weights(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                  cut: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                  keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """``load_weights``' answer for a dummy directory: every tensor by its checkpoint name (those ``keep`` takes),
    ``cut`` applied to each as it is drawn (a tensor-parallel rank's slice)."""
    if cut is None:
        return dict(dummy_tensors(model_dir, dtype, device, keep))
    return {name: cut(name, t).contiguous() for name, t in dummy_tensors(model_dir, dtype, device, keep)}


@functools.lru_cache(maxsize=8)
def checkpoint_shapes(model_dir: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The checkpoint's tensor names, shapes and dtypes transformers would save for ``model_dir``'s config.json,
    from its model built on the meta device. DummyWeightsError where transformers has no model for it."""
    from pdcluster.engine.checkout_path import drop_checkout_from_sys_path

    drop_checkout_from_sys_path()  # our kernels/ would shadow the package transformers imports
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = _meta_model(transformers, config, json.loads((Path(model_dir) / "config.json").read_text()))
    params = model.state_dict(keep_vars=True)
    seen: set[int] = set()
    state = {}
    for name, tensor in params.items():  # a tied weight (lm_head = embed_tokens) is one tensor under two names
        if id(tensor) not in seen:
            seen.add(id(tensor))
            state[name] = tensor
    try:
        from transformers.core_model_loading import revert_weight_conversion  # transformers >= 5
    except ImportError:
        saved = state
    else:
        saved = revert_weight_conversion(model, state)
    return {name: (t.shape, t.dtype) for name, t in saved.items()}


def _meta_model(transformers, config, raw: dict):
    """The config's architecture class (config.json's ``architectures``), else the causal LM or image-text-to-text
    auto class, built on the meta device."""
    import torch

    candidates = [getattr(transformers, name, None) for name in raw.get("architectures") or []]
    candidates = [c for c in candidates if c is not None and hasattr(c, "_from_config")]
    autos = [getattr(transformers, name, None) for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText")]
    errors = []
    with torch.device("meta"):
        for cls in candidates:
            try:
                return cls._from_config(config)
            except Exception as e:  # noqa: BLE001 - the next way is tried; all failing is one error below
                errors.append(f"{cls.__name__}: {e}")
        for auto in autos:
            if auto is None:
                continue
            try:
                return auto.from_config(config)
            except Exception as e:  # noqa: BLE001 - as above
                errors.append(f"{auto.__name__}: {e}")
    raise DummyWeightsError(
        f"--load-format dummy: transformers {transformers.__version__} has no model for this config "
        f"(model_type {raw.get('model_type')!r}, architectures {raw.get('architectures')}): dummy weights take the "
        f"checkpoint's names and shapes from transformers' model of the config ({'; '.join(errors)[:400]})")
