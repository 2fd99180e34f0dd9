"""Prompts given as embeddings on a GPU (engine/prompt_embeds.py; the rest in tests/test_prompt_embeds.py). Its own
module, importing the engine alone: bench/gpu_check.py runs every gpu-marked module on the GPU machine, which has no
serving packages (FastAPI, openai) for the other module's served tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import engine_config
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.prompt_embeds import prompt_embeds_from_pieces
from pdcluster.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_prompt_steps_run_eagerly_and_decode_replays_graphs(tiny_dir):
    """On a GPU: each prompt's table rows, whole or between its ids, give the tokens of its ids on the same GPU; the
    steps holding rows run eagerly and the decode steps replay the CUDA graphs."""
    gpu = LLMEngine.from_config(engine_config(enable_prompt_embeds=True, device="cuda"), progress=False)
    table = gpu.model.embed_tokens.float().cpu()
    ids = [gpu.tokenize(t) for t in TEXTS]
    want = [o.token_ids for o in gpu.generate(ids, PARAMS)]
    assert [o.token_ids for o in gpu.generate([{"prompt_embeds": table[i]} for i in ids], PARAMS)] == want
    between = [dataclasses.replace(PARAMS, prompt_embeds=prompt_embeds_from_pieces([table[i[1:3]]], [1], ["b"]))
               for i in ids]
    got = [o.token_ids for o in gpu.generate([i[:1] + [0, 0] + i[3:] for i in ids], between)]
    assert got == want
    assert gpu.runner.graphs is not None and gpu.runner.graphs.num_replays > 0
