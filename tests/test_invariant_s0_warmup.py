"""S0 (docs/invariants.md; source report 000): warmup covers the prefill path.

Warmup's prefill batch has ``2 + num_spec_steps`` query tokens per request, strictly more than the
decode query length ``1 + num_spec_steps``; the classifier must call it prefill/mixed, and the decode
batch that follows uniform decode, for every num_spec_steps. Setting the warmup prompt length back to 2
makes ``num_spec_steps == 1`` fail here.
"""

import numpy as np
import pytest

from conftest import make_engine
from pdcluster.engine.batch_classifier import BatchKind, classify_batch
from pdcluster.engine.warmup import warmup, warmup_prompt_len


@pytest.fixture(scope="module")
def base_engine(tiny_dir):
    return make_engine("tiny-random", num_kv_blocks=64)


@pytest.mark.parametrize("num_spec_steps", [0, 1, 2, 3, 4])
def test_S0_warmup_prefill_then_uniform_decode(base_engine, num_spec_steps):
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.model_runner import ModelRunner

    spec = "none" if num_spec_steps == 0 else "ngram"
    config = EngineConfig(model="tiny-random", num_kv_blocks=64, spec_method=spec, num_spec_tokens=num_spec_steps).resolve_batch_limits("cpu")
    runner = ModelRunner(config, base_engine.model, base_engine.kv_cache, base_engine.max_model_len)
    kinds = warmup(runner)
    assert warmup_prompt_len(num_spec_steps) > 1 + num_spec_steps
    assert kinds == [BatchKind.PREFILL_OR_MIXED, BatchKind.UNIFORM_DECODE], (
        f"num_spec_steps={num_spec_steps}: warmup batches classified {kinds}"
    )
    assert runner.states.num_reqs == 0, "warmup requests must be retired"


def test_S0_engine_runs_warmup_at_start(base_engine):
    assert base_engine.warmup_batch_kinds == [BatchKind.PREFILL_OR_MIXED, BatchKind.UNIFORM_DECODE]


def test_S0_two_token_prefill_is_indistinguishable_from_decode_with_one_draft():
    # Why the length matters: the classifier sees only query lengths.
    assert classify_batch(np.array([2, 2, 2]), num_spec_steps=1) == BatchKind.UNIFORM_DECODE
    assert classify_batch(np.array([3, 3, 3]), num_spec_steps=1) == BatchKind.PREFILL_OR_MIXED
    assert classify_batch(np.array([2, 1]), num_spec_steps=0) == BatchKind.PREFILL_OR_MIXED
