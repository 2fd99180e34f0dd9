"""Model resolution, GGUF -> HF conversion, tiny-random and the tokenizer wrapper.

transformers is the reference here (a test dependency only): the converted SmolLM2 must load and answer
" Paris", its weights must equal transformers' own GGUF loader's, and our tokenizer must agree with
transformers' tokenizers.

Built models live in a cache shared across test runs (TEST_CACHE_DIR), so the conversion runs once per
machine; other test modules reuse the same path. A converter change invalidates it (build stamp).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pdcluster.engine.models import registry as model_registry
from pdcluster.engine.models.gguf_convert import find_smollm2_gguf, unpermute_rope_rows
from pdcluster.engine.models.registry import UnknownModelError, resolve_model
from pdcluster.engine.models.tiny_random import TINY_RANDOM_CONFIG
from pdcluster.engine.tokenizer import ChatTemplateError, Tokenizer

TEST_CACHE_DIR = Path("/tmp/pdcluster-test-cache")

# Strings on which every correct SmolLM2 tokenizer agrees: unicode, emoji, whitespace runs, tabs and
# CRLF, digits (not after whitespace runs, see below), code, special tokens inside text.
COMMON_STRINGS = [
    "The capital of France is",
    "Hello, world! How's it going? I'm fine, they'll see.",
    "héllo wörld — naïve café, 你好世界, こんにちは, Привет, 🙂🚀👩‍💻",
    "  leading spaces and trailing   ",
    "a    b\t\tc\r\nd\n\n\ne",
    "1234567890 3.14159 -42 1e-5 0x1F 2024-11-21",
    "def f(x):\n    return {'k': [x**2, x // 3]}  # comment\n\n\nclass A:\n\tpass\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
]
# Whitespace runs right before digits: llama.cpp's "smollm" pre-tokenizer (and the HF SmolLM2
# tokenizer.json) isolate digits first, so "x  12" -> x|ĠĠ|1|2. transformers' GGUF tokenizer loader
# (5.23) uses the plain GPT-2 split here and gives x|Ġ|Ġ|1|2, so these are checked against transformers
# reading our tokenizer.json and against a pinned expectation, not against its GGUF loader.
DIGITS_AFTER_SPACES = ["x  12", "total:   99 items", "a\t\t7"]


@pytest.fixture(scope="session", autouse=True)
def shared_model_cache():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(model_registry.CACHE_ENV, str(TEST_CACHE_DIR))
        yield TEST_CACHE_DIR


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_model("tiny-random")


@pytest.fixture(scope="module")
def gguf_reference_model():
    """SmolLM2 as transformers' own GGUF loader builds it (needs accelerate)."""
    transformers = pytest.importorskip("transformers")
    gguf = find_smollm2_gguf()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # e.g. accelerate missing, or a transformers without GGUF llama support
        pytest.skip(f"transformers cannot load the GGUF, so there is no reference to compare with: {exc}")


@pytest.fixture(scope="module")
def gguf_reference_tokenizer():
    transformers = pytest.importorskip("transformers")
    gguf = find_smollm2_gguf()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        pytest.skip(f"transformers cannot build a tokenizer from the GGUF: {exc}")


@pytest.fixture(scope="module")
def hf_tokenizer_on_our_dir(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


# ----------------------------------------------------------------------------------------- smollm2


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py `permute`, the operation the converter must undo.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_llamacpp_permute(n_heads):
    w = np.arange(n_heads * 64 * 5, dtype=np.float32).reshape(n_heads * 64, 5)
    assert not np.array_equal(_llamacpp_permute(w, n_heads), w)
    np.testing.assert_array_equal(unpermute_rope_rows(_llamacpp_permute(w, n_heads), n_heads), w)


def test_smollm2_directory_is_complete_hf_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    assert "quantization_config" not in config
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9


def test_smollm2_greedy_says_paris(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    tok = Tokenizer(smollm2_dir)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, ids.shape[1]:].tolist()).startswith(" Paris")


def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir, gguf_reference_model):
    from safetensors import safe_open

    reference = gguf_reference_model.state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.layers.7.input_layernorm.weight",
        "model.norm.weight",
    ]
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        for name in names:
            ours, ref = f.get_tensor(name).float(), reference[name].float()
            assert ours.shape == ref.shape, name
            torch.testing.assert_close(ours, ref, rtol=2**-7, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # The comparison can see a missing un-permutation: GGUF row order is far from the reference.
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float().numpy()
        gguf_order = torch.from_numpy(_llamacpp_permute(q, 9))
        assert not torch.allclose(gguf_order, reference["model.layers.0.self_attn.q_proj.weight"].float(), rtol=0.1, atol=1e-3)


# ----------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers_on_our_files(smollm2_dir, hf_tokenizer_on_our_dir):
    ours, hf = Tokenizer(smollm2_dir), hf_tokenizer_on_our_dir
    for text in COMMON_STRINGS + DIGITS_AFTER_SPACES:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), repr(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, gguf_reference_tokenizer):
    ours, ref = Tokenizer(smollm2_dir), gguf_reference_tokenizer
    for text in COMMON_STRINGS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)


def test_tokenizer_isolates_digits_like_llamacpp_smollm(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    assert [tok.id_to_token(i) for i in tok.encode("x  12")] == ["x", "ĠĠ", "1", "2"]
    assert [tok.id_to_token(i) for i in tok.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]


def test_tokenizer_special_ids(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    # <|im_end|> ends a chat turn, <|endoftext|> a document: both stop generation (as in llama.cpp).
    assert tok.stop_token_ids == (2, 0)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 28120, 2]) == "hello"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}],
]


# Replies the client began, for continue_final_message: the text alone, with trailing and leading whitespace.
STARTED_REPLIES = ["The answer is", "The answer is ", "  padded both ways  ", "Line one.\n"]


def _assert_same_chat_rendering(ours: Tokenizer, ref) -> None:
    for messages in CONVERSATIONS:
        for gen_prompt in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected
    for started in STARTED_REPLIES:  # the prompt stops inside the final message, where transformers stops it
        messages = [*CONVERSATIONS[0], {"role": "assistant", "content": started}]
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_chat_template_renders_like_transformers_on_our_files(smollm2_dir, hf_tokenizer_on_our_dir):
    ours = Tokenizer(smollm2_dir)
    _assert_same_chat_rendering(ours, hf_tokenizer_on_our_dir)
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_renders_like_transformers_gguf_tokenizer(smollm2_dir, gguf_reference_tokenizer):
    _assert_same_chat_rendering(Tokenizer(smollm2_dir), gguf_reference_tokenizer)


def test_chat_template_raise_exception(smollm2_dir, tmp_path):
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
        "{{ bos_token + m['content'] + eos_token }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"
    with pytest.raises(ChatTemplateError, match="role tool is not supported"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the template only ever sees plain JSON data
        tok.apply_chat_template([{"role": "user", "content": object()}])


# ----------------------------------------------------------------------------------------- tiny-random


def test_tiny_random_is_deterministic(tiny_dir, tmp_path):
    other = resolve_model("tiny-random", cache_dir=tmp_path, progress=False)
    assert other != tiny_dir
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_tiny_random_loads_with_stated_config(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 128, 4, 2, 32)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (256, 49152, 2048, 1e-5)
    assert c.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert json.loads((tiny_dir / "config.json").read_text())["rope_theta"] == TINY_RANDOM_CONFIG["rope_theta"] == 10000.0
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert Tokenizer(tiny_dir).vocab_size == c.vocab_size

    # Greedy must be robust: clear top1-top2 gaps and no single token repeated forever.
    gen = torch.Generator().manual_seed(7)
    gaps, outputs = [], []
    with torch.no_grad():
        for _ in range(6):
            ids = torch.randint(17, 49152, (1, 12), generator=gen)
            produced = []
            for _ in range(10):
                top2 = model(ids).logits[0, -1].topk(2)
                gaps.append((top2.values[0] - top2.values[1]).item())
                produced.append(top2.indices[0].item())
                ids = torch.cat([ids, top2.indices[:1].view(1, 1)], dim=1)
            outputs.append(produced)
    assert float(np.median(gaps)) > 0.05, gaps
    assert all(len(set(p)) > 3 for p in outputs), outputs


# ----------------------------------------------------------------------------------------- resolution


def test_unknown_name_lists_builtins():
    with pytest.raises(UnknownModelError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert "'no-such-model'" in message and "smollm2" in message and "tiny-random" in message
    assert isinstance(info.value, ValueError)


def test_bad_directory_is_rejected_with_missing_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnknownModelError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "*.safetensors" in message
    assert "smollm2" in message and "tiny-random" in message


def test_hf_directory_path_resolves_to_itself(tiny_dir):
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()


_CONCURRENT_RESOLVER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from pdcluster.engine.models import registry as mr

    cache, log, barrier = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    build, modules = mr.BUILTIN_MODELS["tiny-random"]

    def counted_build(out, progress):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)  # widen the window in which the other process arrives
        build(out, progress)

    mr.BUILTIN_MODELS["tiny-random"] = (counted_build, modules)
    (barrier / str(os.getpid())).touch()
    deadline = time.time() + 60
    while len(list(barrier.iterdir())) < 2 and time.time() < deadline:  # start both resolves together
        time.sleep(0.01)
    print(mr.resolve_model("tiny-random", cache, progress=False))
    """
)


def test_concurrent_resolve_builds_once(tmp_path, tiny_dir):
    cache, log, barrier = tmp_path / "cache", tmp_path / "builds.log", tmp_path / "barrier"
    barrier.mkdir()
    # A half-written build left by a crashed process must neither be used nor get in the way.
    junk = cache / "models" / ".tiny-random.tmp-crashed"
    junk.mkdir(parents=True)
    (junk / "config.json").write_text("{")
    env = dict(os.environ)
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONCURRENT_RESOLVER, str(cache), str(log), str(barrier)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    target = cache / "models" / "tiny-random"
    assert paths == {str(target)}
    assert len(log.read_text().split()) == 1, "both processes converted"
    assert not junk.exists()
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-random", "tiny-random.lock"]
    assert (target / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    Tokenizer(target)  # complete enough to load
