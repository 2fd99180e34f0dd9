"""vLLM's ``thinking_token_budget``: a thinking model writes at most that many tokens inside a thinking section
(after its start marker, ``<think>``), then is made to write the end marker (``</think>``) and answers.

Counting follows vLLM's: the tokens after the last start marker that no end marker closed, the prompt's included
(a template that opens ``<think>`` in the prompt, as DeepSeek-R1's, starts the count at the prompt's end). Once
the count reaches the budget every logit but the end marker's next token is masked, one token a position, until
the marker is whole; a model that ends its thinking earlier is left alone, and a section it opens again later is
counted afresh. A budget of 0 closes a section the prompt left open at the first output token.

The state is a function of the tokens alone (no per-request counters): the same row context that penalties
read (the prompt, and the outputs before this position, drafts of a verification step included) decides the
forced token, so speculative decoding stays lossless, a disaggregated pair's prefill and decode workers agree
on it without carrying state, and a request resumed elsewhere goes on where it was.

The cost is bounded: only the last ``budget + len(start) + len(end)`` output tokens are searched, because a
section longer than that was closed by force within it; the prompt's own state is found once per request.
"""

from __future__ import annotations


def last_index(tokens: list[int], marker: list[int]) -> int:
    """Where the last occurrence of ``marker`` starts in ``tokens`` (-1: none), searched at C speed."""
    if not marker or len(marker) > len(tokens):
        return -1
    rev, first = tokens[::-1], marker[-1]
    tail = marker[::-1]
    i = 0
    while True:
        try:
            i = rev.index(first, i)
        except ValueError:
            return -1
        if rev[i:i + len(tail)] == tail:
            return len(tokens) - i - len(marker)
        i += 1


def open_section_tokens(tokens: list[int], start: list[int], end: list[int]) -> int | None:
    """The tokens after the last start marker when no end marker follows it; None when no section is open."""
    at_start, at_end = last_index(tokens, start), last_index(tokens, end)
    if at_start < 0 or at_end > at_start:
        return None
    return len(tokens) - (at_start + len(start))


def _end_prefix_len(tokens: list[int], end: list[int]) -> int:
    """The longest proper prefix of ``end`` that ``tokens`` ends with: how much of the marker is written."""
    for k in range(min(len(end) - 1, len(tokens)), 0, -1):
        if tokens[len(tokens) - k:] == end[:k]:
            return k
    return 0


def forced_token(prompt: list[int], output: list[int], budget: int, start: list[int], end: list[int],
                 prompt_open: int | None) -> int | None:
    """The token the next output position must be (the end marker's next one), or None where the model is free.

    ``prompt_open``: :func:`open_section_tokens` of the prompt (computed once per request)."""
    window = budget + len(start) + len(end)
    if len(output) > window:
        # Any section opened before the window was closed (by force, at the latest) before it ends.
        seq = output[len(output) - window:]
        count = open_section_tokens(seq, start, end)
    else:
        # A marker may straddle the prompt's end: search the prompt's last few tokens with the outputs.
        keep = max(len(start), len(end)) - 1
        seq = (prompt[len(prompt) - keep:] if keep else []) + output
        at_start, at_end = last_index(seq, start), last_index(seq, end)
        if at_start >= 0 or at_end >= 0:
            count = None if at_end > at_start else len(seq) - (at_start + len(start))
        else:
            count = None if prompt_open is None else prompt_open + len(output)
    if count is None or count < budget:
        return None
    return end[_end_prefix_len(seq, end)]


def prompt_state(params, prompt: list[int]) -> int | None:
    """The prompt's open section (:func:`open_section_tokens`), kept on ``params`` (one object per request on
    a worker) so a long prompt is searched once, not at every step; keyed by the prompt's length."""
    cached = getattr(params, "_thinking_prompt", None)
    if cached is None or cached[0] != len(prompt):
        cached = (len(prompt), open_section_tokens(prompt, params.reasoning_start_token_ids,
                                                   params.reasoning_end_token_ids))
        params._thinking_prompt = cached  # not a dataclass field: never sent anywhere
    return cached[1]
