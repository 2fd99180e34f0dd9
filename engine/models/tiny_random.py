"""`tiny-random`: a small, deterministic, randomly initialised LlamaForCausalLM for fast tests.

It shares SmolLM2's tokenizer (vocab 49152, chat template), extracted from the GGUF's metadata
without dequantising the real weights.

Why the init is not the usual std 0.02: with tied embeddings and std-0.02 weights the logits are
nearly flat (top1 - top2 median 0.04; 61% of greedy steps under 0.05), so a greedy token flips when
batch shape changes the float summation order, and tests that compare colocated with disaggregated
output would be flaky. Embedding std 0.5 alone makes each token predict itself (the residual stream is
its own embedding, tied to the head), so the attention/MLP blocks are scaled up to dominate it.
Measured with transformers on 16 random prompts x 32 greedy steps (seed 0):
    top1 - top2 logit gap: median 1.40, 5th percentile 0.13, 2% of steps under 0.05;
    31.7 distinct tokens per 32 generated, longest run of one repeated token 2; logit std ~8.
Norm weights are random around 1 (not all ones) so a loader that forgets them is caught.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .gguf_convert import llama_config, write_tokenizer_files

SEED = 0

TINY_RANDOM_CONFIG = llama_config(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    vocab_size=49152,
    tie_word_embeddings=True,
    torch_dtype="float32",
)

# Init scales (see the module docstring for what they buy).
EMBED_STD = 0.5
INPUT_GAIN = 2.0  # q, k, gate projections: sharper attention and gating than a variance-preserving init
OUTPUT_GAIN = 4.0  # o_proj, down_proj: blocks outweigh the token's own embedding in the residual
FINAL_NORM_SCALE = 1.5  # sets the logit scale (std ~8)
NORM_JITTER = 0.2  # norm weights uniform in [1 - j, 1 + j]


def tiny_random_state_dict(config: dict = TINY_RANDOM_CONFIG, seed: int = SEED) -> dict:
    """float32 weights from one seeded CPU generator, drawn in a fixed order (so always the same bytes)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def normal(shape: tuple[int, int], std: float):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight(scale: float = 1.0):
        return scale * (1 + NORM_JITTER * (torch.rand(hidden, generator=gen, dtype=torch.float32) * 2 - 1))

    state = {"model.embed_tokens.weight": normal((config["vocab_size"], hidden), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm_weight()
        state[p + "self_attn.q_proj.weight"] = normal((heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden))
        state[p + "self_attn.k_proj.weight"] = normal((kv_heads * head_dim, hidden), INPUT_GAIN / math.sqrt(hidden))
        state[p + "self_attn.v_proj.weight"] = normal((kv_heads * head_dim, hidden), 1 / math.sqrt(hidden))
        state[p + "self_attn.o_proj.weight"] = normal((hidden, heads * head_dim), OUTPUT_GAIN / math.sqrt(heads * head_dim))
        state[p + "post_attention_layernorm.weight"] = norm_weight()
        state[p + "mlp.gate_proj.weight"] = normal((inter, hidden), INPUT_GAIN / math.sqrt(hidden))
        state[p + "mlp.up_proj.weight"] = normal((inter, hidden), 1 / math.sqrt(hidden))
        state[p + "mlp.down_proj.weight"] = normal((hidden, inter), OUTPUT_GAIN / math.sqrt(inter))
    state["model.norm.weight"] = norm_weight(FINAL_NORM_SCALE)
    return state


def build_tiny_random(out_dir: str | os.PathLike, gguf_path: str | os.PathLike) -> None:
    """Write the complete tiny-random HF directory into `out_dir`; the tokenizer comes from `gguf_path`."""
    write_tiny_model(out_dir, gguf_path, TINY_RANDOM_CONFIG, tiny_random_state_dict)


def write_tiny_model(out_dir: str | os.PathLike, gguf_path: str | os.PathLike, base_config: dict, state_dict_of) -> None:
    """An HF directory: SmolLM2's tokenizer (from `gguf_path`), `base_config` with its special token
    ids, and the weights ``state_dict_of(config)``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(gguf_path, out)
    generation = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    config = dict(base_config)
    config["bos_token_id"] = generation["bos_token_id"]
    config["eos_token_id"] = generation["eos_token_id"][0]
    config["pad_token_id"] = generation["pad_token_id"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state_dict_of(config), str(out / "model.safetensors"), metadata={"format": "pt"})


def write_random_draft(model_dir: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int, num_kv_heads: int,
                       head_dim: int, seed: int = 7) -> Path:
    """A seeded random Llama draft for the Llama-family model in ``model_dir`` (its width, vocabulary and tokenizer
    files), of ``num_layers`` layers whose KV of a token is ``num_kv_heads`` x ``head_dim``: a draft of another KV
    shape than its target's for the tests and the device check (engine/kv_cache.py packed_layer_views). Its drafts
    are mostly rejected."""
    from safetensors.torch import save_file

    from .hf_files import copy_tokenizer_files

    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config.update(num_hidden_layers=num_layers, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  tie_word_embeddings=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tiny_random_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer_files(src, out)
    return out
