"""Which model class serves a Hugging Face directory: dispatch on config.json ``architectures[0]``.

    LlamaForCausalLM, MistralForCausalLM -> engine.models.llama_arch.ModelArch / llama.LlamaModel
    MixtralForCausalLM                   -> the same (MoE MLPs in engine/models/moe.py)
    Qwen2ForCausalLM                     -> the same (q/k/v biases)
    Phi3ForCausalLM                      -> the same (fused qkv_proj / gate_up_proj in the checkpoint)
    Gemma2ForCausalLM, Gemma3ForCausalLM -> engine.models.gemma (Gemma's norms, GeGLU, local/global layers)
    Qwen3ForCausalLM, Qwen3MoeForCausalLM -> the same (q/k norm; MoE MLPs in engine/models/moe.py)
    Qwen2MoeForCausalLM                  -> the same (q/k/v biases; MoE MLPs with a shared expert in moe.py)
    SmolLM3ForCausalLM                   -> the same (no RoPE on every fourth layer)
    OlmoeForCausalLM                     -> the same (q/k norms over all heads; MoE MLPs in moe.py)
    Glm4ForCausalLM                      -> the same (sandwich norms, interleaved partial RoPE)
    Glm4MoeForCausalLM                   -> the same (MoE MLPs in engine/models/glm4_moe.py)
    CohereForCausalLM, Cohere2ForCausalLM -> the same (LayerNorm, parallel blocks, interleaved RoPE)
    Exaone4ForCausalLM                   -> the same (post-norms, per-head q/k norms, NoPE full layers)
    Ministral3ForCausalLM, SeedOssForCausalLM -> the same (a position-dependent query scale; biases)
    Mistral3ForConditionalGeneration, Qwen2VL / Qwen2_5_VL / Qwen3VLForConditionalGeneration
                                         -> the same, their language model for text
    LlavaForConditionalGeneration        -> the same, with images (engine/multimodal/: its vision tower and
                                            projector encode them into the prompt's image tokens)
    LlavaNextForConditionalGeneration    -> the same, each image in tiles (its count of tokens by its size)
    Olmo2ForCausalLM, Olmo3ForCausalLM   -> the same (norms after each sublayer, q/k norms over all heads)
    GptOssForCausalLM                    -> the same (attention sinks, every other layer sliding, MoE MLPs with
                                            biased experts in moe.py; MXFP4 experts dequantized by mxfp4.py)
    Llama4ForCausalLM, Llama4ForConditionalGeneration -> the same (chunked attention, q/k L2 norms, NoPE layers with
                                            a query temperature; MoE MLPs with sigmoid-scaled inputs in moe.py)
    GraniteForCausalLM, GraniteMoeForCausalLM -> the same (embedding, attention, residual and logits
                                            multipliers; MoE MLPs in engine/models/moe.py)
    DeepseekV2ForCausalLM, DeepseekV3ForCausalLM -> engine.models.deepseek.DeepseekArch / DeepseekModel
                                            (Multi-head Latent Attention over a cache of latents; DeepSeek's MoE)
    NemotronHForCausalLM                 -> engine.models.nemotron_h.HybridArch / NemotronHModel
                                            (MoE layers in engine/models/nemotron_moe.py)
    GraniteMoeHybridForCausalLM          -> the same (engine/models/granite_hybrid.py: Granite's layers as
                                            NemotronH blocks)
    <Family>ForSequenceClassification    -> the Llama family's or Gemma's causal model above with a score head
                                            (engine/models/classifier.py: reward models, classifiers, rerankers)
    BertModel, RobertaModel, XLMRobertaModel and their *ForSequenceClassification, *ForTokenClassification
                                         -> engine.models.bert.BertArch / BertModel (encoder-only: embedding
                                            models, cross-encoders and token classifiers, pooled; they do not
                                            generate)
    ModernBertModel, ModernBertForSequenceClassification, ModernBertForTokenClassification
                                         -> engine.models.modernbert.ModernBertArch / ModernBertModel (the same,
                                            with rotary positions and local / global attention layers)

Errors are one line naming what is wrong (a missing file, an unsupported architecture) and what is
supported; they are ValueErrors (UnknownModelError), which the CLI reports without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdcluster.engine.models.bert import BertArch, BertModel
from pdcluster.engine.models.bert_names import ENCODER_ARCHITECTURES, MODERNBERT_ARCHITECTURES
from pdcluster.engine.models.classifier import SUFFIX as CLASSIFIER_SUFFIX
from pdcluster.engine.models.classifier import causal_architecture
from pdcluster.engine.models.deepseek import DeepseekArch, DeepseekModel
from pdcluster.engine.models.modernbert import ModernBertArch, ModernBertModel
from pdcluster.engine.models.gemma import GemmaArch, GemmaModel
from pdcluster.engine.models.llama import LlamaModel
from pdcluster.engine.models.llama_arch import ModelArch
from pdcluster.engine.models.packed_int import packed_ints_of
from pdcluster.engine.models.quantized import scaled_weights_of
from pdcluster.engine.models.mxfp4 import is_mxfp4
from pdcluster.engine.models.registry import UnknownModelError
from pdcluster.engine.models.nemotron_h import HybridArch, NemotronHModel

# architectures[0] -> (arch class, model class)
ARCHITECTURES = {
    "LlamaForCausalLM": (ModelArch, LlamaModel),
    "MistralForCausalLM": (ModelArch, LlamaModel),
    "MixtralForCausalLM": (ModelArch, LlamaModel),
    "Qwen2ForCausalLM": (ModelArch, LlamaModel),
    "Phi3ForCausalLM": (ModelArch, LlamaModel),
    "Qwen3ForCausalLM": (ModelArch, LlamaModel),
    "Qwen3MoeForCausalLM": (ModelArch, LlamaModel),
    "Qwen2MoeForCausalLM": (ModelArch, LlamaModel),
    "GraniteForCausalLM": (ModelArch, LlamaModel),
    "GraniteMoeForCausalLM": (ModelArch, LlamaModel),
    "Olmo2ForCausalLM": (ModelArch, LlamaModel),
    "Olmo3ForCausalLM": (ModelArch, LlamaModel),
    "SmolLM3ForCausalLM": (ModelArch, LlamaModel),
    "OlmoeForCausalLM": (ModelArch, LlamaModel),
    "Glm4ForCausalLM": (ModelArch, LlamaModel),
    "Glm4MoeForCausalLM": (ModelArch, LlamaModel),
    "CohereForCausalLM": (ModelArch, LlamaModel),
    "Cohere2ForCausalLM": (ModelArch, LlamaModel),
    "Exaone4ForCausalLM": (ModelArch, LlamaModel),
    "Ministral3ForCausalLM": (ModelArch, LlamaModel),
    "SeedOssForCausalLM": (ModelArch, LlamaModel),
    "GptOssForCausalLM": (ModelArch, LlamaModel),
    "Llama4ForCausalLM": (ModelArch, LlamaModel),
    "Llama4ForConditionalGeneration": (ModelArch, LlamaModel),  # its language model, for text
    # Multimodal checkpoints: their language model, for text (llama.py MULTIMODAL_TEXT)
    "Mistral3ForConditionalGeneration": (ModelArch, LlamaModel),
    "LlavaForConditionalGeneration": (ModelArch, LlamaModel),  # its language model; its images: engine/multimodal/
    "LlavaNextForConditionalGeneration": (ModelArch, LlamaModel),  # the same, images in tiles
    "Qwen2VLForConditionalGeneration": (ModelArch, LlamaModel),
    "Qwen2_5_VLForConditionalGeneration": (ModelArch, LlamaModel),
    "Qwen3VLForConditionalGeneration": (ModelArch, LlamaModel),
    "Qwen3VLMoeForConditionalGeneration": (ModelArch, LlamaModel),
    "Gemma2ForCausalLM": (GemmaArch, GemmaModel),
    "Gemma3ForCausalLM": (GemmaArch, GemmaModel),
    "Gemma3ForConditionalGeneration": (GemmaArch, GemmaModel),  # its language model, for text
    "DeepseekV2ForCausalLM": (DeepseekArch, DeepseekModel),
    "DeepseekV3ForCausalLM": (DeepseekArch, DeepseekModel),
    "NemotronHForCausalLM": (HybridArch, NemotronHModel),
    "GraniteMoeHybridForCausalLM": (HybridArch, NemotronHModel),
    # Encoder-only models (engine/models/bert.py): embedding models and cross-encoders, pooled, never generating.
    **{name: (BertArch, BertModel) for name in ENCODER_ARCHITECTURES if name not in MODERNBERT_ARCHITECTURES},
    **{name: (ModernBertArch, ModernBertModel) for name in MODERNBERT_ARCHITECTURES},  # engine/models/modernbert.py
}
REQUIRED_FILES = ("config.json", "tokenizer.json")
# The causal architectures whose *ForSequenceClassification checkpoint (a flat text config with a score head) is
# served: their loader attaches the head (CausalLM.build_with_head). transformers' Gemma 3 classifier wraps the
# multimodal model's nested config: not among them.
CLASSIFIER_BASES = tuple(n for n, (a, _) in ARCHITECTURES.items()
                         if n.endswith("ForCausalLM") and (a is ModelArch or n == "Gemma2ForCausalLM"))
# Quantized releases served by dequantizing at load, to the serving dtype (bf16 on a GPU: 2 bytes a weight, where
# vLLM computes in the checkpoint's format): 8-bit FP8 / INT8 weights with their scales (engine/models/quantized.py)
# and AWQ / GPTQ's packed integers (engine/models/packed_int.py) for every architecture, and gpt-oss's MXFP4 experts
# (engine/models/mxfp4.py).
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)


def architecture_of(model_dir: str | Path) -> str:
    """config.json's ``architectures[0]`` (LlamaForCausalLM when the list is absent, as HF's Llama
    loader assumes), after checking the directory has what serving it needs."""
    model_dir = Path(model_dir)
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise UnknownModelError(f"{model_dir}: directory lacks {', '.join(missing)}; a Hugging Face model directory "
                                "needs config.json, *.safetensors and tokenizer.json")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise UnknownModelError(f"{model_dir}/config.json is not valid JSON: {e}") from None
    names = cfg.get("architectures") or ["LlamaForCausalLM"]
    quantization = cfg.get("quantization_config")
    if quantization and not (is_mxfp4(cfg) and names[0] in MXFP4_ARCHITECTURES) and scaled_weights_of(cfg) is None \
            and packed_ints_of(cfg) is None:
        # The loader casts every tensor to the serving dtype: fp8 / int4 weights without their scales would load
        # and answer garbage. Refused instead, in one line.
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(f"{model_dir}: quantized weights ({method}, config.json quantization_config) are not "
                         "served (only FP8 / INT8 weights with their scales, AWQ GEMM and GPTQ, and gpt-oss's MXFP4 "
                         "experts, dequantized at load); serve the checkpoint's bf16 release or a bf16 conversion of "
                         "it")
    return names[0]


def _classes(model_dir: str | Path):
    name = architecture_of(model_dir)
    if name.endswith(CLASSIFIER_SUFFIX) and name not in ENCODER_ARCHITECTURES:  # a causal model with a score head (engine/models/classifier.py)
        base = causal_architecture(name)
        if base not in CLASSIFIER_BASES:
            served = [n.replace("ForCausalLM", CLASSIFIER_SUFFIX) for n in CLASSIFIER_BASES]
            raise ValueError(f"{model_dir}: architecture {name!r} is not supported; sequence classifiers are served "
                             f"for the Llama family and Gemma 2: {', '.join(served)}")
        return ARCHITECTURES[base]
    if name not in ARCHITECTURES:
        raise ValueError(f"{model_dir}: architecture {name!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def arch_from_dir(model_dir: str | Path) -> ModelArch | HybridArch:
    """The model's shape (ModelArch for Llama-family, HybridArch for NemotronH)."""
    return _classes(model_dir)[0].from_dir(Path(model_dir))


def load_model(model_dir: str | Path, dtype: torch.dtype, max_positions: int,
               device: str | torch.device = "cpu", deterministic: bool = False,
               max_model_len: int | None = None, shard=None, group=None, stage=None) -> LlamaModel | NemotronHModel:
    """The model's weights loaded onto ``device`` into the engine's model class for its architecture;
    ``deterministic``: batch-invariant kernels throughout (EngineConfig.deterministic); ``max_model_len``: the
    engine's, which picks longrope's table (None: ``max_positions``); ``shard`` and ``group``: one rank's slice of a
    tensor-parallel model (engine/tensor_parallel/), None for the whole model; ``stage`` and ``group``: a pipeline
    stage's layers (engine/pipeline_parallel.py)."""
    if stage is not None:
        return _classes(model_dir)[1].load(Path(model_dir), dtype, max_positions, device, deterministic,
                                           max_model_len=max_model_len, group=group, stage=stage)
    return _classes(model_dir)[1].load(Path(model_dir), dtype, max_positions, device, deterministic,
                                       max_model_len=max_model_len, shard=shard, group=group)


def model_class_of(model_dir: str | Path) -> type:
    """The engine's model class for the directory's architecture."""
    return _classes(model_dir)[1]


def max_model_len_for(arch, requested: int = 0) -> int:
    """The engine's max_model_len: ``requested``, or (0) the model's max_position_embeddings capped at 4096;
    ValueError naming the limit when ``requested`` passes it."""
    limit = arch.max_position_embeddings
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's max_position_embeddings ({limit})")
    return requested or min(limit, 4096)


def is_hybrid(arch) -> bool:
    """Whether the model has Mamba layers with per-request recurrent state (engine/mamba_state.py)."""
    return isinstance(arch, HybridArch)


def is_encoder(arch) -> bool:
    """Whether the model is encoder-only (engine/models/bert.py): every prompt computed whole in one step, pooled,
    nothing kept in the KV cache, no generation."""
    return isinstance(arch, BertArch)
