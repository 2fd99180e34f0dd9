"""Log-probabilities in OpenAI's layouts, built from the router's TokenLogprobs records
(engine/logprobs.py; raw log_softmax of the model's logits, see there).

- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``;
  ``top_logprobs`` holds the N most likely tokens, most likely first, plus the sampled token when it is
  not among them (OpenAI: "up to logprobs+1 elements"), so ``logprobs: 0`` shows the sampled token alone.
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  with exactly the N most likely tokens, most likely first.

As vLLM: a token's string is the token decoded on its own (special tokens spelled out; part of a
multi-byte character shows as U+FFFD), and -inf becomes -9999.0 (JSON has no infinity). As OpenAI, not
vLLM: ``bytes`` are the token's own bytes (Tokenizer.token_bytes), so the bytes of a choice's tokens
join into its text's UTF-8 even where a character spans tokens (vLLM gives the UTF-8 of the U+FFFD).
A position without a record (the first prompt token, which has no logprob) has logprob and
top_logprobs null.
- vLLM's ``prompt_logprobs``: one entry per prompt token, null for the first, else
  ``{token_id: {"logprob", "rank", "decoded_token"}}`` with the prompt token first (its rank in the
  distribution) and then the N most likely (ranks 1..N); a prompt token among those appears once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pdcluster.wire.logprobs import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenStrings:
    """A token id's string as shown in logprobs (decoded alone) and its bytes, cached: the same few
    thousand tokens come back in every top-k list."""

    def __init__(self, tokenizer):
        self._string = lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self._bytes = lru_cache(maxsize=1 << 16)(tokenizer.token_bytes)

    def __call__(self, token_id: int) -> str:
        return self._string(int(token_id))

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a fresh list: a response may be changed by its caller)."""
        return list(self._bytes(int(token_id)))


class TokenIdStrings:
    """vLLM's ``return_tokens_as_token_ids``: a token shown as ``token_id:<id>`` (a client that works in
    ids never has to map text back to tokens); its bytes stay the token's own (``strings``')."""

    def __init__(self, strings: TokenStrings):
        self.bytes = strings.bytes

    def __call__(self, token_id: int) -> str:
        return f"token_id:{int(token_id)}"


@dataclass
class Positions:
    """Tokens shown in one response or chunk: ids, their records (None: no logprob) and where each
    token's text starts in the choice's text (characters)."""

    token_ids: list[int]
    records: list[TokenLogprobs | None]
    text_offsets: list[int]

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.records) == len(self.text_offsets), \
            (len(self.token_ids), len(self.records), len(self.text_offsets))

    def __add__(self, other: Positions) -> Positions:
        return Positions(self.token_ids + other.token_ids, self.records + other.records,
                         self.text_offsets + other.text_offsets)

    def extend(self, other: Positions) -> None:
        self.token_ids += other.token_ids
        self.records += other.records
        self.text_offsets += other.text_offsets

    @staticmethod
    def empty() -> Positions:
        return Positions([], [], [])


def completion_logprobs(pos: Positions, num_top: int, strings: TokenStrings) -> dict:
    tokens, token_logprobs, top_logprobs = [], [], []
    for token_id, record in zip(pos.token_ids, pos.records):
        tokens.append(strings(token_id))
        if record is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(record.logprob))
        top = {strings(t): _finite(lp) for t, lp in zip(record.top_token_ids[:num_top], record.top_logprobs)}
        top.setdefault(strings(record.token_id), _finite(record.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": list(pos.text_offsets)}


def _chat_entry(token_id: int, logprob: float | None, strings: TokenStrings) -> dict:
    return {"token": strings(token_id), "logprob": None if logprob is None else _finite(logprob),
            "bytes": strings.bytes(token_id)}


def chat_logprobs(pos: Positions, num_top: int, strings: TokenStrings) -> dict:
    content = []
    for token_id, record in zip(pos.token_ids, pos.records):
        entry = _chat_entry(token_id, None if record is None else record.logprob, strings)
        entry["top_logprobs"] = [] if record is None else [
            _chat_entry(t, lp, strings) for t, lp in zip(record.top_token_ids[:num_top], record.top_logprobs)]
        content.append(entry)
    return {"content": content}


def vllm_prompt_logprobs(token_ids: list[int], records: list[TokenLogprobs], num_top: int,
                         strings: TokenStrings) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a prompt: ``records`` hold its tokens after the first (the engine may
    have computed more alternatives than ``num_top`` for echo: those are cut here)."""
    if len(records) != max(len(token_ids) - 1, 0):
        raise ValueError(f"prompt logprobs: {len(records)} records for a prompt of {len(token_ids)} tokens")
    out: list[dict | None] = [None] if token_ids else []
    for token_id, record in zip(token_ids[1:], records):
        if record.token_id != token_id:
            raise ValueError(f"prompt logprobs: a record of token {record.token_id} at a position of token {token_id}")
        entry = {token_id: _vllm_logprob(record.logprob, record.rank, token_id, strings)}
        for rank, (top_id, logprob) in enumerate(zip(record.top_token_ids[:num_top], record.top_logprobs), start=1):
            entry.setdefault(top_id, _vllm_logprob(logprob, rank, top_id, strings))
        out.append(entry)
    return out


def _vllm_logprob(logprob: float, rank: int, token_id: int, strings: TokenStrings) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": strings(token_id)}
