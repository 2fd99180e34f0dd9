"""Structured output: grammar-constrained decoding on xgrammar (CPU).

A request's spec (a JSON string, see `check_spec`) is compiled once per engine by `GrammarCompiler`
into a grammar over the model's vocabulary; each request then keeps a `GrammarState` that masks the
logits of its next token (and of its speculative drafts) to the tokens the grammar allows.

xgrammar is imported on first use: it pulls in transformers, about a second of import time.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np
import torch

# Compact JSON (", " and ": ", no newlines): with free whitespace a small model can emit spaces or
# newlines for ever inside a still-valid prefix, and never close the object.
ANY_WHITESPACE = False
# Compiling takes milliseconds to seconds; the same few schemas come back again and again.
COMPILE_CACHE_SIZE = 64
# Compiling shares the worker's cores with the model's forward pass.
COMPILE_THREADS = 2
# Keywords xgrammar 0.2.8 silently ignores: output would not be guaranteed to validate.
_IGNORED_KEYWORDS = ("uniqueItems", "dependentRequired", "dependentSchemas")
# Keywords whose value maps names to subschemas (their keys are names, not keywords).
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords whose value is data, not a schema.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")


class StructuredOutputError(ValueError):
    """A structured-output spec is malformed or unsupported, or tokens do not fit the grammar."""


# ---------------------------------------------------------------------------------- specs


def _check_schema_keywords(schema, where: str) -> None:
    """Reject what xgrammar would accept but not enforce, so "valid against the schema" holds."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_schema_keywords(item, f"{where}[{i}]")
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _IGNORED_KEYWORDS and value not in (False, {}, []):
            raise StructuredOutputError(f"json_schema keyword {key!r} at {where} is not supported")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise StructuredOutputError(f"json_schema $ref {value!r} at {where}: only local refs ('#/...') work")
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                _check_schema_keywords(sub, f"{where}.{key}.{name}")
        else:
            _check_schema_keywords(value, f"{where}.{key}")


def _xgrammar_message(exc: Exception) -> str:
    # xgrammar's C++ errors read "[17:41:44] /project/cpp/file.cc:83: what went wrong\n".
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first_line)


def _to_grammar(spec_json: str):
    """The xgrammar Grammar for a spec (no tokenizer needed); StructuredOutputError if it has none."""
    import xgrammar as xgr

    try:
        spec = json.loads(spec_json)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StructuredOutputError(f"structured output spec is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise StructuredOutputError(f"structured output spec must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("type")
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ANY_WHITESPACE)
        if kind == "json_schema":
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise StructuredOutputError(
                    f'json_schema spec needs "schema": a JSON object, got {type(schema).__name__}')
            _check_schema_keywords(schema, "schema")
            # strict_mode: objects with listed properties get no others, arrays with listed items no
            # others (a subset of what the schema allows, and what callers of a schema want).
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=ANY_WHITESPACE, strict_mode=True)
        if kind == "regex":
            pattern = spec.get("pattern")
            if not isinstance(pattern, str):
                raise StructuredOutputError(f'regex spec needs "pattern": a string, got {type(pattern).__name__}')
            return xgr.Grammar.from_regex(pattern)
        if kind == "grammar":  # EBNF (GBNF) in xgrammar's dialect, from rule "root"
            grammar = spec.get("grammar")
            if not isinstance(grammar, str) or not grammar.strip():
                raise StructuredOutputError(f'grammar spec needs "grammar": EBNF text, got {type(grammar).__name__}')
            return xgr.Grammar.from_ebnf(grammar)
        if kind == "choice":  # exactly one of the strings
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError('choice spec needs "choices": a list of non-empty strings')
            # JSON string literals are valid EBNF string literals (escapes included).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
    except (RuntimeError, RecursionError) as exc:  # xgrammar's conversion errors are RuntimeErrors
        raise StructuredOutputError(f"{kind} spec cannot be compiled: {_xgrammar_message(exc)}") from None
    raise StructuredOutputError(f"unknown structured output type {kind!r}: use json_object, json_schema, regex, "
                                "grammar or choice")


def check_spec(spec_json: str) -> None:
    """Validate a spec without a tokenizer (the HTTP API answers 400 with the message). Specs:
    {"type": "json_object"}                    any JSON object
    {"type": "json_schema", "schema": {...}}   JSON valid against the schema
    {"type": "regex", "pattern": "..."}        text matching the regular expression
    {"type": "grammar", "grammar": "root ::= ..."}  text of the EBNF grammar (xgrammar's dialect)
    {"type": "choice", "choices": ["a", "b"]}  exactly one of the strings
    """
    _to_grammar(spec_json)


# ---------------------------------------------------------------------------------- vocabulary


def _vocab_metadata(tokenizer_json: dict):
    """(VocabType, add_prefix_space) from tokenizer.json, by the rules of xgrammar's own detection."""
    import xgrammar as xgr

    decoder = tokenizer_json.get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = [d.get("type") for d in decoders if isinstance(d, dict)]
    vocab_type = (xgr.VocabType.BYTE_LEVEL if "ByteLevel" in types
                  else xgr.VocabType.BYTE_FALLBACK if "ByteFallback" in types else xgr.VocabType.RAW)
    normalizer = tokenizer_json.get("normalizer") or {}
    normalizers = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    prepends_space = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in normalizers)
    pre = tokenizer_json.get("pre_tokenizer") or {}
    metaspace = pre.get("type") == "Metaspace" and pre.get("prepend_scheme") in ("always", "first")
    return vocab_type, prepends_space or metaspace


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's TokenizerInfo from a pdcluster Tokenizer, without transformers. `vocab_size` is the
    model's logits width: ids past the tokenizer's vocabulary are never allowed."""
    import xgrammar as xgr

    assert stop_token_ids and all(0 <= t < vocab_size for t in stop_token_ids), stop_token_ids
    raw = tokenizer._tok
    encoded_vocab = [""] * vocab_size  # "" marks a special token: xgrammar never allows it
    for token, token_id in raw.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    # Special tokens (<|im_start|> ...) would otherwise count as their literal text inside a JSON
    # string, and then vanish from the decoded output (skip_special_tokens).
    for token_id, added in raw.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size and token_id not in stop_token_ids:
            encoded_vocab[token_id] = ""
    vocab_type, add_prefix_space = _vocab_metadata(json.loads(raw.to_str()))
    return xgr.TokenizerInfo(encoded_vocab, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=add_prefix_space)


# ---------------------------------------------------------------------------------- compiling


class GrammarCompiler:
    """One per engine: compiles specs against the model's vocabulary, caching the last
    COMPILE_CACHE_SIZE by spec string. Thread-safe; a compiled grammar is shared by many requests."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # Off: the LRU below caches by spec string; xgrammar's cache would only keep second copies.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=COMPILE_THREADS,
                                             cache_enabled=False)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec_json: str):
        """The compiled grammar (xgrammar.CompiledGrammar) for a spec; StructuredOutputError if bad."""
        with self._lock:
            if spec_json in self._cache:
                self._cache.move_to_end(spec_json)
                return self._cache[spec_json]
        # Compiled outside the lock: a long schema must not hold up the others (a rare duplicate
        # compile of the same spec is harmless).
        compiled = self._compiler.compile_grammar(_to_grammar(spec_json))
        with self._lock:
            self._cache[spec_json] = compiled
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


# ---------------------------------------------------------------------------------- per request


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [R, ceil(V/32)] (bit j%32 of word j//32 = token j) -> bool [R, V]."""
    as_bytes = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)  # bytes in token order
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).view(torch.bool)


class GrammarState:
    """One request's matcher: the grammar state after its output so far. Not thread-safe."""

    def __init__(self, compiled):
        import xgrammar as xgr

        # Rollback is unlimited in xgrammar >= 0.2 (any number of speculative tokens can be undone).
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request must end here."""
        return self._matcher.is_terminated()

    def accept(self, token_ids: list[int]) -> int:
        """Advance through `token_ids`; how many were accepted (stops at the first refused one)."""
        for num_accepted, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(int(token_id)):
                return num_accepted
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts, a stop token too)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def replay(self, token_ids: list[int]) -> None:
        """Rebuild the state from the start for tokens generated elsewhere (a resumed request, or a
        first token sampled on a prefill worker)."""
        self._matcher.reset()
        num_accepted = self.accept(token_ids)
        if num_accepted < len(token_ids):
            raise StructuredOutputError(
                f"token {token_ids[num_accepted]} at output position {num_accepted} does not fit the grammar")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft_token_ids=()) -> None:
        """Fill bitmask rows row .. row+len(drafts): the tokens allowed now, then after each draft.
        Rows after a refused draft, or after a stop token, are left as they are (all allowed when
        freshly allocated): they are never used. The state is left as it was."""
        num_accepted = 0
        try:
            if not self._matcher.is_terminated():  # a terminated matcher has no next token
                self._matcher.fill_next_token_bitmask(bitmask, row)
            for i, token_id in enumerate(draft_token_ids):
                if not self._matcher.accept_token(int(token_id)):
                    break
                num_accepted += 1
                if self._matcher.is_terminated():
                    break
                self._matcher.fill_next_token_bitmask(bitmask, row + i + 1)
        finally:
            self.rollback(num_accepted)

    def allowed_mask(self, draft_token_ids=()) -> torch.Tensor:
        """bool [1 + len(drafts), vocab_size]: row i = tokens allowed after drafts[:i] are accepted."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1 + len(draft_token_ids), self.vocab_size)
        self.fill_bitmask(bitmask, 0, draft_token_ids)
        return unpack_bitmask(bitmask, self.vocab_size)

    def apply(self, logits: torch.Tensor, draft_token_ids=()) -> None:
        """In place: logits [1 + len(drafts), vocab_size] of disallowed tokens become -inf."""
        apply_masks(logits, [self], [list(draft_token_ids)])


def apply_masks(logits: torch.Tensor, states: list[GrammarState | None], draft_token_ids=None) -> None:
    """Mask a batch in place with one bitmask: request k owns 1 + len(draft_token_ids[k]) consecutive
    rows of `logits` [R, V], in order; rows of a request whose state is None are left untouched."""
    import xgrammar as xgr

    drafts = draft_token_ids if draft_token_ids is not None else [()] * len(states)
    assert logits.shape[0] == sum(1 + len(d) for d in drafts), (logits.shape, drafts)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    rows: list[int] = []
    row = 0
    for state, request_drafts in zip(states, drafts, strict=True):
        if state is not None:
            assert state.vocab_size == logits.shape[-1], (state.vocab_size, logits.shape)
            state.fill_bitmask(bitmask, row, request_drafts)
            rows += range(row, row + 1 + len(request_drafts))
        row += 1 + len(request_drafts)
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
