"""Structured output on the real SmolLM2 vocabulary: random walks under the mask give JSON that
validates, drafts / rollback / replay agree with accepting one token at a time, bad specs say why."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdcluster.engine import structured_output as so
from pdcluster.engine.structured_output import (
    GrammarCompiler,
    GrammarState,
    StructuredOutputError,
    apply_masks,
    check_spec,
)

VOCAB_SIZE = 49152  # SmolLM2's config.json vocab_size (= its tokenizer's)
MAX_STEPS = 200

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "owner": {
            "type": "object",
            "properties": {"login": {"type": "string", "maxLength": 12}, "admin": {"type": "boolean"}},
            "required": ["login", "admin"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["id", "owner"],
    "additionalProperties": False,
}
POINTS = {
    "type": "object",
    "properties": {
        "points": {
            "type": "array",
            "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "kind": {"anyOf": [{"type": "null"}, {"const": "point"}]},
    },
    "required": ["points", "label", "kind"],
}
JSON_OBJECT = '{"type": "json_object"}'


def schema_spec(schema: dict) -> str:
    return json.dumps({"type": "json_schema", "schema": schema})


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from pdcluster.engine.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB_SIZE, list(tokenizer.stop_token_ids))


@pytest.fixture(scope="module")
def closers(tokenizer):
    """1.0 on tokens made only of '"', '}' and ']', and on stop tokens: a walk biased towards them
    more and more closes every string, array and object within MAX_STEPS."""
    bias = torch.zeros(VOCAB_SIZE)
    for token_id in range(VOCAB_SIZE):
        text = tokenizer.id_to_token(token_id)
        if text and set(text) <= set('"}]'):
            bias[token_id] = 1.0
    bias[list(tokenizer.stop_token_ids)] = 1.0
    return bias


def random_walk(compiler, closers, spec: str, seed: int):
    """Seeded random logits, masked, argmax, accept, until terminated: (token ids, masks before each)."""
    state = GrammarState(compiler.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for step in range(MAX_STEPS):
        logits = torch.randn(1, VOCAB_SIZE, generator=generator) * 2 + closers * step * 0.1
        masks.append(state.allowed_mask()[0])
        state.apply(logits)
        token_id = int(logits.argmax())
        assert masks[-1][token_id]
        assert state.accept([token_id]) == 1, f"the mask allowed token {token_id} but accept refused it"
        ids.append(token_id)
        if state.is_terminated:
            return ids, masks
    raise AssertionError(f"walk did not terminate in {MAX_STEPS} tokens")


def walk_text(tokenizer, ids):
    assert ids[-1] in tokenizer.stop_token_ids
    return tokenizer.decode(ids)


# ---------------------------------------------------------------------------------- random walks


@pytest.mark.parametrize("schema", [PERSON, NESTED, POINTS], ids=["person", "nested", "points"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_walk_validates_against_schema(compiler, closers, tokenizer, schema, seed):
    ids, _ = random_walk(compiler, closers, schema_spec(schema), seed)
    value = json.loads(walk_text(tokenizer, ids))
    jsonschema.validate(value, schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_json_object_is_an_object(compiler, closers, tokenizer, seed):
    ids, _ = random_walk(compiler, closers, JSON_OBJECT, seed)
    assert isinstance(json.loads(walk_text(tokenizer, ids)), dict)


def test_random_walk_regex(compiler, closers, tokenizer):
    pattern = "[a-z]{2,5}-[0-9]{3}"
    ids, _ = random_walk(compiler, closers, json.dumps({"type": "regex", "pattern": pattern}), seed=0)
    assert re.fullmatch(pattern, walk_text(tokenizer, ids))


def test_stop_token_is_allowed_exactly_when_the_json_is_complete(compiler, closers, tokenizer):
    ids, masks = random_walk(compiler, closers, JSON_OBJECT, seed=3)
    for n, mask in enumerate(masks):
        try:
            complete = isinstance(json.loads(tokenizer.decode(ids[:n])), dict)
        except json.JSONDecodeError:
            complete = False
        for stop_id in tokenizer.stop_token_ids:
            assert bool(mask[stop_id]) == complete, (n, tokenizer.decode(ids[:n]))
    assert sum(bool(m[tokenizer.stop_token_ids[0]]) for m in masks) == 1  # only before the final token


def test_terminated_after_the_stop_token_only(compiler, tokenizer):
    state = GrammarState(compiler.compile(JSON_OBJECT))
    ids = tokenizer.encode('{"a": 1}')
    assert state.accept([tokenizer.eos_token_id]) == 0  # not complete yet
    assert state.accept(ids) == len(ids)
    assert not state.is_terminated
    assert state.accept([tokenizer.eos_token_id]) == 1
    assert state.is_terminated
    assert state.accept(tokenizer.encode("{")) == 0  # nothing after the stop token


def test_first_mask_allows_only_an_opening_brace(compiler, tokenizer):
    mask = GrammarState(compiler.compile(JSON_OBJECT)).allowed_mask()[0]
    allowed = mask.nonzero().flatten().tolist()
    assert 0 < len(allowed) < 100
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed)


def test_special_tokens_are_never_allowed_even_inside_a_string(compiler, tokenizer):
    state = GrammarState(compiler.compile(JSON_OBJECT))
    prefix = tokenizer.encode('{"a": "x')
    assert state.accept(prefix) == len(prefix)
    mask = state.allowed_mask()[0]
    assert mask[tokenizer.encode("hello")[0]]  # inside a string almost anything goes ...
    assert not mask[tokenizer.token_to_id("<|im_start|>")]  # ... but not a special token
    assert not mask[list(tokenizer.stop_token_ids)].any()  # nor a stop: the JSON is not complete


# ---------------------------------------------------------------------------------- drafts, rollback, replay


@pytest.fixture(scope="module")
def person_walk(compiler, closers):
    ids, _ = random_walk(compiler, closers, schema_spec(PERSON), seed=5)
    assert len(ids) > 12
    return compiler.compile(schema_spec(PERSON)), ids


def one_by_one_masks(compiled, prefix, drafts):
    """Masks after prefix, prefix+drafts[:1], ... by accepting one token at a time (all True after a stop)."""
    state = GrammarState(compiled)
    assert state.accept(prefix) == len(prefix)
    rows = [state.allowed_mask()[0]]
    for token_id in drafts:
        assert state.accept([token_id]) == 1
        rows.append(torch.ones(VOCAB_SIZE, dtype=torch.bool) if state.is_terminated else state.allowed_mask()[0])
    return torch.stack(rows)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_draft_masks_equal_accepting_one_by_one(person_walk, where):
    compiled, ids = person_walk
    k = {"start": 0, "middle": len(ids) // 2, "end": len(ids) - 3}[where]  # "end": drafts reach the stop
    drafts = ids[k : k + 4]
    state = GrammarState(compiled)
    state.accept(ids[:k])
    before = state.allowed_mask()[0]
    got = state.allowed_mask(drafts)
    assert got.shape == (1 + len(drafts), VOCAB_SIZE)
    assert torch.equal(got, one_by_one_masks(compiled, ids[:k], drafts))
    # The state is as it was: same mask, and the drafts can still be accepted from here.
    assert torch.equal(state.allowed_mask()[0], before)
    assert not state.is_terminated
    assert state.accept(drafts) == len(drafts)


def test_rows_after_a_refused_draft_are_all_true(person_walk):
    compiled, ids = person_walk
    k = 3
    state = GrammarState(compiled)
    state.accept(ids[:k])
    reference = one_by_one_masks(compiled, ids[:k], ids[k : k + 1])
    bad = int((~reference[1]).nonzero()[0])  # a token the grammar refuses after ids[k]
    drafts = [ids[k], bad, ids[k + 1], ids[k + 2]]
    got = state.allowed_mask(drafts)
    assert torch.equal(got[:2], reference)
    assert not got[1].all()  # a real mask, so the all-True rows below mean something
    assert got[2:].all()
    assert torch.equal(state.allowed_mask()[0], reference[0])


def test_rollback_restores_the_mask(person_walk):
    compiled, ids = person_walk
    assert len(ids) > 17
    state = GrammarState(compiled)
    state.accept(ids[:-17])
    before = state.allowed_mask()[0]
    assert state.accept(ids[-17:-1]) == 16  # as many as a speculative step may reject
    assert state.allowed_mask()[0].sum() == 2  # the JSON is complete: only the two stop tokens
    state.rollback(16)
    assert torch.equal(state.allowed_mask()[0], before)


def test_rollback_undoes_the_stop_token(person_walk):
    compiled, ids = person_walk
    state = GrammarState(compiled)
    state.accept(ids[:-1])
    before_stop = state.allowed_mask()[0]
    state.accept(ids[-1:])
    assert state.is_terminated
    state.rollback(1)
    assert not state.is_terminated
    assert torch.equal(state.allowed_mask()[0], before_stop)


def test_replay_equals_accepting_one_by_one(person_walk):
    compiled, ids = person_walk
    stepped = GrammarState(compiled)
    replayed = GrammarState(compiled)
    replayed.accept(ids[:7])  # replay starts over, whatever the state had
    for k in range(len(ids)):
        replayed.replay(ids[:k])
        assert torch.equal(replayed.allowed_mask()[0], stepped.allowed_mask()[0]), k
        stepped.accept(ids[k : k + 1])
    replayed.replay(ids)
    assert replayed.is_terminated


def test_replay_of_a_refused_token_raises(person_walk):
    compiled, ids = person_walk
    state = GrammarState(compiled)
    bad = int((~one_by_one_masks(compiled, ids[:2], [])[0]).nonzero()[0])
    with pytest.raises(StructuredOutputError, match=f"token {bad} at output position 2"):
        state.replay(ids[:2] + [bad])


# ---------------------------------------------------------------------------------- apply


def test_apply_sets_exactly_the_disallowed_logits_to_minus_inf(person_walk):
    compiled, ids = person_walk
    state = GrammarState(compiled)
    state.accept(ids[:5])
    drafts = ids[5:8]
    logits = torch.randn(1 + len(drafts), VOCAB_SIZE)
    original = logits.clone()
    state.apply(logits, drafts)
    allowed = state.allowed_mask(drafts)
    assert torch.equal(torch.isinf(logits), ~allowed)
    assert torch.equal(logits[allowed], original[allowed])


def test_apply_masks_batches_rows_and_skips_unconstrained_requests(person_walk, compiler):
    compiled, ids = person_walk
    a, b = GrammarState(compiled), GrammarState(compiler.compile(JSON_OBJECT))
    a.accept(ids[:5])
    drafts = [ids[5:7], [1, 2, 3], []]
    logits = torch.randn(3 + 2 + 3 + 0, VOCAB_SIZE)
    original = logits.clone()
    apply_masks(logits, [a, None, b], drafts)
    assert torch.equal(torch.isinf(logits[:3]), ~a.allowed_mask(drafts[0]))
    assert torch.equal(logits[3:7], original[3:7])
    assert torch.equal(torch.isinf(logits[7:]), ~b.allowed_mask())


def test_padded_vocab_ids_are_never_allowed(tokenizer):
    padded = GrammarCompiler(tokenizer, VOCAB_SIZE + 100, list(tokenizer.stop_token_ids))
    state = GrammarState(padded.compile(JSON_OBJECT))
    state.accept(tokenizer.encode('{"a": "x'))  # inside a string, where nearly everything is allowed
    mask = state.allowed_mask()
    assert mask.shape == (1, VOCAB_SIZE + 100)
    assert mask[0, :VOCAB_SIZE].sum() > 40000
    assert not mask[0, VOCAB_SIZE:].any()


# ---------------------------------------------------------------------------------- vocabulary


def test_tokenizer_info_matches_xgrammar_from_huggingface(compiler, tokenizer, smollm2_dir):
    import transformers
    import xgrammar as xgr

    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    reference = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE,
                                                   stop_token_ids=list(tokenizer.stop_token_ids))
    ours = compiler.tokenizer_info
    assert (ours.vocab_type, ours.add_prefix_space, ours.vocab_size) == (
        reference.vocab_type, reference.add_prefix_space, reference.vocab_size)
    assert sorted(ours.stop_token_ids) == sorted(reference.stop_token_ids)
    # The one intended difference: special tokens that are not stops are blanked (never allowed).
    specials = [i for i, t in tokenizer._tok.get_added_tokens_decoder().items()
                if t.special and i not in tokenizer.stop_token_ids]
    assert sorted(ours.special_token_ids) == sorted(specials)
    ours_vocab, reference_vocab = ours.decoded_vocab, reference.decoded_vocab
    assert all(ours_vocab[i] == reference_vocab[i] for i in range(VOCAB_SIZE) if i not in specials)


LLAMA2_LIKE = {
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ]},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]},
}
METASPACE = {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
             "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}}


@pytest.mark.parametrize("tokenizer_json",
                         [LLAMA2_LIKE, METASPACE, {"decoder": None}, {"decoder": {"type": "ByteLevel"}}],
                         ids=["llama2", "metaspace", "raw", "byte_level"])
def test_vocab_metadata_agrees_with_xgrammar_detection(tokenizer_json):
    import xgrammar as xgr

    expected = xgr.TokenizerInfo._detect_metadata_from_hf(json.dumps(tokenizer_json))
    assert so._vocab_metadata(tokenizer_json) == (expected["vocab_type"], expected["add_prefix_space"])


# ---------------------------------------------------------------------------------- specs and compiling


@pytest.mark.parametrize("spec, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"type": "yaml"}', "unknown structured output type 'yaml'"),
    ('{"type": "json_schema"}', 'needs "schema": a JSON object, got NoneType'),
    ('{"type": "json_schema", "schema": "string"}', 'needs "schema": a JSON object, got str'),
    ('{"type": "json_schema", "schema": [1]}', 'needs "schema": a JSON object, got list'),
    ('{"type": "regex"}', 'needs "pattern": a string'),
    (schema_spec({"type": "strin"}), 'Unsupported type "strin"'),
    (schema_spec({"type": "integer", "minimum": 10, "maximum": 5}), "minimum greater than maximum"),
    (schema_spec({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}),
     "'uniqueItems' at schema.properties.tags is not supported"),
    (schema_spec({"type": "object", "dependentRequired": {"a": ["b"]}}), "'dependentRequired' at schema"),
    (schema_spec({"$ref": "https://example.com/person.json"}), "only local refs"),
    (json.dumps({"type": "regex", "pattern": "[a-"}), "regex spec cannot be compiled"),
])
def test_check_spec_rejects_with_a_clear_one_line_message(spec, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)) as info:
        check_spec(spec)
    assert "\n" not in str(info.value) and ".cc:" not in str(info.value)


@pytest.mark.parametrize("spec", [
    JSON_OBJECT,
    schema_spec(PERSON),
    schema_spec(NESTED),
    schema_spec(POINTS),
    schema_spec({"type": "object", "properties": {"uniqueItems": {"type": "boolean"}}}),  # a name, not a keyword
    schema_spec({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}),
    schema_spec({"$defs": {"p": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}}),
    json.dumps({"type": "regex", "pattern": "[a-z]+@[a-z]+\\.com"}),
])
def test_check_spec_accepts_good_specs(spec):
    check_spec(spec)


def test_compile_caches_by_spec_and_evicts_the_least_recent(compiler, monkeypatch):
    monkeypatch.setattr(so, "COMPILE_CACHE_SIZE", 2)
    specs = [schema_spec({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}) for i in range(3)]
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # now the most recent: specs[1] goes when specs[2] comes
    compiler.compile(specs[2])
    assert compiler.compile(specs[0]) is first
    assert list(compiler._cache) == [specs[2], specs[0]]


def test_compile_raises_structured_output_error(compiler):
    with pytest.raises(StructuredOutputError, match="unknown structured output type"):
        compiler.compile('{"type": "xml"}')
