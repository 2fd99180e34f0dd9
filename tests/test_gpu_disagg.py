"""Disaggregation on one GPU (issue 23): a prefill worker in its own process and a decode worker in
this one, both on CUDA, give the tokens a colocated engine on that GPU gives, and every decode block
comes back. Over ``cuda_ipc`` (the decode worker shares its cache by IPC handle, the prefill worker
writes the blocks in place) and over ``tcp`` (blocks staged through pinned host buffers), in fp32 and
in bf16 in deterministic mode (asked for: the prefill worker's chunking differs from the colocated
engine's, so only batch-invariant kernels keep the tokens equal in bf16; fp32 runs CUDA's default, the
fast mode).

Needs CUDA and pyzmq (the control plane), not Ray: the workers are plain objects and a spawned process.
The CPU twins of these checks are tests/test_cuda_ipc_transport.py and tests/test_kv_transfer_e2e.py.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time

import pytest
import torch

from conftest import engine_config, make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

CTX = mp.get_context("spawn")
NUM_KV_BLOCKS = 128
# (transport, dtype, the decode worker's async scheduling: it launches steps ahead of their finish)
CASES = [("cuda_ipc", "float32", False), ("tcp", "float32", False), ("cuda_ipc", "bfloat16", False),
         ("tcp", "bfloat16", False), ("cuda_ipc", "float32", True)]
_config = functools.partial(engine_config, device="cuda", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=1536)


def deterministic(dtype: str) -> bool:
    return dtype == "bfloat16"


def prefill_child(conn, transport: str, dtype: str) -> None:
    from pdcluster.kv_transfer.config import TransferConfig
    from pdcluster.prefill_node.worker import PrefillWorker

    p = PrefillWorker(f"p-{transport}", _config(dtype=dtype, prefill_chunk_size=8, deterministic=deterministic(dtype)),
                      TransferConfig(transport=transport, secret="k"))
    conn.send(p.address)
    time.sleep(600)


@pytest.fixture(params=CASES, ids=["-".join(c[:2]) + ("-async" if c[2] else "") for c in CASES])
def workers(request, tiny_dir):
    from pdcluster.decode_node.worker import DecodeWorker
    from pdcluster.kv_transfer.config import TransferConfig

    from test_kv_transfer_e2e import Events

    transport, dtype, async_scheduling = request.param
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=prefill_child, args=(child, transport, dtype), daemon=True)
    proc.start()
    d = None
    try:
        assert parent.poll(180), "prefill process did not start"
        address = parent.recv()
        d = DecodeWorker("d0", _config(dtype=dtype, prefill_chunk_size=64, deterministic=deterministic(dtype),
                                       async_scheduling=async_scheduling),
                         TransferConfig(transport=transport, secret="k"))
        d.on_event = events = Events()
        yield transport, dtype, address, d, events
    finally:
        if d is not None:
            d.close()
        proc.kill()
        proc.join(10)


def test_one_gpu_disagg_tokens_equal_colocated(workers):
    from pdcluster.engine.sampling_params import SamplingParams
    from test_kv_transfer_e2e import _collect_tokens

    transport, dtype, address, d, events = workers
    prompts = [list(range(300 + i, 300 + i + n)) for i, n in enumerate([3, 16, 17, 45, 100])]
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)
    colocated = make_engine("tiny-random", device="cuda", dtype=dtype, num_kv_blocks=NUM_KV_BLOCKS,
                            deterministic=deterministic(dtype))
    expected = [o.token_ids for o in colocated.generate(prompts, params)]
    del colocated
    assert d.connect_prefill(address) == f"p-{transport}"
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        d.submit(rid, prompt, params, f"p-{transport}")
    tokens = _collect_tokens(events, ids, timeout_s=120)
    assert [tokens[rid] for rid in ids] == expected
    deadline = time.monotonic() + 10
    while d.stats()["num_free_blocks"] != NUM_KV_BLOCKS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.stats()["num_free_blocks"] == NUM_KV_BLOCKS, d.stats()
    kv_ready = [e for e in events.items if type(e).__name__ == "KVReady"]
    assert kv_ready and all(e.transport == transport and e.num_bytes > 0 for e in kv_ready), kv_ready
    if d.engine.config.async_scheduling:  # launch-ahead on the GPU, prompts landing between steps
        assert d.stats()["num_steps_launched_ahead"] >= 5, d.stats()
