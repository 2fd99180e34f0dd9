"""Prefill and mixed steps through piecewise CUDA graphs (engine/piecewise_graphs.py). On a CPU the pieces are
emulated: the same static buffers, padding, attention breaks with the step's metadata and shared output buffers,
the forward called again instead of its pieces replayed; the ``gpu`` test captures for real."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_engine
from pdcluster.engine import attention
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.piecewise_graphs import PAD_SLOT, PiecewiseGraphs, token_buckets
from pdcluster.engine.sampling_params import SamplingParams

# Prompts longer than the step's token budget: chunked prefills beside decode rows (mixed steps).
PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(9 + 23 * i)] for i in range(5)]
CFG = dict(max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=128)


def test_token_buckets():
    assert token_buckets(48) == [16, 32, 48]
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]


def _generate(engine, emulate: bool = True):
    if emulate:
        engine.runner.use_mixed_graphs(engine.config.max_num_batched_tokens, emulate=True)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    return outs


def _assert_same(graphed, eager):
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):  # padded tokens change GEMM shapes: equal within fp32 noise
        np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in e.logprobs], atol=1e-4)
        np.testing.assert_allclose([x.logprob for x in g.prompt_logprobs[1:]],
                                   [x.logprob for x in e.prompt_logprobs[1:]], atol=1e-4)


# The default run takes the synchronous case; async and n-gram scheduling go through the same pieces (slow run).
@pytest.mark.parametrize("cfg", [{}, pytest.param(dict(async_scheduling=True), marks=pytest.mark.slow),
                                 pytest.param(dict(spec_method="ngram", num_spec_tokens=2), marks=pytest.mark.slow)],
                         ids=["sync", "async", "ngram"])
def test_emulated_pieces_give_the_eager_tokens(tiny_dir, cfg):
    eager = _generate(make_engine("tiny-random", **CFG, **cfg), emulate=False)
    engine = make_engine("tiny-random", **CFG, **cfg)
    graphed = _generate(engine)
    pieces = engine.runner.mixed_graphs
    assert pieces.num_replays > 0 and pieces.num_captures == len(pieces._calls)
    num_layers = len(engine.runner.model.layers)
    assert all(pieces.num_pieces(b) == num_layers + 1 for b in pieces._calls)  # a break at every attention call
    assert attention._breaks.recorder is None  # no recorder left behind
    _assert_same(graphed, eager)


def _step(graphs, runner, rows: list[tuple[list[int], int, list[int]]], block_size: int = 16):
    """A step of rows (input ids, start position, block ids): the eager metadata and tensors prepare_inputs makes."""
    ids, positions, slots, lens, starts = [], [], [], [], [0]
    width = max(len(b) for _, _, b in rows)
    for tokens, start, blocks in rows:
        for j, t in enumerate(tokens):
            p = start + j
            ids.append(t)
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        lens.append(start + len(tokens))
        starts.append(starts[-1] + len(tokens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([b + [0] * (width - len(b)) for _, _, b in rows],
                                                                     dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        uniform_q_len=None, scale=runner.model.scale)
    return torch.tensor(ids), torch.tensor(positions), meta


def test_padded_tokens_write_no_kv_and_the_real_ones_are_eager(tiny_dir):
    engine = make_engine("tiny-random", max_num_seqs=4, num_kv_blocks=32)
    runner = engine.runner
    graphs = PiecewiseGraphs(lambda ids, pos, meta: runner.model.forward(ids, pos, runner.kv_cache, meta, None),
                             runner.device, 64, runner.model.scale, emulate=True)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    # 16 tokens (a full bucket), then 3 rows of 11 tokens in it: 5 padded tokens.
    full = [([7 + j for j in range(10)], 0, [1]), ([30 + j for j in range(6)], 20, [2, 3])]
    graphs.run(*_step(graphs, runner, full))
    assert graphs.slot_mapping[15].item() == 3 * 16 + 9
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    rows = [([11, 12, 13, 14], 0, [4]), ([21], 9, [5]), ([31, 32, 33, 34, 35, 36], 14, [6, 7])]
    ids, pos, meta = _step(graphs, runner, rows)
    hidden = graphs.run(ids, pos, meta)
    assert hidden.shape[0] == 11 and graphs.bucket(11) == 16
    assert (graphs.slot_mapping[11:16] == PAD_SLOT).all() and (graphs.input_ids[11:16] == 0).all()
    changed = (runner.kv_cache != before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    written = {(int(b), int(o)) for b, o in changed.any(0).any(0).nonzero().tolist()}
    want = {(4, 0), (4, 1), (4, 2), (4, 3), (5, 9), (6, 14), (6, 15), (7, 0), (7, 1), (7, 2), (7, 3)}
    assert written == want  # the real tokens' slots, nothing for the padded ones
    after = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    eager = runner.model.forward(ids, pos, runner.kv_cache, meta, None)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, runner.kv_cache)  # and the same KV


def test_models_the_pieces_do_not_take_run_eager():
    engine = make_engine("tiny-hybrid", max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    engine.runner.use_mixed_graphs(64, emulate=True)
    assert engine.runner.mixed_graphs is None  # the Mamba layers read a per-step host plan


def test_a_bucket_whose_capture_fails_runs_eager(tiny_dir, caplog):
    eager = _generate(make_engine("tiny-random", **CFG), emulate=False)
    engine = make_engine("tiny-random", **CFG)
    engine.runner.use_mixed_graphs(48, emulate=True)
    pieces = engine.runner.mixed_graphs
    capture = pieces._capture

    def failing(bucket, n, meta):
        if bucket == 48:
            raise RuntimeError("operation not permitted when stream is capturing")
        capture(bucket, n, meta)

    pieces._capture = failing
    with caplog.at_level("WARNING"):
        graphed = _generate(engine, emulate=False)
    assert "for 48 tokens failed" in caplog.text and 48 in pieces._failed and pieces.num_replays > 0
    _assert_same(graphed, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", [{}, dict(async_scheduling=True)], ids=["sync", "async"])
def test_captured_pieces_give_the_eager_tokens_on_cuda(tiny_dir, cfg):
    eager = _generate(make_engine("tiny-random", device="cuda", cuda_graphs=False, **CFG, **cfg), emulate=False)
    engine = make_engine("tiny-random", device="cuda", mixed_cuda_graph_tokens=48, **CFG, **cfg)
    pieces = engine.runner.mixed_graphs
    assert pieces is not None and not pieces.emulate
    graphed = _generate(engine, emulate=False)
    assert pieces.num_replays > 0
    num_layers = len(engine.runner.model.layers)
    assert all(pieces.num_pieces(b) == num_layers + 1 for b in pieces._pieces)
    _assert_same(graphed, eager)


def test_the_flag_reaches_the_engine_config():
    """generate and serve take --mixed-cuda-graph-tokens (the Ray launcher rebuilds every worker's config from the
    flags); off by default, and a CPU engine never builds the pieces (no CUDA)."""
    from pdcluster.cli.main import build_parser
    from pdcluster.cluster.engine_args import engine_config_from_args

    for command in (["generate", "--prompt", "x"], ["serve"]):
        parse = lambda *a: engine_config_from_args(build_parser().parse_args([*command, *a]))  # noqa: E731
        assert parse().mixed_cuda_graph_tokens == 0
        assert parse("--mixed-cuda-graph-tokens", "512").mixed_cuda_graph_tokens == 512
    assert make_engine("tiny-random", mixed_cuda_graph_tokens=64).runner.mixed_graphs is None
    from pdcluster.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="mixed_cuda_graph_tokens: must be a non-negative integer"):
        EngineConfig(mixed_cuda_graph_tokens=-1)
