"""What a checkpoint's prompts hold for an image: its image token, how many placeholder tokens each image becomes,
and the expansion of a prompt's image tokens into them (the same at the API and in the engine).

LLaVA 1.5's tower sees one fixed-size crop: every image is the same number of tokens. LLaVA-NeXT's ("anyres") sees
the image resized onto the best of its grid of tile layouts plus the whole image at one tile's size; its placeholders
are one tile's patches, then the tiles' patches with the padding rows or columns the resize left dropped, a newline
embedding closing each row: the count follows the image's size (``AnyResGrid``).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL resize each image to multiples of a merged patch (28 pixels; Qwen3-VL's 32) within a
pixel budget and give
one placeholder per merged patch (``MergedPatchGrid``): the count follows the size too, and the placeholders take
M-RoPE positions by their row and column (engine/multimodal/mrope.py).

Gemma 3 resizes every image to one square (SigLIP's 896 pixels) and pools it to ``mm_tokens_per_image`` soft tokens;
the prompt's ``<start_of_image>`` becomes "\n\n", itself, the soft tokens, ``<end_of_image>``, "\n\n" (``Gemma3Frame``),
the newlines merged with their neighbours as the tokenizer would have them, and an image's soft tokens attend to each
other both ways (engine/multimodal/bidirectional.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdcluster.engine.multimodal.images import image_size as encoded_image_size  # apart from towers' image_size
from pdcluster.engine.multimodal.inputs import EMBED_DTYPES, ImageEmbedding, ImageInputError
from pdcluster.engine.multimodal.limits import DEFAULT_MAX_IMAGES_PER_PROMPT

# Vision towers whose output is a fixed number of tokens an image (the processor resizes and crops to one size).
FIXED_SIZE_TOWERS = ("clip_vision_model", "siglip_vision_model")
LLAVA_NEXT = "LlavaNextForConditionalGeneration"
MISTRAL3 = "Mistral3ForConditionalGeneration"
QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                         "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
GEMMA3 = "Gemma3ForConditionalGeneration"
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", LLAVA_NEXT, MISTRAL3, GEMMA3) + QWEN_VL_ARCHITECTURES


# What a request with images is told where --limit-mm-per-prompt turned them off (the API's and the engine's words).
IMAGES_OFF = "images are off on this server (--limit-mm-per-prompt '{\"image\": 0}'): send text"


@dataclass(frozen=True)
class AnyResGrid:
    """LLaVA-NeXT's tiling: ``tile_size`` pixels a tile side (the tower's image size), ``patches_per_side`` patches a
    tile side, ``pinpoints`` the (height, width) in pixels an image may be resized onto (multiples of a tile)."""

    tile_size: int
    patches_per_side: int
    pinpoints: tuple[tuple[int, int], ...]

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint an image is resized onto: the most of its pixels kept, then the least area wasted (as
        transformers' select_best_resolution)."""
        best, best_kept, best_wasted = self.pinpoints[0], -1, float("inf")
        for pin_h, pin_w in self.pinpoints:
            scale = min(pin_w / width, pin_h / height)
            kept = min(int(width * scale) * int(height * scale), width * height)
            wasted = pin_h * pin_w - kept
            if kept > best_kept or (kept == best_kept and wasted < best_wasted):
                best, best_kept, best_wasted = (pin_h, pin_w), kept, wasted
        return best

    def layout(self, height: int, width: int) -> tuple[int, int, int, int, int, int]:
        """(tiles high, tiles wide, first row, rows, first column, columns) of an image ``height`` x ``width`` pixels:
        its tiles' patch grid and the part of it the image covers (the padding the aspect-preserving resize left,
        centred, is dropped; transformers' unpad_image)."""
        pin_h, pin_w = self.best_resolution(height, width)
        tiles_high, tiles_wide = pin_h // self.tile_size, pin_w // self.tile_size
        grid_h, grid_w = tiles_high * self.patches_per_side, tiles_wide * self.patches_per_side
        if width / height > grid_w / grid_h:
            new_h = int(round(height * (grid_w / width), 7))
            pad = (grid_h - new_h) // 2
            return tiles_high, tiles_wide, pad, grid_h - 2 * pad, 0, grid_w
        new_w = int(round(width * (grid_h / height), 7))
        pad = (grid_w - new_w) // 2
        return tiles_high, tiles_wide, 0, grid_h, pad, grid_w - 2 * pad

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholders of an image: the whole image's tile, then each kept row of patches and its newline."""
        _, _, _, rows, _, cols = self.layout(height, width)
        return self.patches_per_side ** 2 + rows * (cols + 1)


@dataclass(frozen=True)
class MergedPatchGrid:
    """Qwen2-VL's image layout: an image resized to multiples of ``patch_size * merge_size`` pixels a side, its pixel
    count within [min_pixels, max_pixels] (transformers' smart_resize), then one placeholder per merged patch."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels the processor resizes an image to; ImageInputError past 200:1."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ImageInputError(f"a {width}x{height} image: the aspect ratio must be at most 200:1")
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def merged_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of an image's placeholders: its merged patches."""
        factor = self.patch_size * self.merge_size
        h_bar, w_bar = self.resized(height, width)
        return h_bar // factor, w_bar // factor

    def num_tokens(self, height: int, width: int) -> int:
        rows, cols = self.merged_grid(height, width)
        return rows * cols

    @classmethod
    def from_configs(cls, vision: dict, processor: dict) -> MergedPatchGrid:
        """From config.json's ``vision_config`` and preprocessor_config.json (its ``min_pixels`` / ``max_pixels``
        over ``size``'s, as transformers reads them)."""
        size = processor.get("size") or {}
        patch = int(processor.get("patch_size") or vision.get("patch_size") or vision.get("spatial_patch_size") or 14)
        merge = int(processor.get("merge_size") or vision.get("spatial_merge_size") or 2)
        least = processor.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
        most = processor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
        return cls(patch, merge, int(least), int(most))


@dataclass(frozen=True)
class PixtralGrid:
    """Mistral 3's (Pixtral's) image layout: an image shrunk to fit ``longest_edge`` pixels a side, then padded up to
    multiples of ``cell`` pixels (a patch times the spatial merge); each row of cells is an image token a cell then
    a break token, the last break an end token (transformers' PixtralProcessor.replace_image_token)."""

    cell: int
    longest_edge: int
    break_token_id: int
    end_token_id: int

    def cells(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of an image's cells."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return (height - 1) // self.cell + 1, (width - 1) // self.cell + 1

    def run(self, rows: int, cols: int, image_token_id: int) -> list[int]:
        """The placeholder run of an image of ``rows`` x ``cols`` cells."""
        out = ([image_token_id] * cols + [self.break_token_id]) * rows
        out[-1] = self.end_token_id
        return out


@dataclass(frozen=True)
class Gemma3Frame:
    """Gemma 3's frame around an image's soft tokens (Gemma3Processor's full_image_sequence): the prompt's
    ``boi_token_id`` (its image token) becomes "\\n\\n", itself, the soft tokens, ``eoi_token_id``, "\\n\\n".
    ``newline_ids[k - 1]``: the tokenizer's one token for k newlines (k = 1, 2, ...: a "\\n\\n" next to other
    newlines is merged with them into one token where one exists, as tokenizing the processor's text would)."""

    boi_token_id: int
    eoi_token_id: int
    soft_token_id: int
    newline_ids: tuple[int, ...]

    def newlines(self, token_id: int) -> int:
        """How many newlines the token is (0: not a run of newlines)."""
        return self.newline_ids.index(token_id) + 1 if token_id in self.newline_ids else 0

    def join(self, out: list[int], tokens: list[int]) -> None:
        """``tokens`` appended to ``out``, the newline tokens meeting at the seam merged into one where the
        tokenizer has one for their count."""
        if out and tokens:
            k = self.newlines(out[-1]) + self.newlines(tokens[0]) if self.newlines(out[-1]) and self.newlines(
                tokens[0]) else 0
            if 0 < k <= len(self.newline_ids):
                out[-1] = self.newline_ids[k - 1]
                tokens = tokens[1:]
        out += tokens

    def run(self, length: int) -> tuple[list[int], list[int], list[int]]:
        """(before, soft tokens, after) of an image of ``length`` soft tokens."""
        two = self.newline_ids[1]
        return [two, self.boi_token_id], [self.soft_token_id] * length, [self.eoi_token_id, two]


def _mm_item(image: bytes | ImageEmbedding, offset: int, length: int) -> dict:
    """An image's ``SamplingParams.mm_inputs`` entry: its placeholders' place in the prompt, its digest and data."""
    if isinstance(image, ImageEmbedding):
        return {"offset": offset, "length": length, "digest": image_digest(image.data), "data": image.data,
                "embeds": [image.dtype, image.rows, image.hidden]}
    return {"offset": offset, "length": length, "digest": image_digest(image), "data": image}


@dataclass(frozen=True)
class ImageSpec:
    architecture: str
    image_token_id: int
    tokens_per_image: int  # LLaVA-NeXT: one tile's (the fewest an image may have); see tokens_for
    grid: AnyResGrid | None = None  # LLaVA-NeXT's tiling: the count follows each image's size
    hidden_size: int | None = None  # the language model's (an image's embeddings are this wide); None: not stated
    patches: MergedPatchGrid | None = None  # Qwen2-VL's layout: the count follows each image's size, M-RoPE rows
    pixtral: PixtralGrid | None = None  # Mistral 3's layout: rows of cells closed by break tokens
    frame: Gemma3Frame | None = None  # Gemma 3: image_token_id is <start_of_image>, the placeholders soft tokens

    @property
    def bidirectional(self) -> bool:
        """An image's placeholders attend to each other both ways (Gemma 3): a prefill chunk never ends inside one."""
        return self.frame is not None

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json", processor: dict | None = None,
                    tokens: dict[str, int] | None = None) -> ImageSpec | None:
        """The spec of a checkpoint that takes images, None for one that does not. A LLaVA with a tower other than
        CLIP's, SigLIP's or Pixtral's is refused by name. ``processor``: preprocessor_config.json
        (Qwen2-VL's pixel budget, Pixtral's longest edge; transformers' defaults without it); ``tokens``: the
        tokenizer's added tokens by content (Mistral 3's break and end tokens)."""
        architecture = (cfg.get("architectures") or [None])[0]
        if architecture not in IMAGE_ARCHITECTURES:
            return None
        if architecture == GEMMA3:
            return cls._gemma3(cfg, where, processor or {}, tokens)
        if architecture == MISTRAL3:
            return cls._pixtral(cfg, where, processor or {}, tokens or {}, merge=int(cfg.get("spatial_merge_size", 2)))
        if architecture in QWEN_VL_ARCHITECTURES:
            text = {**cfg, **(cfg.get("text_config") or {})}
            patches = MergedPatchGrid.from_configs(cfg.get("vision_config") or {}, processor or {})
            hidden = text.get("hidden_size")
            least = max(1, patches.min_pixels // (patches.patch_size * patches.merge_size) ** 2)
            return cls(architecture, int(cfg.get("image_token_id", 151655)), least,
                       hidden_size=int(hidden) if isinstance(hidden, int) else None, patches=patches)
        vision = cfg.get("vision_config") or {}
        tower = vision.get("model_type", "clip_vision_model")
        if tower == "pixtral" and architecture == "LlavaForConditionalGeneration":  # Pixtral-12B in LLaVA's form
            if cfg.get("vision_feature_select_strategy", "default") != "full":
                raise ValueError(f"{where}: a LLaVA checkpoint with a Pixtral tower needs vision_feature_select_"
                                 "strategy 'full' (the tower has no class token)")
            return cls._pixtral(cfg, where, processor or {}, tokens or {}, merge=1)
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
        grid = None
        if architecture == LLAVA_NEXT:
            if not has_cls or strategy != "default":
                raise ValueError(f"{where}: a LLaVA-NeXT checkpoint needs a CLIP tower and the 'default' feature "
                                 f"strategy (its tiles' patch grids), got {tower!r} and {strategy!r}")
            pins = cfg.get("image_grid_pinpoints") or []
            if not pins or not all(isinstance(p, list) and len(p) == 2 and all(
                    isinstance(v, int) and v > 0 and v % image_size == 0 for v in p) for p in pins):
                raise ValueError(f"{where}: image_grid_pinpoints must list [height, width] pairs, multiples of the "
                                 f"tower's image_size {image_size}, got {pins!r}")
            grid = AnyResGrid(image_size, image_size // patch_size, tuple((h, w) for h, w in pins))
        hidden = (cfg.get("text_config") or {}).get("hidden_size")
        return cls(architecture, int(token_id), tokens, grid, int(hidden) if isinstance(hidden, int) else None)

    @classmethod
    def _pixtral(cls, cfg: dict, where: str, processor: dict, tokens: dict[str, int], merge: int) -> ImageSpec | None:
        """Pixtral's tower (Mistral 3, merging ``merge`` x ``merge`` patches into a cell; Pixtral-12B as a LLaVA, one
        patch a cell); None (served for text) where the tokenizer lacks the break / end tokens."""
        architecture = (cfg.get("architectures") or [None])[0]
        vision = cfg.get("vision_config") or {}
        if vision.get("model_type", "pixtral") != "pixtral":
            raise ValueError(f"{where}: a Mistral 3 checkpoint with a {vision.get('model_type')!r} tower is not "
                             "supported (pixtral)")
        names = (processor.get("image_break_token", "[IMG_BREAK]"), processor.get("image_end_token", "[IMG_END]"))
        if not all(name in tokens for name in names):
            return None
        patch = processor.get("patch_size") or vision.get("patch_size") or 14
        patch = int(patch["height"] if isinstance(patch, dict) else patch)
        size = processor.get("size") or {}
        longest = int(size.get("longest_edge") or vision.get("image_size") or 1540)
        grid = PixtralGrid(patch * merge, longest, tokens[names[0]], tokens[names[1]])
        hidden = (cfg.get("text_config") or {}).get("hidden_size")
        return cls(architecture, int(cfg.get("image_token_index", cfg.get("image_token_id", 10))), 1,
                   hidden_size=int(hidden) if isinstance(hidden, int) else None, pixtral=grid)

    @classmethod
    def _gemma3(cls, cfg: dict, where: str, processor: dict, newline_ids) -> ImageSpec | None:
        """Gemma 3's SigLIP tower pooled to ``mm_tokens_per_image`` soft tokens an image (``newline_ids``: the
        tokenizer's newline-run tokens, _newline_ids; None, or without "\\n\\n": served for text)."""
        vision = cfg.get("vision_config") or {}
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"{where}: a Gemma 3 checkpoint with a {vision.get('model_type')!r} tower is not "
                             "supported (siglip_vision_model)")
        if processor.get("do_pan_and_scan"):
            raise ValueError(f"{where}: the image processor's do_pan_and_scan is not supported (each image is one "
                             "square crop)")
        if not newline_ids or len(newline_ids) < 2:
            return None
        num_tokens = int(cfg.get("mm_tokens_per_image", 256))
        side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 14))
        per_side = math.isqrt(num_tokens)
        if per_side * per_side != num_tokens or side % per_side:
            raise ValueError(f"{where}: mm_tokens_per_image {num_tokens} must be a square whose side divides the "
                             f"tower's {side} patches a side")
        frame = Gemma3Frame(int(cfg.get("boi_token_index", 255_999)), int(cfg.get("eoi_token_index", 256_000)),
                            int(cfg.get("image_token_index", 262_144)), tuple(newline_ids))
        hidden = (cfg.get("text_config") or {}).get("hidden_size", 2304)
        return cls(GEMMA3, frame.boi_token_id, num_tokens, hidden_size=int(hidden), frame=frame)

    @classmethod
    def from_dir(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> ImageSpec | None:
        """The spec of the checkpoint in ``model_dir`` (with its preprocessor_config.json; a Qwen2-VL without one is
        served for text); ``processor_kwargs``: the server's --mm-processor-kwargs over the processor's settings
        (ValueError for a key this model's processor does not take here)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text(encoding="utf-8"))
        architecture = (cfg.get("architectures") or [None])[0]
        if processor_kwargs:
            check_processor_kwargs(architecture, processor_kwargs)
        processor = Path(model_dir) / "preprocessor_config.json"
        pixtral = architecture == MISTRAL3 or (cfg.get("vision_config") or {}).get("model_type") == "pixtral"
        if not processor.is_file():
            if architecture in QWEN_VL_ARCHITECTURES or architecture == MISTRAL3:
                return None  # no pixel budget to place images by: its language model served for text
            return cls.from_config(cfg, str(path))
        tokens = _added_tokens(Path(model_dir)) if pixtral else None
        if architecture == GEMMA3:
            tokens = _newline_ids(str(Path(model_dir) / "tokenizer.json"))
        settings = {**json.loads(processor.read_text(encoding="utf-8")), **(processor_kwargs or {})}
        return cls.from_config(cfg, str(path), settings, tokens)

    def tokens_for(self, data: bytes, label: str = "image") -> int:
        """How many placeholders an image (its encoded bytes) becomes; ImageInputError for bytes that are no image."""
        if self.grid is None and self.patches is None and self.pixtral is None:
            return self.tokens_per_image
        return self.tokens_for_size(*encoded_image_size(data, label))

    def tokens_for_size(self, width: int, height: int) -> int:
        """How many placeholders an image of ``width`` x ``height`` pixels becomes."""
        if self.patches is not None:
            return self.patches.num_tokens(height, width)
        if self.pixtral is not None:
            rows, cols = self.pixtral.cells(height, width)
            return rows * (cols + 1)
        return self.tokens_per_image if self.grid is None else self.grid.num_tokens(height, width)

    def expand(self, prompt_token_ids: list[int], images: list[bytes | ImageEmbedding],
               max_images: int = DEFAULT_MAX_IMAGES_PER_PROMPT) -> tuple[list[int], list[dict]]:
        """The prompt with each image token widened to its image's placeholders, and the images (encoded bytes, or
        ImageEmbedding) as ``SamplingParams.mm_inputs`` entries, in prompt order: one image an image token. A prompt
        already widened (token ids from the model's own processor, as vLLM takes them too) is taken as it is."""
        check_image_count(len(images), max_images)
        for i, image in enumerate(images):
            if isinstance(image, ImageEmbedding) and not self.takes_embeddings:
                raise ImageInputError(self.embeddings_refused(i))
        at = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        # Widened already: more image tokens than images, or Gemma 3's soft tokens (its image token opens the run).
        marker = self.image_token_id if self.frame is None else self.frame.soft_token_id
        if images and (len(at) != len(images) or self.frame is not None and marker in prompt_token_ids):
            items = self._widened_items(prompt_token_ids, images, marker)
            if items is not None:
                return list(prompt_token_ids), items
            if self.frame is not None:  # soft tokens that are no image's run: widening again would keep them
                raise ImageInputError(f"the prompt holds image placeholders (id {marker}) that are not each image's "
                                      "whole run of placeholders, in order, as the model's processor writes it")
        if len(at) != len(images):
            raise ImageInputError(f"the prompt has {len(at)} image token(s) (id {self.image_token_id}) but "
                                  f"{len(images)} image(s) were given: put one image token where each image goes "
                                  "(or each image's whole run of placeholders, as the model's processor writes it)")
        out: list[int] = []
        items = []
        last = 0
        frame = self.frame
        for i, (pos, image) in enumerate(zip(at, images)):
            self._join(out, prompt_token_ids[last:pos])
            length = self._length(image, i)
            if frame is not None:
                self._join(out, frame.run(length)[0])
            items.append(_mm_item(image, len(out), length))
            out += self.placeholder_ids(length, None if isinstance(image, ImageEmbedding) else image)
            if frame is not None:
                out += frame.run(length)[2]
            last = pos + 1
        self._join(out, prompt_token_ids[last:])
        return out, items

    def _length(self, image: bytes | ImageEmbedding, i: int) -> int:
        return image.rows if isinstance(image, ImageEmbedding) else self.tokens_for(image, f"image {i}")

    def _widened_items(self, prompt_token_ids: list[int], images: list, marker: int) -> list[dict] | None:
        """The images' entries where the prompt holds each image's whole run of placeholders, in order, and no other
        (Gemma 3's framed by its begin and end tokens); else None."""
        items = []
        cursor = 0
        for i, image in enumerate(images):
            length = self._length(image, i)
            run = self.placeholder_ids(length, None if isinstance(image, ImageEmbedding) else image)
            try:
                start = prompt_token_ids.index(marker, cursor)
            except ValueError:
                return None
            end = start + len(run)
            if prompt_token_ids[start:end] != run:
                return None
            if self.frame is not None and (start == 0 or prompt_token_ids[start - 1] != self.frame.boi_token_id
                                           or prompt_token_ids[end:end + 1] != [self.frame.eoi_token_id]):
                return None
            items.append(_mm_item(image, start, length))
            cursor = end
        return None if marker in prompt_token_ids[cursor:] else items

    def _join(self, out: list[int], tokens: list[int]) -> None:
        if self.frame is None:
            out += tokens
        else:
            self.frame.join(out, tokens)

    def check(self, prompt_token_ids: list[int], mm_inputs: list[dict]) -> None:
        """That ``mm_inputs`` name placeholder runs of this prompt, in order, one image each (a request built
        elsewhere: checked where it is run). Image tokens outside them are not looked for here: a request resumed
        after a worker died carries its output in its prompt, and the model may have written the token."""
        end = -1
        for i, item in enumerate(mm_inputs):
            offset, length = item["offset"], item["length"]
            if "embeds" in item and not self.takes_embeddings:
                raise ImageInputError(self.embeddings_refused(i))
            # Embeddings' rows are their placeholders (check_mm_inputs saw that they agree).
            want = length if "embeds" in item else self.tokens_for(item["data"], f"image {i}")
            if length != want or offset <= end or offset + length > len(prompt_token_ids):
                raise ImageInputError(f"image {i}: {length} placeholders at {offset} do not fit this model "
                                      f"({want} for this image) and prompt ({len(prompt_token_ids)} tokens)")
            if prompt_token_ids[offset:offset + length] != self.placeholder_ids(length, item.get("data")):
                raise ImageInputError(f"image {i}: the prompt's tokens {offset}..{offset + length} are not its "
                                      f"image token (id {self.image_token_id})")
            end = offset + length - 1

    @property
    def takes_embeddings(self) -> bool:
        """Whether an image may be given as its embeddings (not where the layout needs the image's grid)."""
        return self.patches is None and self.pixtral is None

    def placeholder_ids(self, length: int, data: bytes | None) -> list[int]:
        """The prompt's run of ``length`` placeholders for an image (``data``, its encoded bytes; None for
        embeddings): the image token each, or Mistral 3's rows of image tokens closed by break / end tokens."""
        if self.frame is not None:
            return [self.frame.soft_token_id] * length
        if self.pixtral is None or data is None:
            return [self.image_token_id] * length
        width, height = encoded_image_size(data)
        return self.pixtral.run(*self.pixtral.cells(height, width), self.image_token_id)

    def embeddings_refused(self, i: int) -> str:
        return (f"image {i}: a {self.architecture} takes images, not their embeddings (its placeholders and "
                "positions follow each image's grid of patches)")

    def check_no_image_tokens(self, prompt_token_ids: list[int]) -> None:
        """A prompt given without images holds no image token (a client's prompt: the token typed in)."""
        count = sum(1 for t in prompt_token_ids if t == self.image_token_id)
        if count:
            raise ImageInputError(f"the prompt has {count} image token(s) (id {self.image_token_id}) and no image: "
                                  "each image token stands for an image (give one an image token)")


# The --mm-processor-kwargs each family's processor takes here (vLLM's flag passes any key to transformers' processor;
# these are the ones that change what an image becomes and that this engine applies everywhere the count is made).
PROCESSOR_KWARGS = {**{a: ("min_pixels", "max_pixels") for a in QWEN_VL_ARCHITECTURES}, GEMMA3: ("do_pan_and_scan",)}


def check_processor_kwargs(architecture: str | None, kwargs: dict) -> None:
    """ValueError naming a key the model's image processor does not take here, or a value of the wrong kind."""
    allowed = PROCESSOR_KWARGS.get(architecture, ())
    for key, value in kwargs.items():
        if key not in allowed:
            takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
            raise ValueError(f"{key!r} is not a setting of a {architecture}'s image processor here ({takes})")
        if key in ("min_pixels", "max_pixels") and (not isinstance(value, int) or isinstance(value, bool)
                                                    or value <= 0):
            raise ValueError(f"{key} must be a positive number of pixels, got {value!r}")
        if key == "do_pan_and_scan" and not isinstance(value, bool):
            raise ValueError(f"do_pan_and_scan must be true or false, got {value!r}")
    if isinstance(kwargs.get("min_pixels"), int) and isinstance(kwargs.get("max_pixels"), int) and \
            kwargs["min_pixels"] > kwargs["max_pixels"]:
        raise ValueError(f"min_pixels {kwargs['min_pixels']} is more than max_pixels {kwargs['max_pixels']}")


def _added_tokens(model_dir: Path) -> dict[str, int]:
    """tokenizer.json's added tokens, content -> id (empty without one)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return {}
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    return {t["content"]: int(t["id"]) for t in added if isinstance(t, dict) and "content" in t and "id" in t}


@functools.lru_cache(maxsize=8)
def _newline_ids(tokenizer_path: str) -> tuple[int, ...] | None:
    """The tokenizer's tokens for 1, 2, ... newlines (each the one token the tokenizer makes of that run), up to the
    first run it makes two tokens of; None without a tokenizer.json."""
    if not Path(tokenizer_path).is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    out: list[int] = []
    while len(out) < 64:
        ids = tok.encode("\n" * (len(out) + 1), add_special_tokens=False).ids
        if len(ids) != 1:
            break
        out.append(ids[0])
    return tuple(out)


def check_image_count(num_images: int, max_images: int) -> None:
    """At most ``max_images`` images in one prompt (vLLM's --limit-mm-per-prompt; 0: images are off)."""
    if num_images > max_images:
        if max_images == 0:
            raise ImageInputError(IMAGES_OFF)
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


class CheckedImages(list):
    """``check_mm_inputs``' result. A SamplingParams copied by dataclasses.replace (seed, LoRA binding, ...) keeps the
    object, whose images' digests are then not computed again (blake2b: ~20 ms for a 20 MiB image); a copy that
    crossed msgpack or Ray arrives as a plain list and is checked once there."""


def check_mm_inputs(items: list) -> list[dict]:
    """``SamplingParams.mm_inputs`` as plain dicts of the right types (they cross msgpack and Ray)."""
    if isinstance(items, CheckedImages):
        return items
    out = CheckedImages()
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
        checked = {"offset": offset, "length": length, "digest": item["digest"], "data": data}
        if item.get("embeds") is not None:  # embeddings given for the image: [dtype, rows, hidden]
            embeds = item["embeds"]
            if (not isinstance(embeds, (list, tuple)) or len(embeds) != 3 or embeds[0] not in EMBED_DTYPES
                    or not all(isinstance(n, int) and n > 0 for n in embeds[1:]) or embeds[1] != length
                    or len(data) != embeds[1] * embeds[2] * EMBED_DTYPES[embeds[0]]):
                raise ValueError(f"mm_inputs[{i}].embeds must be [dtype, rows, hidden] of its data, rows its length")
            checked["embeds"] = [embeds[0], embeds[1], embeds[2]]
        out.append(checked)
    return out
