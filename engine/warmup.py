"""Warmup: one prefill step, then one decode step, through the real runner (invariant S0); then, with CUDA
graphs, the capture of every decode bucket (engine/cuda_graphs.py) unless the engine is a KV producer (a
prefill worker sends layers mid-forward: its steps never replay).

The prefill batch uses ``2 + num_spec_steps`` prompt tokens per request: strictly longer than the
decode query length ``1 + num_spec_steps``, so the batch classifier labels it prefill/mixed and the
prefill path is exercised. With the old fixed length of 2, a batch with ``num_spec_steps == 1`` has the
decode query length and is taken for uniform decode (invariant S0, docs/invariants.md). The decode step then feeds one sampled
token plus ``num_spec_steps`` dummy drafts per request.
"""

from __future__ import annotations

from pdcluster.engine.batch_classifier import BatchKind
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler_output import ScheduledRequest, SchedulerOutput


def warmup_prompt_len(num_spec_steps: int) -> int:
    return 2 + num_spec_steps


def warmup(runner, max_num_reqs: int = 4, num_blocks: int | None = None) -> list[BatchKind]:
    """Run the two warmup steps; returns the batch kinds the runner saw (prefill step, decode step)."""
    k = runner.num_spec_steps
    prompt_len = warmup_prompt_len(k)
    block_size = runner.block_size
    # A hybrid producer packs each finished prompt's Mamba state into the blocks after the prompt's.
    blocks_per_req = max(-(-(prompt_len + 1 + k) // block_size), -(-prompt_len // block_size) + runner.num_state_blocks_out)
    pool = num_blocks if num_blocks is not None else runner.kv_cache.shape[2]
    num_reqs = max(1, min(max_num_reqs, runner.config.max_num_seqs, pool // blocks_per_req))
    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    req_ids = [f"__warmup_{i}" for i in range(num_reqs)]
    tables = [list(range(i * blocks_per_req, (i + 1) * blocks_per_req)) for i in range(num_reqs)]
    prompt = list(range(prompt_len))

    prefill = SchedulerOutput(
        scheduled=[
            ScheduledRequest(
                request_id=rid, is_new=True, num_computed_tokens=0, num_scheduled_tokens=prompt_len,
                input_token_ids=prompt, block_ids=table, num_prompt_tokens=prompt_len, num_tokens=prompt_len,
                spec_token_ids=[], all_token_ids=prompt, sampling_params=params,
            )
            for rid, table in zip(req_ids, tables)
        ],
        total_num_scheduled_tokens=num_reqs * prompt_len,
    )
    kinds = []
    runner.execute_model(prefill)
    kinds.append(runner.last_batch_kind)
    out, _ = runner.sample_tokens()
    drafts = [0] * k
    decode = SchedulerOutput(
        scheduled=[
            ScheduledRequest(
                request_id=rid, is_new=False, num_computed_tokens=prompt_len, num_scheduled_tokens=1 + k,
                input_token_ids=[tokens[0]] + drafts, block_ids=table, num_prompt_tokens=prompt_len,
                num_tokens=prompt_len + 1, spec_token_ids=drafts, num_output_tokens=1,
            )
            for rid, table, tokens in zip(req_ids, tables, out.sampled_token_ids)
        ],
        total_num_scheduled_tokens=num_reqs * (1 + k),
    )
    runner.execute_model(decode)
    kinds.append(runner.last_batch_kind)
    runner.sample_tokens()
    # An empty step that retires the dummy requests (runner state and connector both see them finish).
    runner.execute_model(SchedulerOutput(scheduled=[], total_num_scheduled_tokens=0, finished_req_ids=set(req_ids)))
    runner.sample_tokens()
    if runner.graphs is not None and runner.config.cuda_graph_capture_at_start and not runner.connector.has_step_hooks:
        runner.graphs.capture_all()
    return kinds
