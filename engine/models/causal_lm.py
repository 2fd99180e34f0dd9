"""What every model class shares around its own blocks: the checkpoint's weights, the token embedding, the
LM head packed for the logits matmul, and the interface the runner, the MTP heads and the warmup use
(``load``, ``device``, ``compute_logits``).

LlamaModel (engine/models/llama.py) and NemotronHModel (engine/models/nemotron_h.py) add their blocks,
final norm and rotary table. Each is built as ``cls(arch, weights, dtype, max_positions, deterministic)``
with ``arch`` read by its ``arch_class``, which is how ``load`` builds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pdcluster.engine.linear import Linear
from pdcluster.engine.models.classifier import ClassifierHead, classifier_spec_of_dir, take_classifier_head
from pdcluster.engine.models.dummy_weights import dummy_weights, is_dummy
from pdcluster.engine.models.packed_int import dequantize_packed, packed_ints_of
from pdcluster.engine.models.quantized import dequantize_weights, scaled_weights_of
from pdcluster.engine.models.mxfp4 import dequantize_checkpoint, is_mxfp4


def _reads_whole_checkpoint(model_dir: Path) -> bool:
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return scaled_weights_of(config) is not None or packed_ints_of(config) is not None or is_mxfp4(config)


def load_weights(model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                 cut: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files, by Hugging Face name, in ``dtype`` on
    ``device`` (read on the host, cast there, then moved: one device copy per tensor). ``cut(name, tensor)``: what of
    each tensor to keep (a tensor-parallel rank's slice, engine/tensor_parallel/shard.py), applied to each tensor as it
    is read, so the host never holds the whole checkpoint; a quantized checkpoint's after it is dequantized.
    ``keep(name)``: which tensors to read at all (a pipeline stage's: engine/pipeline_parallel.py); None: every one."""
    if keep is not None:
        if is_dummy(model_dir):
            return {name: t for name, t in dummy_weights(model_dir, dtype, device, cut, keep=keep).items()}
        if _reads_whole_checkpoint(model_dir):  # quantized: a weight and its scales are paired once all are read
            return {name: t for name, t in load_weights(model_dir, dtype, device, cut).items() if keep(name)}
        cut_kept = cut or (lambda name, t: t)
        weights = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if keep(name):
                        weights[name] = cut_kept(name, tensors.get_tensor(name)).to(dtype).to(device)
        if not weights:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files")
        return weights
    if is_dummy(model_dir):  # --load-format dummy: random weights, no checkpoint (engine/models/dummy_weights.py)
        return dummy_weights(model_dir, dtype, device, cut)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files")
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    scaled, packed = scaled_weights_of(config), packed_ints_of(config)
    if cut is not None and scaled is None and packed is None and not is_mxfp4(config):
        weights = {}
        for f in files:
            with safe_open(str(f), framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    weights[name] = cut(name, tensors.get_tensor(name)).to(dtype).to(device)
        return weights
    if cut is not None:
        weights = load_weights(model_dir, dtype, "cpu")
        return {name: cut(name, t).to(device) for name, t in weights.items()}
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        tensors = load_file(str(f))
        if is_mxfp4(config):  # gpt-oss's releases: expert matrices as packed FP4 codes and scales, file by file
            tensors = dequantize_checkpoint(tensors, dtype)
        for name, tensor in tensors.items():
            side = (scaled is not None and scaled.is_side_tensor(name)) or (packed is not None
                                                                           and packed.is_side_tensor(name))
            # A quantized weight's scales stay float32 (rounding them would change every weight they scale), its
            # packed integers as they are; the weight itself is dequantized below.
            stored = (tensor.dtype if not tensor.is_floating_point() else torch.float32) if side else dtype
            weights[name] = tensor.to(stored).to(device)
    if scaled is not None:  # a weight and its scale may be in different shards: paired once all are read
        dequantize_weights(weights, scaled, dtype)
    if packed is not None:
        dequantize_packed(weights, packed, dtype)
    return weights


# Where a multimodal checkpoint keeps its language model (transformers 4 and 5 spell it differently), and what is not
# the language model (vision towers, projectors): served for text, those are dropped.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.", "model.visual.", "model.vision_tower.",
                    "model.multi_modal_projector.", "vision_model.", "model.vision_model.", "image_newline",
                    "model.image_newline")


def text_name(name: str) -> str | None:
    """A checkpoint tensor's name in a text model (a text checkpoint's as it is); None for a vision tower's."""
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is not None:
        return _TEXT_PREFIXES[prefix] + name[len(prefix):]
    return None if name.startswith(_VISION_PREFIXES) else name


def stage_keeps(layers: range) -> Callable[[str], bool]:
    """Which checkpoint tensors a pipeline stage holding ``layers`` reads (engine/pipeline_parallel.py): its layers'
    (a multimodal checkpoint's language model named either way), and the language model's tensors of no layer (the
    embedding, the final norm, the head: small beside the layers; a later stage drops the embedding and head once
    built). A vision tower's are not read (images are not served on a split)."""
    prefix = "model.layers."

    def keep(name: str) -> bool:
        text = text_name(name)
        if text is None:
            return False
        if not text.startswith(prefix):
            return True
        index = text[len(prefix):].split(".", 1)[0]
        return not index.isdigit() or int(index) in layers

    return keep


def text_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's language-model tensors under a text model's names (a text checkpoint's as they are)."""
    return {text: tensor for name, tensor in weights.items() if (text := text_name(name)) is not None}


def embedding_and_lm_head(arch, weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens, lm_head) of a Llama-style checkpoint: the LM head is the embedding where it is tied."""
    embed_tokens = weights["model.embed_tokens.weight"]
    return embed_tokens, embed_tokens if arch.tie_word_embeddings else weights["lm_head.weight"]


class CausalLM:
    arch_class: ClassVar[type]  # ModelArch or HybridArch: ``from_dir`` reads the checkpoint's config.json
    lora = None  # the LoRA adapters installed on it (engine/lora/: a LoraSet), if any
    # A *ForSequenceClassification checkpoint's score head (engine/models/classifier.py); such a model does not
    # generate (its LM head is a stand-in).
    classifier: ClassifierHead | None = None
    # Rank 0 of a tensor-parallel model (engine/tensor_parallel/driver.py): each forward's inputs go to the other
    # ranks first. None: the whole model is here (or this is one of the other ranks).
    tp_driver = None
    # A tensor-parallel rank's model (any rank): its Shard, the group its sums go over, and the whole model's arch
    # (what a draft head's checkpoint tensors are cut by: engine/tensor_parallel/draft.py). None when whole.
    tp_shard = None
    tp_group = None
    unsplit_arch = None
    # A checkpoint that takes images (engine/multimodal/): its image encoder, and for one forward the packed rows
    # that are image placeholders with the embeddings they take (row ids [n] int64, [n, hidden]).
    image_encoder = None
    # An encoder-only model (engine/models/bert.py): its prompts are computed whole and pooled; it never generates.
    encoder_only = False
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # Prompt rows given as embeddings (engine/prompt_embeds.py), for one forward: (packed row ids [n] int64,
    # [n, hidden]). A model whose forward puts them in place of its table's rows says so.
    takes_prompt_embeds = False
    prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, arch, dtype: torch.dtype, deterministic: bool, embed_tokens: torch.Tensor,
                 lm_head: torch.Tensor):
        self.arch = arch
        self.dtype = dtype
        # Batch-invariant kernels (EngineConfig.deterministic): every matmul (engine/linear.py), and what else
        # a model makes invariant (NemotronH: Mamba prefill rows token by token). The MTP heads read it.
        self.deterministic = deterministic
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        # The MTP head slices the plain lm_head and the embedding reads it: keep it beside the packing.
        self.lm_head_proj = Linear(lm_head, keep_weight=True, pack_float32=True, deterministic=deterministic)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, max_positions: int,
             device: str | torch.device = "cpu", deterministic: bool = False,
             max_model_len: int | None = None, shard=None, group=None, stage=None) -> "CausalLM":
        """``max_model_len``: the engine's (None: ``max_positions``), where the arch depends on it (longrope).
        ``shard`` (engine/tensor_parallel/shard.py): this rank's slice of each layer, cut on the host before it moves
        to ``device``, its output projections summed over ``group``. ``stage`` (engine/pipeline_parallel.py): the
        layers this rank holds, its hidden states handed over ``group``."""
        arch = cls.arch_class.from_dir(model_dir)
        if hasattr(arch, "for_context"):
            arch = arch.for_context(max_positions if max_model_len is None else max_model_len)
        if stage is not None:
            weights = text_weights(load_weights(model_dir, dtype, device, keep=stage_keeps(stage.layers)))
            model = cls.build_with_head(model_dir, arch, weights, dtype, max_positions, deterministic,
                                        layers=stage.layers)
            model.pp_stage, model.pp_group = stage, group
            return model
        if shard is None or shard.world_size == 1:
            return cls.build_with_head(model_dir, arch, text_weights(load_weights(model_dir, dtype, device)), dtype,
                                       max_positions, deterministic)
        from pdcluster.engine.tensor_parallel.shard import check_shardable, shard_arch, shard_tensor, split_rows

        check_shardable(cls, arch, shard.world_size)

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            text = text_name(name)
            return t if text is None else shard_tensor(text, t, arch, shard)

        weights = text_weights(load_weights(model_dir, dtype, device, cut=cut))
        model = cls.build_with_head(model_dir, shard_arch(arch, shard.world_size), weights, dtype, max_positions,
                                    deterministic)
        split_rows(model, group)
        model.tp_shard, model.tp_group, model.unsplit_arch = shard, group, arch
        return model

    @classmethod
    def build_with_head(cls, model_dir: Path, arch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                        max_positions: int, deterministic: bool, layers: range | None = None) -> "CausalLM":
        """``cls(arch, weights, ...)``, and a sequence classifier's score head where config.json names one
        (engine/models/classifier.py: taken out of ``weights`` first). ``layers``: a pipeline stage's (LlamaModel)."""
        spec = classifier_spec_of_dir(model_dir)
        head = take_classifier_head(weights, spec, arch.hidden_size, model_dir) if spec is not None else None
        model = (cls(arch, weights, dtype, max_positions, deterministic) if layers is None
                 else cls(arch, weights, dtype, max_positions, deterministic, layers=layers))
        model.classifier = head
        return model

    @property
    def architecture_name(self) -> str:
        """What the model is, for messages."""
        return type(self).__name__

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lora_fingerprint(self) -> str:
        """Its LoRA adapters' names and contents (LoraSet.fingerprint); "" without adapters."""
        return self.lora.fingerprint if self.lora is not None else ""

    @property
    def kv_fingerprint(self) -> str:
        """What besides the checkpoint decides the KV it writes: its LoRA adapters, and the RoPE table chosen for
        the engine's max_model_len (longrope: engine/models/rope.py). Two workers exchange KV, and the offload
        tiers keep it, only under equal fingerprints; "" for the plain model."""
        scaling = getattr(self.arch, "rope_scaling", None)
        rope = "rope:long" if scaling is not None and scaling.use_long else ""
        return "|".join(part for part in (self.lora_fingerprint, rope) if part)

    def lora_targets(self) -> list[tuple[int, object, str, tuple[tuple[str, int, int], ...]]] | None:
        """Where LoRA adapters (engine/lora/) may add to this model: (layer index, the object holding the
        projection, its attribute, its output slices as (Hugging Face module name, offset, width)); None: this
        model takes no adapters."""
        return None

    @property
    def is_whole(self) -> bool:
        """Every rank's slice is here: not one rank of a tensor-parallel split."""
        return self.tp_shard is None or self.tp_shard.world_size == 1

    def lora_expert_targets(self) -> list:
        """The MoE layers whose routed experts LoRA adapters may add to (engine/lora/experts.py ExpertTarget); none
        by default, and none on a split model (a rank holds a slice of every expert)."""
        return []

    def put_prompt_rows(self, hidden: torch.Tensor) -> None:
        """The step's prompt rows given as embeddings in place of the embedding table's rows in ``hidden`` (where
        transformers and vLLM take ``inputs_embeds``: before a Granite's multiplier, after Gemma's scale)."""
        if self.prompt_rows is not None:
            rows, embeds = self.prompt_rows
            hidden.index_copy_(0, rows, embeds.to(hidden.dtype))

    def hand_forward_to_ranks(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """On rank 0 of a split model, the other ranks start this forward (with the step's LoRA rows and image rows, if
        any) before this rank runs its own slice; nothing on a whole model."""
        if self.tp_driver is not None:
            self.tp_driver.forward(input_ids, positions, meta, self.lora.step_rows if self.lora is not None else None,
                                   self.image_rows, self.prompt_rows)

    @property
    def lora_num_layers(self) -> int:
        """Layers an adapter's names count (the checkpoint's: a Granite hybrid's layer is two blocks here)."""
        return len(self.layers)

    def lora_output_rows(self, attr: str, offset: int, width: int) -> torch.Tensor | None:
        """Which checkpoint output row each of the projection ``attr``'s rows offset .. offset + width holds, where
        the loader reordered them (an adapter's B rows follow); None: in the checkpoint's order."""
        return None

    def run_unchunked(self) -> None:
        """Run every per-token part over a step's tokens at once from now on (with LoRA adapters: their rows
        index the whole step)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] float32, for the rows to sample only (the runner passes those)."""
        return self.lm_head_proj(hidden).float()
