"""NemotronH (engine/models/nemotron_h.py, engine/models/mamba_mixer.py) against transformers' NemotronHForCausalLM
(fp32, eager attention) as the oracle, run standalone over a paged KV cache and a Mamba state pool.

Two models: the built-in tiny-hybrid ("M-M*M-M*", n_groups 2, conv kernel 4, chunk 16) and a
transformers-made random NemotronH of another shape ("*M-M*M": attention first, n_groups 1, conv
kernel 3 without bias, state size 12, chunk 8, untied head, its dt_bias from transformers' init so the
time_step_limit (0.001, inf) clamp is active on some tokens). Its weights are redrawn at a scale where the logits are
O(10) (transformers' std-0.02 init gives logits ~0.7, too flat for an absolute tolerance to mean much).

The standalone runner (``Steps``) does what the model runner does per step: block tables and slot
mapping for the paged cache, and MambaMetadata rows (slot, has_initial_state, keep_positions).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pdcluster.engine.models.architectures import arch_from_dir, is_hybrid, load_model
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.kv_cache import KVCacheSpec
from pdcluster.engine.mamba_state import MambaMetadata, MambaStatePool
from pdcluster.engine.models.llama import LlamaModel, ModelArch
from pdcluster.engine.models.random_weights import pin_dt_limit, redraw_nemotron_h
from pdcluster.engine.models.registry import resolve_model
from pdcluster.engine.models.nemotron_h import HybridArch, NemotronHModel
from pdcluster.engine.models.tiny_hybrid import TINY_HYBRID_CONFIG, tiny_hybrid_state_dict

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

ATOL = 1e-4
RTOL = 1e-5  # logits reach ~25: fp32 summation order differs by a few ulps of that
MAX_POSITIONS = 256

RANDOM_CONFIG = dict(
    vocab_size=512, hidden_size=64,
    layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention", "full_attention",
                       "linear_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=24, intermediate_size=96,
    mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=12, n_groups=1, conv_kernel=3, chunk_size=8,
    use_conv_bias=False, tie_word_embeddings=False, layer_norm_epsilon=1e-6, bos_token_id=1, eos_token_id=2,
    time_step_limit=(0.001, float("inf")),  # a clamp of its own (NemotronH's default is none)
)


# ---------------------------------------------------------------------------------------------------
# A standalone runner: the model over a paged KV cache and a state pool


class Steps:
    """Runs ``model.forward`` step by step for requests identified by their state slot."""

    def __init__(self, model, num_slots: int = 6, block_size: int = 4, num_blocks: int = 160,
                 positions_per_step: int = 1):
        a = model.arch
        self.model = model
        spec = KVCacheSpec(a.num_layers, 0, num_blocks, block_size, a.num_kv_heads, a.head_dim, model.dtype)
        self.kv_cache = torch.zeros(spec.shape, dtype=model.dtype)
        self.block_size = block_size
        self.pool = MambaStatePool(a.mamba_state_shape(), num_slots, positions_per_step)
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.free = list(range(num_blocks))
        self.layers_done: list[int] = []

    def step(self, rows: list[tuple]) -> list[torch.Tensor]:
        """rows: (slot, token ids) or (slot, token ids, keep_positions). Returns each row's logits."""
        ids, positions, slot_mapping, qsl, seq_lens, slots, has_init, keep, tables = [], [], [], [0], [], [], [], [], []
        for row in rows:
            slot, tokens, keep_row = row[0], list(row[1]), (row[2] if len(row) > 2 else False)
            start = self.num_computed.get(slot, 0)
            blocks = self.blocks.setdefault(slot, [])
            while len(blocks) * self.block_size < start + len(tokens):
                blocks.append(self.free.pop(0))
            pos = range(start, start + len(tokens))
            ids += tokens
            positions += pos
            slot_mapping += [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in pos]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            slots.append(slot)
            has_init.append(start > 0)
            keep.append(keep_row)
            tables.append(blocks)
            self.num_computed[slot] = start + len(tokens)
        block_tables = np.zeros((len(rows), max(len(t) for t in tables)), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        qsl_np = np.array(qsl, dtype=np.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            block_tables=torch.from_numpy(block_tables),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.from_numpy(qsl_np.astype(np.int32)),
            uniform_q_len=None,
            scale=self.model.scale,
            mamba=MambaMetadata(self.pool, qsl_np, np.array(slots, dtype=np.int64), np.array(has_init, dtype=bool),
                                np.array(keep, dtype=bool)),
        )
        self.layers_done = []
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64),
                                        torch.tensor(positions, dtype=torch.int64), self.kv_cache, meta,
                                        self.layers_done.append)
            logits = self.model.compute_logits(hidden)
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(rows))]

    def prefill(self, slot: int, tokens, chunks: list[int] | None = None) -> torch.Tensor:
        """Logits of every token, computed in chunks of the given sizes (default: one chunk)."""
        tokens = list(tokens)
        out, start = [], 0
        for size in chunks or [len(tokens)]:
            out += self.step([(slot, tokens[start : start + size])])
            start += size
        assert start == len(tokens)
        return torch.cat(out)

    def state(self, slot: int) -> list[torch.Tensor]:
        return self.pool.state_of(slot)


def assert_states_equal(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float = 1e-5) -> None:
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=atol, msg=f"state tensor {i}")


# ---------------------------------------------------------------------------------------------------
# Models


@pytest.fixture(scope="module")
def tiny_hybrid_dir() -> Path:
    return resolve_model("tiny-hybrid", progress=False)


def _hf_model(model_dir: Path):
    return pin_dt_limit(transformers.NemotronHForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory, tiny_hybrid_dir) -> Path:
    out = tmp_path_factory.mktemp("random-nemotron-h")
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(**RANDOM_CONFIG)
    model = transformers.NemotronHForCausalLM(config)
    redraw_nemotron_h(model)
    model.save_pretrained(str(out))
    shutil.copy(tiny_hybrid_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def models(tiny_hybrid_dir, random_dir):
    """name -> (our model, transformers' model)."""
    return {name: (load_model(d, torch.float32, MAX_POSITIONS), _hf_model(d))
            for name, d in (("tiny-hybrid", tiny_hybrid_dir), ("random", random_dir))}


def _prompt(model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.arch.vocab_size, (length,), generator=gen).tolist()


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


MODEL_NAMES = ["tiny-hybrid", "random"]


# ---------------------------------------------------------------------------------------------------
# (a) full-prompt logits


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_logits_equal_transformers(models, name):
    ours, hf = models[name]
    tokens = _prompt(ours, 37, seed=1)  # crosses chunk boundaries (16 / 8) and ends mid-chunk
    steps = Steps(ours)
    got = steps.prefill(0, tokens)
    expected = _hf_logits(hf, tokens)
    assert expected.abs().max() > 5  # logits large enough for ATOL to be a real test
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert steps.layers_done == list(range(ours.arch.num_layers))  # attention ordinals, in order


def test_tiny_hybrid_arch_and_loading(models, tiny_hybrid_dir):
    ours, hf = models["tiny-hybrid"]
    a = ours.arch
    assert isinstance(a, HybridArch) and is_hybrid(a) and arch_from_dir(tiny_hybrid_dir) == a
    assert a.layer_types == tuple("M-M*M-M*") and a.num_hidden_layers == 8 and a.num_layers == 2
    assert (a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (128, 4, 2, 32, 49152)
    assert (a.mamba_num_heads, a.mamba_head_dim, a.ssm_state_size, a.n_groups, a.conv_kernel, a.chunk_size) == (
        8, 16, 16, 2, 4, 16)
    s = a.mamba_state_shape()
    assert (s.num_mamba_layers, s.conv_dim, s.conv_width, s.num_heads, s.head_dim, s.state_size) == (
        4, 192, 3, 8, 16, 16)
    assert a.tie_word_embeddings and ours.lm_head is ours.embed_tokens  # stored copy shared on load
    assert torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    assert hf.config.layers_block_type == TINY_HYBRID_CONFIG["layers_block_type"]
    assert a.eos_token_ids and a.bos_token_id is not None
    assert a.rope_theta == 10000.0 and ours.rope.cos.shape == (MAX_POSITIONS, a.head_dim)
    # Deterministic weights: the same bytes from every build.
    first, again = tiny_hybrid_state_dict(), tiny_hybrid_state_dict()
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_random_model_arch_reads_transformers_config(models, random_dir):
    ours, hf = models["random"]
    a, c = ours.arch, hf.config
    assert a.layer_types == tuple("*M-M*M") and a.num_layers == 2 and a.num_mamba_layers == 3
    assert (a.n_groups, a.conv_kernel, a.chunk_size, a.ssm_state_size) == (c.n_groups, c.conv_kernel, c.chunk_size,
                                                                            c.ssm_state_size)
    assert a.dt_min == c.time_step_limit[0] == 0.001 and a.rms_norm_eps == c.layer_norm_epsilon
    assert not a.use_conv_bias and not a.tie_word_embeddings and ours.lm_head is not ours.embed_tokens


# ---------------------------------------------------------------------------------------------------
# (b) chunked prefill


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_chunked_prefill_equals_one_chunk(models, name):
    ours, _ = models[name]
    tokens = _prompt(ours, 41, seed=2)
    whole = Steps(ours)
    expected = whole.prefill(0, tokens)
    chunked = Steps(ours)
    # Chunks that end inside, at and across scan chunks, and a one-token chunk (the decode path).
    got = chunked.prefill(3, tokens, chunks=[5, 11, 1, 16, 8])
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert_states_equal(chunked.state(3), whole.state(0))


# ---------------------------------------------------------------------------------------------------
# (c) decode after prefill


def _greedy_decode(steps: Steps, slot: int, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then one token per step; returns the generated tokens and the logits that chose each."""
    last = steps.prefill(slot, prompt)[-1:]
    tokens, logits = [], [last]
    for _ in range(num_new):
        tokens.append(int(logits[-1][-1].argmax()))
        if len(tokens) < num_new:
            logits.append(steps.step([(slot, [tokens[-1]])])[0])
    return tokens, torch.cat(logits)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_decode_after_prefill_equals_transformers(models, name):
    ours, hf = models[name]
    prompt = _prompt(ours, 10, seed=3)
    num_new = 24  # the decode crosses the scan's chunk boundaries too
    tokens, logits = _greedy_decode(Steps(ours), 1, prompt, num_new)
    # Oracle: transformers' full forward over prompt + continuation, read at every decode position.
    expected = _hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1]
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL)
    assert tokens == expected.argmax(-1).tolist()
    if name == "tiny-hybrid":
        # And transformers' own cached greedy generation (its one-token Mamba path) agrees.
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                                    do_sample=False)[0, len(prompt):].tolist()
        assert tokens == generated


# ---------------------------------------------------------------------------------------------------
# (d) packed batches


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_packed_batch_equals_each_row_alone(models, name):
    ours, _ = models[name]
    history = {1: _prompt(ours, 7, seed=4), 2: _prompt(ours, 6, seed=5), 4: _prompt(ours, 20, seed=6)}
    this_step = {0: _prompt(ours, 13, seed=7),  # fresh prefill
                 1: _prompt(ours, 1, seed=8),  # decode
                 2: _prompt(ours, 9, seed=9),  # prefill continuing a state (chunked prefill)
                 3: _prompt(ours, 1, seed=10),  # a one-token prompt: the decode path from a zero state
                 4: _prompt(ours, 1, seed=11)}  # decode
    order = [2, 1, 0, 4, 3]  # rows in an order unlike their slots

    packed = Steps(ours)
    for slot, tokens in history.items():
        packed.prefill(slot, tokens)
    for t in packed.pool.conv + packed.pool.ssm:  # a previous owner's state: fresh rows must not read it
        t[[0, 3]] = 7.0
    got = packed.step([(slot, this_step[slot]) for slot in order])

    for i, slot in enumerate(order):
        alone = Steps(ours)
        if slot in history:
            alone.prefill(slot, history[slot])
        expected = alone.step([(slot, this_step[slot])])[0]
        torch.testing.assert_close(got[i], expected, rtol=RTOL, atol=ATOL, msg=f"row of slot {slot}")
        assert_states_equal(packed.state(slot), alone.state(slot))


# ---------------------------------------------------------------------------------------------------
# (e) speculative verification rows


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_keep_positions_store_the_state_after_every_position(models, name):
    ours, _ = models[name]
    prompt, verify = _prompt(ours, 19, seed=12), _prompt(ours, 4, seed=13)  # 1 + k = 4 positions
    other_prompt, other_next = _prompt(ours, 5, seed=14), _prompt(ours, 1, seed=15)

    steps = Steps(ours, positions_per_step=4)
    steps.prefill(0, prompt)
    steps.prefill(2, other_prompt)
    rows = steps.step([(2, other_next), (0, verify, True), (5, _prompt(ours, 6, seed=16))])  # decode, verify, prefill
    spec_conv = [t[0].clone() for t in steps.pool.spec_conv]
    spec_ssm = [t[0].clone() for t in steps.pool.spec_ssm]

    reference = Steps(ours)
    expected_logits = reference.prefill(0, prompt + verify)[len(prompt):]
    torch.testing.assert_close(rows[1], expected_logits, rtol=RTOL, atol=ATOL)
    assert_states_equal(steps.state(0), reference.state(0))  # the main slot holds the state after the row
    for j in range(len(verify)):
        prefix = Steps(ours)
        prefix.prefill(0, prompt + verify[: j + 1])
        state = prefix.state(0)
        assert_states_equal([c[j] for c in spec_conv] + [s[j] for s in spec_ssm], state)

    # Keep the state after position 1 (two accepted), roll the KV back, and decode on: the same as if
    # the rejected drafts had never been there.
    steps.pool.select(np.array([0]), np.array([1]))
    steps.num_computed[0] = len(prompt) + 2
    nxt = _prompt(ours, 1, seed=17)
    got = steps.step([(0, nxt)])[0]
    expected = Steps(ours).prefill(0, prompt + verify[:2] + nxt)[-1:]
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_verification_row_longer_than_the_pool_keeps_is_refused(models):
    ours, _ = models["tiny-hybrid"]
    steps = Steps(ours, positions_per_step=2)
    steps.prefill(0, _prompt(ours, 4, seed=18))
    with pytest.raises(ValueError, match="max_positions_per_step"):
        steps.step([(0, _prompt(ours, 3, seed=19), True)])


# ---------------------------------------------------------------------------------------------------
# Loading variants


def test_model_prefix_weights_and_bf16(models, random_dir, tmp_path):
    """A checkpoint with ``model.`` names (as some tools write) loads the same; bf16 runs and stays close."""
    from safetensors.torch import load_file, save_file

    ours, _ = models["random"]
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(random_dir / f, tmp_path / f)
    weights = load_file(str(random_dir / "model.safetensors"))
    assert any(k.startswith("backbone.") for k in weights)
    save_file({k.replace("backbone.", "model.", 1): v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    renamed = NemotronHModel.load(tmp_path, torch.float32, MAX_POSITIONS)
    tokens = _prompt(ours, 12, seed=20)
    expected = Steps(ours).prefill(0, tokens)
    torch.testing.assert_close(Steps(renamed).prefill(0, tokens), expected, rtol=0, atol=0)

    bf16 = NemotronHModel.load(tmp_path, torch.bfloat16, MAX_POSITIONS)
    got = Steps(bf16).prefill(0, tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_legacy_config_keys_read_like_transformers():
    """hybrid_override_pattern and the mamba_* names NemotronHConfig.__post_init__ maps."""
    legacy = dict(vocab_size=300, hidden_size=32, hybrid_override_pattern="M*-M", num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8,
                  ssm_state_size=8, mamba_n_groups=2, mamba_d_conv=3, mamba_chunk_size=32, mamba_dt_min=0.002,
                  mamba_dt_limit=[0.003, float("inf")],
                  mamba_conv_bias=False, n_groups=8, conv_kernel=4, rms_norm_eps=1e-6)
    ours = HybridArch.from_config(legacy)
    theirs = transformers.NemotronHConfig(**legacy)
    assert ours.layer_types == tuple(theirs.hybrid_override_pattern) == tuple("M*-M")
    assert (ours.n_groups, ours.conv_kernel, ours.chunk_size, ours.dt_min, ours.use_conv_bias) == (
        theirs.n_groups, theirs.conv_kernel, theirs.chunk_size, theirs.time_step_limit[0], theirs.use_conv_bias)
    assert ours.dt_min == 0.003  # the clamp is time_step_limit's; time_step_min (0.002) only sets dt_bias's init
    assert ours.num_layers == 1 and ours.num_mamba_layers == 2
    assert (ours.rms_norm_eps, ours.bos_token_id, ours.eos_token_ids, ours.num_kv_heads) == (
        theirs.layer_norm_epsilon, theirs.bos_token_id, (theirs.eos_token_id,), theirs.num_key_value_heads)
    # layers_block_type wins over the pattern, and legacy layer names are remapped as transformers does.
    both = dict(legacy, layers_block_type=["mamba", "attention", "mlp"])
    assert HybridArch.from_config(both).layer_types == ("M", "*", "-")


# ---------------------------------------------------------------------------------------------------
# (g) architectures and unsupported layers: one clear line


def _model_dir(tmp_path: Path, config: dict, tokenizer: bool = True) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    d = _model_dir(tmp_path, {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})
    for call in (lambda: arch_from_dir(d), lambda: load_model(d, torch.float32, 16)):
        with pytest.raises(ValueError) as info:
            call()
        message = _one_line(info)
        assert "'GPT2LMHeadModel'" in message
        assert all(name in message for name in ("LlamaForCausalLM", "MistralForCausalLM", "NemotronHForCausalLM"))


def test_unsupported_moe_layer_is_one_clear_line(tmp_path):
    """MoE layers load (tests/test_nemotron_moe.py); an MoE configuration we cannot run is refused in one line
    naming the field, whether the pattern is a list or the legacy string."""
    cfg = {**TINY_HYBRID_CONFIG, "layers_block_type": ["linear_attention", "moe", "full_attention"],
           "n_routed_experts": 8, "n_group": 3}
    with pytest.raises(ValueError) as info:
        arch_from_dir(_model_dir(tmp_path / "list", cfg))
    assert "n_group 3" in _one_line(info) and "n_routed_experts 8" in str(info.value)
    legacy = {k: v for k, v in cfg.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M*E"}
    with pytest.raises(ValueError) as info:
        arch_from_dir(_model_dir(tmp_path / "pattern", legacy))
    assert "n_group 3" in _one_line(info)


def test_missing_files_are_one_clear_line(tmp_path, tiny_hybrid_dir):
    no_tokenizer = _model_dir(tmp_path / "a", TINY_HYBRID_CONFIG, tokenizer=False)
    with pytest.raises(ValueError) as info:
        arch_from_dir(no_tokenizer)
    assert "tokenizer.json" in _one_line(info)
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError) as info:
        load_model(tmp_path / "b", torch.float32, 16)
    assert "config.json" in _one_line(info) and "tokenizer.json" in str(info.value)


def test_llama_family_still_dispatches_to_llama(tiny_dir):
    arch = arch_from_dir(tiny_dir)
    assert isinstance(arch, ModelArch) and not is_hybrid(arch)
    assert isinstance(load_model(tiny_dir, torch.float32, 64), LlamaModel)
