"""``--dataset sharegpt-multiturn``: ShareGPT conversations replayed turn by turn.

Each conversation is a chain of requests: turn k's prompt is the whole history so far (every earlier
user message and the recorded assistant answer) plus the next user message, sent as token ids built by
concatenation, so turn k-1's prompt is an exact token prefix of turn k's (what a prefix cache can
reuse, as in a chat client that resends the conversation). The recorded answers, not the model's, make
the history: every server gets the same prompts, and two runs are comparable request by request.
A conversation sends its next turn when the previous answer has ended plus a think time; conversations
start on the arrival schedule (``--request-rate`` counts conversations), at most ``max_concurrency``
at once.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from pdcluster.tools.loadtest.client import RequestRecord, Target, send_request
from pdcluster.tools.loadtest.datasets import (DatasetError, DatasetOptions, SampleRequest, _shuffled,
                                               load_requests, load_sharegpt_conversations)
from pdcluster.tools.loadtest.runner import RunOutcome, http_client

NAME = "sharegpt-multiturn"
MAX_TURNS = 12  # user turns per conversation, at most
MAX_MESSAGE_TOKENS = 128  # a longer user message or recorded answer is cut (keeps the working set sized)
MIN_TURNS = 4  # long enough that most of a prompt is history (about 30% of prompt tokens are new)
DEFAULT_TURN_OUTPUT_LEN = 32
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass
class Conversation:
    turns: list[SampleRequest]  # in order; turns[k].prompt starts with turns[k-1].prompt

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.prompt_len for t in self.turns)


def _segment_ids(tokenizer, role: str, text: str) -> list[int]:
    """One message as the model's chat format writes it (ChatML when the tokenizer knows it)."""
    ids = tokenizer.encode(text)[:MAX_MESSAGE_TOKENS]
    text = tokenizer.decode(ids)
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    return tokenizer.encode(f"{role.capitalize()}: {text}\n")


def _generation_prompt_ids(tokenizer) -> list[int]:
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return tokenizer.encode("<|im_start|>assistant\n")
    return tokenizer.encode("Assistant:")


def load_conversations(options: DatasetOptions, tokenizer) -> list[Conversation]:
    """``options.num_prompts`` conversations of MIN_TURNS to MAX_TURNS user turns that fit the context."""
    if tokenizer is None:
        raise DatasetError(f"--dataset {NAME} sends token ids: it needs the model's tokenizer (pass --tokenizer)")
    output_len = options.fixed_output_len or DEFAULT_TURN_OUTPUT_LEN
    max_len = (options.max_model_len or 2048) - output_len
    answer_prefix = _generation_prompt_ids(tokenizer)
    picked: list[Conversation] = []
    for record in _shuffled(list(load_sharegpt_conversations()), options.seed):
        messages = [(ROLES.get(m["from"]), m["value"]) for m in record["conversations"]]
        if any(role is None for role, _ in messages) or not messages or messages[0][0] != "user":
            continue
        history: list[int] = []
        turns: list[SampleRequest] = []
        for (role, text), (next_role, answer) in zip(messages[::2], messages[1::2]):
            if role != "user" or next_role != "assistant" or len(turns) == MAX_TURNS:
                break
            prompt = history + _segment_ids(tokenizer, "user", text) + answer_prefix
            if len(prompt) > max_len:
                break
            turns.append(SampleRequest(prompt, len(prompt), output_len))
            history = prompt[: len(prompt) - len(answer_prefix)] + _segment_ids(tokenizer, "assistant", answer)
        if len(turns) >= MIN_TURNS:
            picked.append(Conversation(turns))
            if len(picked) == options.num_prompts:
                break
    if len(picked) < options.num_prompts:
        raise DatasetError(f"--dataset {NAME}: only {len(picked)} ShareGPT conversations have {MIN_TURNS}+ turns that "
                           f"fit {max_len} tokens; ask for at most that many (--num-prompts)")
    return picked


def load_workload(name: str, options: DatasetOptions, tokenizer) -> list[SampleRequest] | list[Conversation]:
    """Conversations for this dataset, requests for every other one."""
    return load_conversations(options, tokenizer) if name == NAME else load_requests(name, options, tokenizer)


def as_requests(workload: list) -> list[SampleRequest]:
    """Single requests (a warm-up): a conversation gives its first turn."""
    return [w.turns[0] if isinstance(w, Conversation) else w for w in workload]


async def run_conversations(target: Target, conversations: list[Conversation], start_times_s: np.ndarray,
                            think_time_s: float = 0.0, max_concurrency: int | None = None, seed: int = 0,
                            progress: bool = True, description: str = NAME) -> RunOutcome:
    """Every turn of every conversation; records in conversation order, turn by turn."""
    assert len(start_times_s) == len(conversations), "one start time per conversation"
    rng = np.random.default_rng(seed)
    # Think times drawn up front (exponential, mean think_time_s): the same pauses on every server.
    pauses = [rng.exponential(think_time_s, len(c.turns)) if think_time_s > 0 else np.zeros(len(c.turns))
              for c in conversations]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=sum(len(c.turns) for c in conversations), desc=description, unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)

    async def converse(http: httpx.AsyncClient, conversation: Conversation, pause_s: np.ndarray) -> list[RequestRecord]:
        records = []
        for k, turn in enumerate(conversation.turns):
            if k and pause_s[k] > 0:
                await asyncio.sleep(float(pause_s[k]))
            record = await send_request(http, target, turn)
            records.append(record)
            bar.update(1)
            if not record.ok:
                break  # the history past a failed turn was never answered: the rest is not sent
        return records

    async def one(http: httpx.AsyncClient, conversation: Conversation, pause_s: np.ndarray) -> list[RequestRecord]:
        if slots is None:
            return await converse(http, conversation, pause_s)
        async with slots:
            return await converse(http, conversation, pause_s)

    try:
        async with http_client(target, max_concurrency) as http:
            start = time.perf_counter()
            tasks = []
            for conversation, pause_s, at_s in zip(conversations, pauses, start_times_s.tolist()):
                delay_s = start + at_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(asyncio.create_task(one(http, conversation, pause_s)))
            per_conversation = await asyncio.gather(*tasks)
            duration_s = time.perf_counter() - start
    finally:
        bar.close()
    return RunOutcome([r for records in per_conversation for r in records], duration_s)
