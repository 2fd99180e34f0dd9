"""A LLaVA checkpoint's image encoder: its image processor, vision tower and projector.

The tower is transformers' own module for its type (CLIPVisionModel, SiglipVisionModel: built from the checkpoint's
``vision_config``, its weights read from the checkpoint), the processor transformers' for the checkpoint
(``preprocessor_config.json``); the projector (linear, activation, linear) is ours. An image's embeddings are the
tower's hidden states at ``vision_feature_layer`` (a list: concatenated), CLIP's class token dropped under the
"default" strategy, through the projector: what transformers' LlavaModel.get_image_features computes.

LLaVA-NeXT (``LlavaNextForConditionalGeneration``): the processor cuts each image into its tiles and a whole-image
tile; every tile goes through the tower and projector as above; the image's embeddings are the whole-image tile's,
then the tiles' patches as one grid, the padding dropped, each row closed by the checkpoint's ``image_newline``
(transformers' LlavaNextModel.pack_image_features; the layout is spec.AnyResGrid's, which also counts them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdcluster.engine.checkout_path import drop_checkout_from_sys_path
from pdcluster.engine.linear import Linear
from pdcluster.engine.models.dummy_weights import dummy_tensors, is_dummy
from pdcluster.engine.multimodal.images import open_image
from pdcluster.engine.multimodal.spec import ImageSpec

# Where checkpoints keep the tower and the projector (transformers 5's names, then 4's).
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_NEWLINE_NAMES = ("model.image_newline", "image_newline")  # LLaVA-NeXT's row separator
# Fast mode encodes a step's images together, at most this many crops a tower call (a LLaVA-NeXT image is up to 1 +
# its most tiles): the tower's activations are not in the GPU's KV budget (engine/kv_budget.py profiles the language
# model), so one call's peak stays a few crops'.
MAX_CROPS_A_CALL = 8
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
                "relu": F.relu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def encode_in_calls(encode, images: list[bytes], per_call: int) -> list[torch.Tensor]:
    """``encode(images, first)`` (an encoder's one tower call: each image's rows, ``first`` the index of the call's
    first image, for error messages) over ``images``, ``per_call`` images a call."""
    out: list[torch.Tensor] = []
    for first in range(0, len(images), per_call):
        out += encode(images[first:first + per_call], first)
    return out


def read_tensors(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    if is_dummy(model_dir):  # --load-format dummy: the tower's weights drawn (engine/models/dummy_weights.py)
        for name, tensor in dummy_tensors(model_dir, torch.float32, keep=lambda n: n.startswith(prefixes)):
            prefix = next(p for p in prefixes if name.startswith(p))
            out[name[len(prefix):]] = tensor
        return out
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    out[name[len(prefix):]] = f.get_tensor(name)
    return out


def _tower_names(state: dict[str, torch.Tensor], expected: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tower tensors under the tower module's names: transformers versions differ on whether a
    CLIPVisionModel's names start with "vision_model." (checkpoints of either kind exist)."""
    out = {}
    for name, tensor in state.items():
        for candidate in (name, "vision_model." + name, name.removeprefix("vision_model.")):
            if candidate in expected:
                out[candidate] = tensor
                break
    return out


class _EngineLinear(torch.nn.Module):
    """An nn.Linear of the tower run by the engine's Linear (engine/linear.py): the CPU's prepacked or batch-invariant
    GEMM (7% faster than F.linear on a CLIP ViT-B/16 here, one thread), the deterministic Triton matmul on CUDA."""

    def __init__(self, linear: torch.nn.Linear, deterministic: bool):
        super().__init__()
        self.linear = Linear(linear.weight.detach(), deterministic=deterministic)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.reshape(-1, x.shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def engine_linears(module: torch.nn.Module, deterministic: bool) -> None:
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, _EngineLinear(child, deterministic))


class LlavaImageEncoder:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
                 deterministic: bool = False):
        drop_checkout_from_sys_path()
        import transformers

        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        self.spec = ImageSpec.from_config(cfg, str(model_dir / "config.json"))
        self.dtype, self.device = dtype, torch.device(device)
        self.feature_layer = cfg.get("vision_feature_layer", -2)
        self.strategy = cfg.get("vision_feature_select_strategy", "default")
        act = cfg.get("projector_hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{model_dir}: projector_hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        if not any((model_dir / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
            raise ValueError(f"{model_dir}: no preprocessor_config.json or processor_config.json (the image "
                             "processor's settings)")
        # transformers warns once when torchvision is missing and it uses its Pillow processor: the same pixels.
        logging.getLogger("transformers.models.auto.image_processing_auto").setLevel(logging.ERROR)
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        vision_cfg = transformers.AutoConfig.for_model(**cfg["vision_config"])
        vision_cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            tower = transformers.AutoModel.from_config(vision_cfg)
        expected = tower.state_dict()
        state = _tower_names(read_tensors(model_dir, _TOWER_PREFIXES), expected)
        # Buffers transformers builds itself (CLIP's position_ids) may be absent from a checkpoint; SigLIP's pooling
        # head is not read by LLaVA.
        missing = {n for n in set(expected) - set(state) if not n.endswith("position_ids") and "head." not in n}
        if missing:
            raise ValueError(f"{model_dir}: the vision tower's weights lack {', '.join(sorted(missing)[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}")
        tower = tower.to_empty(device=self.device)
        tower.load_state_dict(state, strict=False)
        for name, buf in tower.named_buffers():  # position_ids: arange, rebuilt on the device
            if name.endswith("position_ids"):
                buf.copy_(torch.arange(buf.shape[-1], device=self.device).expand_as(buf))
        self.tower = tower.to(dtype).eval()
        self.deterministic = deterministic
        engine_linears(self.tower, deterministic)
        proj = read_tensors(model_dir, _PROJECTOR_PREFIXES)
        self.w1, self.w2 = (Linear(proj[f"linear_{i}.weight"].to(self.device, dtype), deterministic=deterministic)
                            for i in (1, 2))
        self.b1, self.b2 = (proj[f"linear_{i}.bias"].to(self.device, dtype) if f"linear_{i}.bias" in proj else None
                            for i in (1, 2))
        self.image_newline = None
        if self.spec.grid is not None:
            found = read_tensors(model_dir, _NEWLINE_NAMES)  # either name, read as ""
            if "" not in found:
                raise ValueError(f"{model_dir}: a LLaVA-NeXT checkpoint without image_newline")
            self.image_newline = found[""].to(self.device, dtype)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each image's embeddings, [its placeholders, text hidden] in the model's dtype on its device. In
        deterministic mode one image at a time, so an image's embeddings are the same bits whatever other images a
        step holds; otherwise the step's images in one batch (a GPU's wider GEMMs)."""
        if self.deterministic:
            return encode_in_calls(self._encode, images, 1)
        grid = self.spec.grid
        most_crops = 1 if grid is None else 1 + max(h * w for h, w in grid.pinpoints) // grid.tile_size ** 2
        return encode_in_calls(self._encode, images, max(1, MAX_CROPS_A_CALL // most_crops))

    @torch.inference_mode()
    def _encode(self, images: list[bytes], first: int) -> list[torch.Tensor]:
        pil = [open_image(data, f"image {first + i}") for i, data in enumerate(images)]
        processed = self.processor(images=pil, return_tensors="pt")
        pixels = processed["pixel_values"]
        if self.spec.grid is None:
            out = list(self._features(pixels.to(self.device, self.dtype)))
        else:  # LLaVA-NeXT: [images, most tiles, 3, h, w], each image's tiles first (the rest padding)
            layouts = [self.spec.grid.layout(image.height, image.width) for image in pil]
            counts = [high * wide + 1 for high, wide, *_ in layouts]
            tiles = torch.cat([pixels[i, :n] for i, n in enumerate(counts)]).to(self.device, self.dtype)
            features = self._features(tiles).split(counts)
            out = [self._pack(f, layout) for f, layout in zip(features, layouts)]
        for i, (image, embeds) in enumerate(zip(pil, out)):
            want = self.spec.tokens_for_size(image.width, image.height)
            if embeds.shape[0] != want:
                raise RuntimeError(f"the vision tower gave {embeds.shape[0]} tokens for image {first + i}, expected "
                                   f"{want}")
        return out

    def _pack(self, features: torch.Tensor, layout: tuple[int, ...]) -> torch.Tensor:
        """One LLaVA-NeXT image's tiles' embeddings [1 + tiles, patches, hidden] as its placeholders' rows."""
        tiles_high, tiles_wide, row0, rows, col0, cols = layout
        side = self.spec.grid.patches_per_side
        hidden = features.shape[-1]
        grid = (features[1:].view(tiles_high, tiles_wide, side, side, hidden).permute(0, 2, 1, 3, 4)
                .reshape(tiles_high * side, tiles_wide * side, hidden))
        grid = grid[row0:row0 + rows, col0:col0 + cols]
        newline = self.image_newline.expand(rows, 1, hidden)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower and projector on a batch of crops [n, 3, h, w]: [n, tokens a crop, text hidden]."""
        states = self.tower(pixels, output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        picked = [states[i][:, 1:] if self.strategy == "default" and self._has_cls else states[i] for i in layers]
        features = torch.cat(picked, dim=-1)
        flat = features.reshape(-1, features.shape[-1])
        hidden = self.w1(flat)
        if self.b1 is not None:
            hidden = hidden + self.b1
        out = self.w2(self.act(hidden))
        if self.b2 is not None:
            out = out + self.b2
        return out.reshape(features.shape[0], features.shape[1], -1)

    @property
    def _has_cls(self) -> bool:
        return self.tower.config.model_type == "clip_vision_model"
