"""Pooling requests through a real prefill and decode worker over tcp (test_classify.py, test_bert.py): the decode
worker asks the prefill worker for each prompt's vector alone; no KV may move."""

from __future__ import annotations

import numpy as np

from pdcluster.engine.sampling_params import SamplingParams


def pooled_over_tcp(cfg, prompts: list[list[int]], params: SamplingParams) -> list[np.ndarray]:
    """Each prompt's pooled vector as the decode worker's final event carries it. Asserts that no KVReady was sent,
    the prefill worker sent no byte, the decode worker computed no prompt token and kept no block, and the prefill
    worker's blocks are all free after."""
    from pdcluster.engine.pooling import pooled_vector
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.node.events import KVReady, Tokens
    from test_kv_transfer_e2e import Events, _collect_tokens, _wait_free, connected_pair

    events = Events()
    with connected_pair(cfg, TransferConfig(transport="tcp", secret="s3cret"), events) as (p, d):
        ids = [f"pool{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            d.submit(rid, prompt, params, "p0")
        _collect_tokens(events, ids)
        with events.lock:
            finals = {e.request_id: e for e in events.items if isinstance(e, Tokens) and e.finished}
            assert not [e for e in events.items if isinstance(e, KVReady)]
        assert p.stats()["bytes_sent"] == 0
        dst = d.stats()
        assert dst["num_prompt_tokens_computed"] == 0 and dst["num_free_blocks"] == dst["num_blocks"]
        _wait_free(p, p.stats()["num_blocks"], 5)
        return [pooled_vector(finals[rid].pooled) for rid in ids]
