"""Decode through CUDA graphs (engine/cuda_graphs.py). On a CPU the graphs are emulated: the same static
buffers, bucket padding and output slicing, replayed by calling the captured function again; the
``gpu`` test captures for real."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_engine
from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.cuda_graphs import PAD_SLOT, DecodeGraphs, batch_buckets
from pdcluster.engine.sampling_params import SamplingParams

PROMPTS = [[5 + (7 * i + 3 * j) % 300 for j in range(4 + 5 * i)] for i in range(7)]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    # An H100/H200 runs up to 1,024 requests (engine/batch_limits.py): captures stop at 512, as vLLM's.
    assert batch_buckets(1024) == [1, 2, 4, 8] + list(range(16, 512, 16)) + [512]
    assert batch_buckets(600)[-1] == 512
    assert batch_buckets(1024, 64) == [1, 2, 4, 8, 16, 32, 48, 64]  # --max-cudagraph-capture-size 64


def test_batches_over_the_largest_bucket_run_eager(tiny_dir, monkeypatch):
    """A decode batch larger than max_cuda_graph_batch (vLLM's --max-cudagraph-capture-size) runs eager (same tokens);
    once it shrinks to a bucket it replays."""
    import pdcluster.engine.cuda_graphs as cuda_graphs

    cfg = dict(max_num_seqs=10, num_kv_blocks=128, max_cuda_graph_batch=4)
    eager = _generate(make_engine("tiny-random", **cfg), graphs=False)
    engine = make_engine("tiny-random", **cfg)
    runs = []  # (rows, replayed) of every uniform decode step offered to the graphs
    run = cuda_graphs.DecodeGraphs.run

    def recorded(self, ids, pos, meta):
        out = run(self, ids, pos, meta)
        runs.append((meta.seq_lens.shape[0], out))
        return out

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", recorded)
    graphed = _generate(engine, graphs=True)
    assert engine.runner.graphs.buckets == [1, 2, 4]
    rows = {(n, out is not None) for n, out in runs}
    assert {n for n, replayed in rows if not replayed} == {5, 6, 7}, rows  # no bucket holds them: eager
    assert {n for n, replayed in rows if replayed} == {1, 2, 3, 4}, rows
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def _generate(engine, graphs: bool, emulate: bool = True):
    if graphs:
        engine.runner.use_decode_graphs(emulate=emulate)
    params = [SamplingParams(max_tokens=8 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=2) for i in range(7)]
    outs = engine.generate(PROMPTS, params)  # rows finish at different steps: the batch shrinks through buckets
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_spec.num_blocks
    return outs


# n-gram drafts vary in number per row unless async scheduling pads them: only then are batches uniform.
@pytest.mark.parametrize("spec", [{}, dict(spec_method="ngram", num_spec_tokens=2, async_scheduling=True),
                                  dict(spec_method="mtp", num_spec_tokens=2)])
def test_emulated_graphs_give_the_eager_tokens(tiny_dir, spec):
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, **spec)
    eager = _generate(make_engine("tiny-random", **cfg), graphs=False)
    engine = make_engine("tiny-random", **cfg)
    graphed = _generate(engine, graphs=True)
    graphs = engine.runner.graphs
    assert graphs.num_replays > 0
    # Every replayed step's inputs were staged straight into the static buffers: none copied there by run().
    assert graphs.num_staged == graphs.num_replays and graphs.num_copied == 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):  # the padded batch is other GEMM shapes: equal within fp32 noise
        np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in e.logprobs], atol=1e-4)


def test_padded_rows_write_no_kv_and_read_nothing_they_keep(tiny_dir):
    engine = make_engine("tiny-random", max_num_seqs=8, num_kv_blocks=32)
    runner = engine.runner
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model.forward(ids, pos, runner.kv_cache, meta, None),
                          runner.device, 8, 1, 4, runner.model.scale, emulate=True)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    # 3 decode rows at positions 5, 9, 17 of blocks [1], [2], [3, 4]: bucket 4, one padded row.
    seq_lens = torch.tensor([6, 10, 18], dtype=torch.int32)
    block_tables = torch.tensor([[1, 0], [2, 0], [3, 4]], dtype=torch.int32)
    slots = torch.tensor([1 * 16 + 5, 2 * 16 + 9, 4 * 16 + 1], dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens,
                             query_start_loc=torch.arange(4, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale)
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([5, 9, 17])
    hidden = graphs.run(ids, pos, meta)
    assert hidden.shape[0] == 3 and graphs.bucket(3) == 4
    assert graphs.slot_mapping[3].item() == PAD_SLOT and graphs.seq_lens[3].item() == 1
    changed = (runner.kv_cache != before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    written = {(int(b), int(o)) for b, o in changed.any(0).any(0).nonzero().tolist()}
    assert written == {(1, 5), (2, 9), (4, 1)}  # the three rows' slots, nothing for the padded row
    # Same rows eagerly: the same hidden states (the padded row changes nothing the real rows read).
    runner.kv_cache.copy_(before)
    eager = runner.model.forward(ids, pos, runner.kv_cache, meta, None)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    # A smaller batch after a bigger one in the same bucket: the stale row is reset to padding.
    four = AttentionMetadata(slot_mapping=torch.cat([slots, torch.tensor([5 * 16])]),
                             block_tables=torch.cat([block_tables, torch.tensor([[5, 0]], dtype=torch.int32)]),
                             seq_lens=torch.cat([seq_lens, torch.tensor([1], dtype=torch.int32)]),
                             query_start_loc=torch.arange(5, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale)
    graphs.run(torch.tensor([11, 12, 13, 14]), torch.tensor([5, 9, 17, 0]), four)
    assert graphs.slot_mapping[3].item() == 5 * 16 and graphs.block_tables[3, 0].item() == 5
    graphs.run(ids, pos, meta)
    assert graphs.slot_mapping[3].item() == PAD_SLOT and graphs.seq_lens[3].item() == 1
    assert graphs.block_tables[3].tolist() == [0, 0, 0, 0]


def test_padded_rows_read_block_0_after_steps_of_any_size(tiny_dir):
    """A padded row's table is zeroed only where an earlier step wrote it (engine/cuda_graphs.py counts the rows
    written): after a full bucket of 8, a step of 3 (bucket 4) and then one of 5 (bucket 8) still pad with zeros."""
    engine = make_engine("tiny-random", max_num_seqs=8, num_kv_blocks=32)
    runner = engine.runner
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model.forward(ids, pos, runner.kv_cache, meta, None),
                          runner.device, 8, 1, 4, runner.model.scale, emulate=True)

    def step(num_rows: int) -> None:
        tables = torch.tensor([[1 + r, 9 + r] for r in range(num_rows)], dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=torch.tensor([(1 + r) * 16 for r in range(num_rows)]),
                                 block_tables=tables, seq_lens=torch.ones(num_rows, dtype=torch.int32),
                                 query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32), uniform_q_len=1,
                                 scale=runner.model.scale)
        graphs.run(torch.full((num_rows,), 7), torch.zeros(num_rows, dtype=torch.int64), meta)
        bucket = graphs.bucket(num_rows)
        assert graphs.block_tables[:num_rows, :2].tolist() == tables.tolist()
        assert not graphs.block_tables[num_rows:bucket].any(), (num_rows, graphs.block_tables[:bucket].tolist())

    for num_rows in (8, 3, 5, 2, 8, 7, 1, 4):
        step(num_rows)


def _staged_step(graphs, inputs, rows: list[tuple[int, int, list[int]]], block_size: int = 16) -> dict:
    """Stage a decode step of rows (input id, position, block ids) as prepare_inputs does; its device tensors."""
    positions = np.array([p for _, p, _ in rows], dtype=np.int64)
    width = max(len(b) for _, _, b in rows)
    tables = np.array([b + [0] * (width - len(b)) for _, _, b in rows], dtype=np.int32)
    host = {"input_ids": np.array([t for t, _, _ in rows], dtype=np.int64), "positions": positions,
            "slot_mapping": tables[np.arange(len(rows)), positions // block_size].astype(np.int64) * block_size
            + positions % block_size,
            "seq_lens": (positions + 1).astype(np.int32), "block_tables": tables}
    inputs.begin_step()
    dev = graphs.stage(inputs, host)
    dev["block_tables"] = inputs.put("block_tables", tables)
    return dev


@pytest.mark.parametrize("staged", [True, False], ids=["pinned-arena", "in-place"])
def test_a_staged_step_pads_its_bucket_and_writes_no_kv_for_padded_rows(tiny_dir, staged):
    """A step staged into the static buffers (one host-to-device copy) pads its bucket itself: after a full
    bucket, a smaller step's padded row is back to slot -1 and length 1, writes no KV, and the real rows'
    hidden states are the eager ones."""
    from pdcluster.engine.step_inputs import StepInputs

    engine = make_engine("tiny-random", max_num_seqs=8, num_kv_blocks=32)
    runner = engine.runner
    inputs = StepInputs("cpu", staged=staged)
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model.forward(ids, pos, runner.kv_cache, meta, None),
                          runner.device, 8, 1, 4, runner.model.scale, emulate=True)
    torch.manual_seed(0)
    runner.kv_cache.normal_()

    def run(rows):
        dev = _staged_step(graphs, inputs, rows)
        meta = AttentionMetadata(slot_mapping=dev["slot_mapping"], block_tables=dev["block_tables"],
                                 seq_lens=dev["seq_lens"], query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
                                 uniform_q_len=1, scale=runner.model.scale)
        assert dev["input_ids"].data_ptr() == graphs.input_ids.data_ptr()  # the static buffer itself
        return graphs.run(dev["input_ids"], dev["positions"], meta), meta, dev

    four = [(11, 5, [1]), (12, 9, [2]), (13, 17, [3, 4]), (14, 0, [5])]
    run(four)
    assert graphs.slot_mapping[3].item() == 5 * 16 and graphs.seq_lens[3].item() == 1 and graphs.input_ids[3] == 14
    runner.kv_cache.normal_()  # fresh values: the next step's writes show
    before = runner.kv_cache.clone()
    hidden, meta, dev = run(four[:3])  # bucket 4 again: row 3 is padding now
    assert graphs.num_staged == 2 and graphs.num_copied == 0 and graphs.num_replays == 2
    assert hidden.shape[0] == 3
    assert graphs.slot_mapping[3].item() == PAD_SLOT and graphs.seq_lens[3].item() == 1
    assert graphs.block_tables[3].tolist() == [0, 0, 0, 0]
    changed = (runner.kv_cache != before).flatten(4).any(-1)
    written = {(int(b), int(o)) for b, o in changed.any(0).any(0).nonzero().tolist()}
    assert written == {(1, 5), (2, 9), (4, 1)}
    runner.kv_cache.copy_(before)
    eager = runner.model.forward(dev["input_ids"].clone(), dev["positions"].clone(), runner.kv_cache, meta, None)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)


def test_a_staged_step_whose_capture_fails_runs_eager_on_its_staged_inputs(tiny_dir, caplog):
    """The runner stages a uniform decode step before the graph is captured: if that capture fails, the step
    runs eager over the static buffers it was staged into, with the same tokens."""
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, async_scheduling=True)
    eager = _generate(make_engine("tiny-random", **cfg), graphs=False)
    engine = make_engine("tiny-random", **cfg)
    engine.runner.use_decode_graphs(emulate=True)
    graphs = engine.runner.graphs
    capture = graphs._capture

    def failing(bucket):
        if bucket == 8:
            raise RuntimeError("operation not permitted when stream is capturing")
        capture(bucket)

    graphs._capture = failing
    with caplog.at_level("WARNING"):
        graphed = _generate(engine, graphs=False)
    assert "bucket 8 failed" in caplog.text and 8 in graphs._failed and graphs.num_replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


# Hybrids: the Mamba layers' one-token updates replay inside the graph over static state slots.
HYBRID_SPECS = [{}, dict(spec_method="mtp", num_spec_tokens=2),
                dict(spec_method="ngram", num_spec_tokens=2, async_scheduling=True)]


@pytest.mark.parametrize("spec", HYBRID_SPECS, ids=["none", "mtp", "ngram-async"])
def test_emulated_graphs_give_a_hybrids_eager_tokens(spec):
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, max_model_len=512, **spec)
    eager = _generate(make_engine("tiny-hybrid", **cfg), graphs=False)
    engine = make_engine("tiny-hybrid", **cfg)
    graphed = _generate(engine, graphs=True)
    assert engine.runner.graphs.num_replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):
        np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in e.logprobs], atol=1e-4)


def _mamba_meta(pool, slots: list[int], started: bool = True):
    from pdcluster.engine.mamba_state import MambaMetadata

    n = len(slots)
    return MambaMetadata(pool=pool, query_start_loc_np=np.arange(n + 1, dtype=np.int64),
                         state_slots_np=np.array(slots, dtype=np.int64), has_initial_state_np=np.full(n, started),
                         keep_positions_np=np.zeros(n, dtype=bool), state_slots=torch.tensor(slots))


def test_a_hybrids_padded_rows_update_only_the_scratch_state_slot():
    engine = make_engine("tiny-hybrid", max_num_seqs=8, num_kv_blocks=32)
    runner, pool = engine.runner, engine.runner.mamba_pool
    assert pool.num_slots == 9  # the 8 rows' and a scratch slot for padding
    graphs = DecodeGraphs(lambda ids, pos, meta: runner.model.forward(ids, pos, runner.kv_cache, meta, None),
                          runner.device, 8, 1, 4, runner.model.scale, emulate=True, mamba_pool=pool)
    torch.manual_seed(0)
    for t in pool.conv + pool.ssm:
        t.normal_()
    runner.kv_cache.normal_()
    states, kv = [t.clone() for t in pool.conv + pool.ssm], runner.kv_cache.clone()
    # 3 decode rows in slots 2, 5, 7: bucket 4, one padded row.
    meta = AttentionMetadata(slot_mapping=torch.tensor([16 + 5, 32 + 9, 64 + 1]),
                             block_tables=torch.tensor([[1, 0], [2, 0], [3, 4]], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 10, 18], dtype=torch.int32),
                             query_start_loc=torch.arange(4, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale, mamba=_mamba_meta(pool, [2, 5, 7]))
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([5, 9, 17])
    hidden = graphs.run(ids, pos, meta)
    assert hidden.shape[0] == 3 and graphs.state_slots[:4].tolist() == [2, 5, 7, 8]
    changed = {s for s in range(pool.num_slots)
               if any(not torch.equal(t[s], b[s]) for t, b in zip(pool.conv + pool.ssm, states))}
    assert changed == {2, 5, 7, 8}  # the rows' slots and the scratch slot, no other request's state
    graphed_states = [t.clone() for t in pool.conv + pool.ssm]
    # The same rows eagerly from the same start: the same hidden states and row states.
    for t, b in zip(pool.conv + pool.ssm, states):
        t.copy_(b)
    runner.kv_cache.copy_(kv)
    eager = runner.model.forward(ids, pos, runner.kv_cache, meta, None)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    for t, g in zip(pool.conv + pool.ssm, graphed_states):
        torch.testing.assert_close(t[[2, 5, 7]], g[[2, 5, 7]], rtol=1e-5, atol=1e-5)
    # A smaller batch after a bigger one in the same bucket: the stale row's slot goes back to the scratch.
    four = AttentionMetadata(slot_mapping=torch.tensor([16 + 5, 32 + 9, 64 + 1, 80]),
                             block_tables=torch.tensor([[1, 0], [2, 0], [3, 4], [5, 0]], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 10, 18, 1], dtype=torch.int32),
                             query_start_loc=torch.arange(5, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale, mamba=_mamba_meta(pool, [2, 5, 7, 1]))
    graphs.run(torch.tensor([11, 12, 13, 14]), torch.tensor([5, 9, 17, 0]), four)
    assert graphs.state_slots[:4].tolist() == [2, 5, 7, 1]
    graphs.run(ids, pos, meta)
    assert graphs.state_slots[:4].tolist() == [2, 5, 7, 8]
    # A row starting from token 0 (a one-token prompt looks like decode) runs eager: its state starts at zero.
    meta.mamba = _mamba_meta(pool, [2, 5, 7], started=False)
    assert graphs.run(ids, pos, meta) is None
    # A pool without the scratch slot is refused in one line.
    from pdcluster.engine.mamba_state import MambaStatePool

    with pytest.raises(ValueError, match="scratch slot"):
        DecodeGraphs(lambda *a: None, runner.device, 8, 1, 4, 1.0, emulate=True,
                     mamba_pool=MambaStatePool(pool.shape, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", HYBRID_SPECS[:2], ids=["none", "mtp"])
def test_captured_graphs_give_a_hybrids_eager_tokens_on_cuda(spec):
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, max_model_len=512, device="cuda", deterministic=True, **spec)
    eager = _generate(make_engine("tiny-hybrid", cuda_graphs=False, **cfg), graphs=False)
    engine = make_engine("tiny-hybrid", **cfg)
    assert engine.runner.graphs is not None and not engine.runner.graphs.emulate
    graphed = _generate(engine, graphs=False)  # the engine's own graphs
    assert engine.runner.graphs.num_replays > 0 and not engine.runner.graphs._failed
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_graphs_skip_steps_whose_connector_sends_layers():
    from pdcluster.wire.kv_connector import KVConnector

    class Sends(KVConnector):
        def save_layer(self, layer_idx: int) -> None:
            pass

    assert not KVConnector().wants_layers() and Sends().wants_layers()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens_on_cuda(tiny_dir):
    # Deterministic mode: a padded bucket must not change a row's bits (the fast mode's cuBLAS may pick
    # another kernel for 16 rows than for 10, so only batch-invariant kernels make tokens comparable).
    cfg = dict(max_num_seqs=10, num_kv_blocks=128, device="cuda", deterministic=True)
    eager = _generate(make_engine("tiny-random", cuda_graphs=False, **cfg), graphs=False)
    engine = make_engine("tiny-random", **cfg)
    assert engine.runner.graphs is not None and not engine.runner.graphs.emulate
    graphed = _generate(engine, graphs=False)  # the engine's own graphs
    assert engine.runner.graphs.num_replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_a_bucket_whose_capture_fails_runs_eager(tiny_dir, caplog):
    """A forward that cannot be captured (a host synchronisation inside it) must not fail the step: that
    bucket runs eager from then on, with one warning."""
    engine = make_engine("tiny-random", max_num_seqs=4, num_kv_blocks=64)
    runner = engine.runner
    calls = {"n": 0}

    def forward(ids, pos, meta):
        calls["n"] += 1
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DecodeGraphs(forward, runner.device, 4, 1, 4, runner.model.scale, emulate=True)
    meta = AttentionMetadata(slot_mapping=torch.tensor([5]), block_tables=torch.tensor([[0]], dtype=torch.int32),
                             seq_lens=torch.tensor([6], dtype=torch.int32),
                             query_start_loc=torch.arange(2, dtype=torch.int32), uniform_q_len=1,
                             scale=runner.model.scale)
    with caplog.at_level("WARNING"):
        assert graphs.run(torch.tensor([7]), torch.tensor([5]), meta) is None
        assert graphs.run(torch.tensor([7]), torch.tensor([5]), meta) is None
    assert calls["n"] == 1 and "bucket 1 failed" in caplog.text  # tried once, then eager without retrying


@pytest.mark.parametrize("model", ["tiny-random", "tiny-hybrid"])
def test_start_up_captures_every_bucket_over_padded_rows_and_serving_captures_none(model):
    """Warm-up captures every decode bucket (as vLLM captures its sizes at start-up) over padded rows only: no KV
    written, no request's Mamba state touched (the scratch slot only). Serving then replays at every batch size
    without a capture, and gives the eager tokens."""
    from pdcluster.engine.warmup import warmup

    cfg = dict(max_num_seqs=10, num_kv_blocks=128, max_model_len=512)
    eager = _generate(make_engine(model, **cfg), graphs=False)
    engine = make_engine(model, **cfg)
    runner = engine.runner
    runner.use_decode_graphs(emulate=True)  # on a GPU the runner makes them before its warm-up
    graphs, pool = runner.graphs, runner.mamba_pool
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    states = [t.normal_().clone() for t in pool.conv + pool.ssm] if pool is not None else []
    kv = runner.kv_cache.clone()
    # What an earlier step left in the static buffers (warm-up's decode step stages real rows there).
    graphs.slot_mapping.fill_(3)
    graphs.seq_lens.fill_(5)
    graphs.block_tables.fill_(1)
    if pool is not None:
        graphs.state_slots.fill_(2)
    assert graphs.capture_all() == len(graphs.buckets) == 5  # 1, 2, 4, 8, 10
    assert torch.equal(runner.kv_cache, kv)
    if pool is not None:
        changed = {s for s in range(pool.num_slots)
                   if any(not torch.equal(t[s], b[s]) for t, b in zip(pool.conv + pool.ssm, states))}
        assert changed == {graphs.pad_state_slot}
    assert graphs.capture_all() == 0
    warmup(runner)  # the engine's own warm-up: every bucket is held already
    assert graphs.num_captures == 5
    graphed = _generate(engine, graphs=False)
    assert graphs.num_captures == 5 and graphs.num_replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_a_producers_warm_up_leaves_the_buckets_to_their_first_use(tiny_dir):
    """A prefill worker (its connector acts inside steps, sending layers mid-forward) never replays: its warm-up
    captures only the bucket of the warm-up's own decode step, not every bucket."""
    from pdcluster.engine.warmup import warmup
    from pdcluster.wire.kv_connector import KVConnector

    class Producer(KVConnector):
        def post_forward(self, finished_req_ids):
            return super().post_forward(finished_req_ids)

    engine = make_engine("tiny-random", max_num_seqs=10, num_kv_blocks=128)
    runner = engine.runner
    runner.use_decode_graphs(emulate=True)
    runner.connector = Producer()
    warmup(runner)
    assert runner.graphs.num_captures == 1 and list(runner.graphs._outputs) == [4]  # warm-up's 4 rows
    runner.connector = KVConnector()
    warmup(runner)
    assert runner.graphs.num_captures == 5
