"""Structured output on the offline engine (real SmolLM2): every output parses and validates against its
schema, with and without n-gram speculation (sync and async scheduling), under preemption, and when a
request resumes from tokens produced elsewhere (the grammar is replayed, as after a recovery or on a
decode worker after the prefill worker's first token).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import make_engine
from pdcluster.engine.llm_engine import InvalidRequestError
from pdcluster.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
SPEC = json.dumps({"type": "json_schema", "schema": SCHEMA})
PROMPTS = [f"Person {i} as JSON, with name, age, city and tags:" for i in range(16)]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine("smollm2", num_kv_blocks=512)


def _check_valid(outs) -> None:
    for out in outs:
        assert out.finish_reason == "stop", f"not finished by the grammar: {out.text!r}"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_schema_outputs_validate(engine):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=80, temperature=0.8, seed=11, structured_output=SPEC))
    _check_valid(outs)
    free = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=30, temperature=0.8, seed=11))
    assert not any(o.text.startswith('{"name": ') for o in free), "the grammar made no difference"
    assert engine.scheduler.num_free_blocks == engine.kv_spec.num_blocks


@pytest.mark.parametrize("use_async", [pytest.param(False, marks=pytest.mark.slow), True])
def test_json_schema_under_ngram_speculation(smollm2_dir, engine, use_async):
    spec = make_engine("smollm2", num_kv_blocks=512, spec_method="ngram", num_spec_tokens=3,
                       async_scheduling=use_async)
    params = SamplingParams(max_tokens=80, structured_output=SPEC)  # greedy: lossless means token-exact
    outs = spec.generate(PROMPTS[:8], params)
    _check_valid(outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(PROMPTS[:8], params)]
    assert sum(o.num_accepted_tokens for o in outs) > 0, "no draft was accepted: speculation was not exercised"
    sampled = spec.generate(PROMPTS[:8], SamplingParams(max_tokens=80, temperature=1.0, seed=5, structured_output=SPEC))
    _check_valid(sampled)


@pytest.mark.slow
def test_json_schema_under_preemption(smollm2_dir, engine):
    params = SamplingParams(max_tokens=80, structured_output=SPEC)
    small = make_engine("smollm2", num_kv_blocks=12, max_model_len=256)  # 8 x ~4 blocks do not fit
    outs = small.generate(PROMPTS[:8], params)
    assert small.scheduler.num_preemptions_total > 0
    _check_valid(outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(PROMPTS[:8], params)]


def test_resumed_request_replays_its_grammar(engine):
    """A request resumed after k tokens (prompt + those tokens, output_position_offset k: what the router
    sends after a worker died mid-JSON) continues the same JSON, token for token."""
    params = SamplingParams(max_tokens=80, structured_output=SPEC)
    whole = engine.generate([PROMPTS[0]], params)[0]
    k = len(whole.token_ids) // 2
    resumed = engine.generate([whole.prompt_token_ids + whole.token_ids[:k]],
                              SamplingParams(max_tokens=80 - k, structured_output=SPEC, output_position_offset=k))[0]
    assert whole.token_ids[:k] + resumed.token_ids == whole.token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(whole.token_ids[:k] + resumed.token_ids)), SCHEMA)


def test_bad_specs_fail_the_request_clearly(engine):
    with pytest.raises(InvalidRequestError, match="structured_output"):
        engine.add_request("x", SamplingParams(structured_output='{"type": "json_schema", "schema": {"type": "strin"}}'))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_output=SPEC, ignore_eos=True)
    assert engine.has_unfinished() is False
