"""What a checkpoint's prompts hold for an image: its image token, how many placeholder tokens each image becomes,
and the expansion of a prompt's image tokens into them (the same at the API and in the engine)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pdcluster.engine.multimodal.limits import DEFAULT_MAX_IMAGES_PER_PROMPT

# Vision towers whose output is a fixed number of tokens an image (the processor resizes and crops to one size).
FIXED_SIZE_TOWERS = ("clip_vision_model", "siglip_vision_model")
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)


class ImageInputError(ValueError):
    """A request's images do not fit its prompt or cannot be read (a 400 at the API)."""


@dataclass(frozen=True)
class ImageSpec:
    architecture: str
    image_token_id: int
    tokens_per_image: int

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> ImageSpec | None:
        """The spec of a checkpoint that takes images, None for one that does not. A LLaVA whose tower gives a
        varying number of tokens an image (Pixtral's) is refused by name."""
        architecture = (cfg.get("architectures") or [None])[0]
        if architecture not in IMAGE_ARCHITECTURES:
            return None
        vision = cfg.get("vision_config") or {}
        tower = vision.get("model_type", "clip_vision_model")
        if tower not in FIXED_SIZE_TOWERS:
            raise ValueError(f"{where}: a LLaVA checkpoint with a {tower!r} vision tower is not supported (towers: "
                             f"{', '.join(FIXED_SIZE_TOWERS)})")
        layer = cfg.get("vision_feature_layer", -2)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"{where}: vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        if not isinstance(layer, int) and not (isinstance(layer, list) and layer and all(isinstance(i, int) for i in layer)):
            raise ValueError(f"{where}: vision_feature_layer must be a layer index or a list of them, got {layer!r}")
        image_size, patch_size = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        num_patches = (image_size // patch_size) ** 2
        # CLIP puts a class token first: "default" drops it, "full" keeps it; SigLIP has none.
        has_cls = tower == "clip_vision_model"
        tokens = num_patches + (1 if has_cls and strategy == "full" else 0)
        token_id = cfg.get("image_token_id", cfg.get("image_token_index", 32000))
        return cls(architecture, int(token_id), tokens)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageSpec | None:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        return cls.from_config(json.loads(path.read_text(encoding="utf-8")), str(path))

    def expand(self, prompt_token_ids: list[int], images: list[bytes],
               max_images: int = DEFAULT_MAX_IMAGES_PER_PROMPT) -> tuple[list[int], list[dict]]:
        """The prompt with each image token widened to ``tokens_per_image`` placeholders, and the images as
        ``SamplingParams.mm_inputs`` entries, in prompt order: one image an image token."""
        check_image_count(len(images), max_images)
        at = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageInputError(f"the prompt has {len(at)} image token(s) (id {self.image_token_id}) but "
                                  f"{len(images)} image(s) were given: put one image token where each image goes")
        out: list[int] = []
        items = []
        last = 0
        for pos, data in zip(at, images):
            out += prompt_token_ids[last:pos]
            items.append({"offset": len(out), "length": self.tokens_per_image, "digest": image_digest(data),
                          "data": data})
            out += [self.image_token_id] * self.tokens_per_image
            last = pos + 1
        out += prompt_token_ids[last:]
        return out, items

    def widen(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt with every image token widened to its placeholders (what ``expand`` makes of it, images
        aside: /tokenize's count)."""
        out: list[int] = []
        for t in prompt_token_ids:
            out += [t] * self.tokens_per_image if t == self.image_token_id else [t]
        return out

    def check(self, prompt_token_ids: list[int], mm_inputs: list[dict]) -> None:
        """That ``mm_inputs`` name placeholder runs of this prompt, in order, one image each (a request built
        elsewhere: checked where it is run). Image tokens outside them are not looked for here: a request resumed
        after a worker died carries its output in its prompt, and the model may have written the token."""
        end = -1
        for i, item in enumerate(mm_inputs):
            offset, length = item["offset"], item["length"]
            if length != self.tokens_per_image or offset <= end or offset + length > len(prompt_token_ids):
                raise ImageInputError(f"image {i}: {length} placeholders at {offset} do not fit this model "
                                      f"({self.tokens_per_image} an image) and prompt ({len(prompt_token_ids)} tokens)")
            if any(t != self.image_token_id for t in prompt_token_ids[offset:offset + length]):
                raise ImageInputError(f"image {i}: the prompt's tokens {offset}..{offset + length} are not its "
                                      f"image token (id {self.image_token_id})")
            end = offset + length - 1

    def check_no_image_tokens(self, prompt_token_ids: list[int]) -> None:
        """A prompt given without images holds no image token (a client's prompt: the token typed in)."""
        count = sum(1 for t in prompt_token_ids if t == self.image_token_id)
        if count:
            raise ImageInputError(f"the prompt has {count} image token(s) (id {self.image_token_id}) and no image: "
                                  "each image token stands for an image (give one an image token)")


def check_image_count(num_images: int, max_images: int) -> None:
    """At most ``max_images`` images in one prompt (vLLM's --limit-mm-per-prompt; 0: images are off)."""
    if num_images > max_images:
        if max_images == 0:
            raise ImageInputError("images are off on this server (--limit-mm-per-prompt '{\"image\": 0}'): send text")
        raise ImageInputError(f"{num_images} images in one prompt: at most {max_images} "
                              "(--limit-mm-per-prompt)")


def chat_content(parts: list[dict], chat_template: str | None, image_token: str) -> str | list[dict]:
    """A chat message's parts ({"type": "text", "text": ...} / {"type": "image"}, in order) as its chat template
    reads them: the parts themselves for a template that renders image parts (LLaVA's iterates them and writes the
    image token for each image), else the text with an image token before it for each image (vLLM's "string" content
    format)."""
    template = chat_template or ""
    if "'image'" in template or '"image"' in template:
        return parts
    texts = [p["text"] for p in parts if p["type"] == "text"]
    return "\n".join([image_token] * (len(parts) - len(texts)) + texts)


def image_digest(data: bytes) -> str:
    """The content digest an image is known by (block hashes, the encoder cache): its encoded bytes'."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def check_mm_inputs(items: list) -> list[dict]:
    """``SamplingParams.mm_inputs`` as plain dicts of the right types (they cross msgpack and Ray)."""
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not {"offset", "length", "digest", "data"} <= set(item):
            raise ValueError(f"mm_inputs[{i}] must be a dict with offset, length, digest and data")
        data = item["data"]
        if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
            raise ValueError(f"mm_inputs[{i}].data must be an image's encoded bytes")
        data = bytes(data)
        if item["digest"] != image_digest(data):
            raise ValueError(f"mm_inputs[{i}].digest does not match its data")
        offset, length = item["offset"], item["length"]
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length <= 0:
            raise ValueError(f"mm_inputs[{i}]: offset and length must be integers (offset >= 0, length > 0)")
        out.append({"offset": offset, "length": length, "digest": item["digest"], "data": data})
    return out
