"""A choice's text and the tokens it shows, kept aligned: what a stream chunk's logprobs describe.

engine/tokenizer.py's Detokenizer holds text back (half a UTF-8 character, a tail that may begin a stop
string) and cuts it at a stop string. With logprobs the API must also say which tokens a piece of text
belongs to. The rule here: a token is released once all of its text has been released (its end offset
is at most the characters sent); a token that ends inside a UTF-8 character goes with the token that
completes it; at the end every remaining token goes with the last piece. When a stop string cuts the
text, the tokens that start at or after the cut are dropped (their text is not shown) and a token that
straddles the cut is kept (part of its text is shown).

Offsets are where each token's text ends in the Detokenizer's text (its ``token_ends`` and
``token_complete``, kept as it decodes incrementally).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.cluster.api.logprobs import Positions
from pdcluster.wire.logprobs import TokenLogprobs
from pdcluster.engine.tokenizer import Detokenizer

PROMPT_DECODE_WINDOW = 6  # tokens of left context when measuring a prompt token's text


@dataclass
class Piece:
    """New text and the tokens whose text it completes (``positions`` is None without logprobs)."""

    text: str
    positions: Positions | None


class AlignedText:
    """One choice's output: ``add`` returns the text now safe to show and the tokens it completes."""

    def __init__(self, tokenizer, stops: list[str], track_tokens: bool, base_offset: int = 0,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer, self.track_tokens, self.base_offset = tokenizer, track_tokens, base_offset
        self.detok = Detokenizer(tokenizer, stops, skip_special_tokens, include_stop)
        # Per output token (the Detokenizer's): characters of output text up to and including it, and
        # whether its text ends on a character boundary.
        self._ends, self._complete = self.detok.token_ends, self.detok.token_complete
        self._records: list[TokenLogprobs | None] = []
        self._num_released = 0

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def hit_stop(self) -> bool:
        return self.detok.hit_stop

    def add(self, token_ids: list[int], records: list[TokenLogprobs], final: bool) -> Piece:
        if self.detok.hit_stop:  # the text ended at a stop string: later tokens are not shown
            return Piece("", Positions.empty() if self.track_tokens else None)
        if self.track_tokens:
            # A router that sent no records (or too few) leaves those tokens without a logprob.
            self._records += list(records[: len(token_ids)]) + [None] * (len(token_ids) - len(records))
        text = self.detok.add(token_ids, final)
        if not self.track_tokens:
            return Piece(text, None)
        if self.detok.hit_stop:
            cut = len(self.detok.text)
            keep = self._num_released
            while keep < len(self._ends) and self._start(keep) < cut:
                keep += 1
            return Piece(text, self._release(keep, drop_rest=True))
        if final:
            return Piece(text, self._release(len(self._ends)))
        upto, i = self._num_released, self._num_released
        while i < len(self._ends) and self._ends[i] <= self.detok.num_sent:
            i += 1
            if self._complete[i - 1]:
                upto = i
        return Piece(text, self._release(upto))

    def _start(self, i: int) -> int:
        return self._ends[i - 1] if i > 0 else 0

    def _release(self, upto: int, drop_rest: bool = False) -> Positions:
        lo = self._num_released
        ids = self.detok.token_ids[lo:upto]
        offsets = [self.base_offset + self._start(i) for i in range(lo, upto)]
        released = Positions(ids, self._records[lo:upto], offsets)
        self._num_released = len(self._ends) if drop_rest else upto
        return released


def prompt_positions(tokenizer, token_ids: list[int], records: list[TokenLogprobs] | None) -> Positions:
    """The prompt's tokens for echo: the first has no logprob; ``records`` cover the others (None or too
    few: those have none either). Offsets from each token's text in a short left context (the prompt can
    be long: decoding every prefix would be quadratic)."""
    records = list(records or [])
    recs: list[TokenLogprobs | None] = [None] + records[: len(token_ids) - 1]
    recs += [None] * (len(token_ids) - len(recs))
    offsets, at = [], 0
    for i in range(len(token_ids)):
        offsets.append(at)
        lo = max(0, i - PROMPT_DECODE_WINDOW)
        before = tokenizer.decode(token_ids[lo:i])
        with_token = tokenizer.decode(token_ids[lo:i + 1])
        at += max(len(with_token) - len(before), 0)
    return Positions(list(token_ids), recs, offsets)
