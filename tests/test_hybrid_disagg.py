"""Hybrid models (tiny-hybrid: Mamba2 + attention) disaggregated: the prefill worker sends each prompt's
Mamba state (conv + SSM, every Mamba layer) with its KV blocks, in the blocks right after the prompt's
(engine/mamba_state_blocks.py), written after the proposer and sent from post_forward (S2). Real prefill and
decode workers on 127.0.0.1, every transport usable here: the tokens equal the colocated engine's, the
bytes sent include the state, and both pools get every block back.

Without the state the decode worker would run the recurrence from zero after the prompt and the
tokens would differ (a mutation check: skip ``pack_state`` and these tests fail)."""

from __future__ import annotations

import functools

import pytest

from conftest import engine_config, make_engine, usable_transports
from test_kv_transfer_e2e import run_on_pair
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.kv_transfer.config import TransferConfig, kv_layout
from pdcluster.kv_transfer.protocol import HandshakeError, Hello, check_compatible

TRANSPORTS = usable_transports()
NUM_BLOCKS = 128
PROMPTS = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 16, 17, 45, 100])]

_config = functools.partial(engine_config, "tiny-hybrid", num_kv_blocks=NUM_BLOCKS, max_model_len=512,
                            prefill_chunk_size=16)


def _colocated(params, **overrides):
    return [o.token_ids for o in make_engine("tiny-hybrid", num_kv_blocks=NUM_BLOCKS, max_model_len=512,
                                             **overrides).generate(PROMPTS, params)]


def _disagg(transport: str, params: SamplingParams, **overrides):
    run = run_on_pair(_config(**overrides), TransferConfig(transport=transport, secret="s3cret"), PROMPTS, params,
                      NUM_BLOCKS)
    return run.tokens, run.stats[0]["bytes_sent"], run.prefill_engine


def _kv_bytes(engine) -> int:
    """Bytes of the prompts' KV alone (every layer, every prompt block)."""
    bs = engine.kv_spec.block_size
    return sum(-(-len(p) // bs) for p in PROMPTS) * engine.kv_spec.bytes_per_block


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hybrid_disagg_equals_colocated(transport):
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    expected = _colocated(params)
    tokens, bytes_sent, engine = _disagg(transport, params)
    assert tokens == expected
    assert engine.num_state_blocks >= 1
    # The state went too: at least one state stripe per request beyond the prompt blocks.
    state_bytes = len(PROMPTS) * engine.num_state_blocks * engine.kv_spec.bytes_per_block
    assert bytes_sent >= _kv_bytes(engine) + state_bytes


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def greedy_colocated():
    return _colocated(GREEDY)  # plain greedy, no speculation: speculation must not change it


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,async_scheduling", [("ngram", False), ("ngram", True), ("mtp", False), ("mtp", True)])
def test_hybrid_disagg_speculative_equals_colocated(greedy_colocated, method, async_scheduling):
    spec = dict(spec_method=method, num_spec_tokens=2, async_scheduling=async_scheduling)
    tokens, _, _ = _disagg("tcp", GREEDY, **spec)
    assert tokens == greedy_colocated


def test_handshake_refuses_a_different_state_layout():
    engine = make_engine("tiny-hybrid", num_kv_blocks=16, max_model_len=256)
    mine = kv_layout(engine.kv_spec, engine.state_shape, engine.num_state_blocks)
    from dataclasses import replace

    theirs = replace(mine, state_conv_dim=mine.state_conv_dim + 1)
    hello = functools.partial(Hello, model_fingerprint="m", transport="tcp", transport_descriptor={},
                              nonce=b"0" * 16, hmac=b"")
    with pytest.raises(HandshakeError, match="layout.state_conv_dim differs"):
        check_compatible(hello(worker_id="p0", role="prefill", layout=mine),
                         hello(worker_id="d0", role="decode", layout=theirs))
