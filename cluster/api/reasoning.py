"""Reasoning output (vLLM's ``--reasoning-parser``): a thinking model's chain of thought, written between
``<think>`` and ``</think>``, comes back apart from its answer, as ``message.reasoning`` (and
``reasoning_content``, its older name, which clients still read) beside ``message.content``; streamed, as
``delta.reasoning`` / ``delta.reasoning_content`` pieces before the content's. The tags are not shown.

Two <think> tag parsers, vLLM's names and rules:
- ``qwen3`` (Qwen3, QwQ): the output is reasoning only when it opens with ``<think>``; it ends at
  ``</think>``. An output without the tag (Qwen3 with ``enable_thinking: false``, whose template writes an
  empty think block into the prompt) is all content.
- ``deepseek_r1`` (DeepSeek-R1 and its distills): the template opens ``<think>`` in the prompt, so the
  output is reasoning from its first character (an opening tag, if the model writes one, is dropped) up to
  ``</think>``; an output that never closes it is all reasoning.
Text after ``</think>`` is the content as written (vLLM does not strip it either). A request whose output a
grammar forces (``response_format``, a required or named tool) has no reasoning: it is not parsed.

A third, ``openai_gptoss`` (gpt-oss), reads the channels of OpenAI's harmony format instead: cluster/api/harmony.py.

One state machine serves the whole text and the stream, so both always agree: text that may be the start
of a tag is held back until the next piece says what it is (at most ``len("</think>") - 1`` characters).
"""

from __future__ import annotations

from pdcluster.cluster.api.harmony import HarmonyStream
from pdcluster.cluster.api.reasoning_split import Split
from pdcluster.cluster.api.tool_parsers.base import held_prefix_len

START, END = "<think>", "</think>"
THINK_TAG_PARSERS = ("qwen3", "deepseek_r1")
# gpt-oss's channels (cluster/api/harmony.py); its markers are special tokens, kept in its detokenized text.
HARMONY = "openai_gptoss"
PARSERS = (*THINK_TAG_PARSERS, HARMONY)


# Each parser's thinking section as the model writes it: its start and end markers, for thinking_token_budget. A
# gpt-oss analysis message ends at <|end|>, after which the model heads its next message (the final answer) itself.
MARKERS = {"qwen3": (START, END), "deepseek_r1": (START, END),
           HARMONY: ("<|channel|>analysis<|message|>", "<|end|>")}


def thinking_markers(parser: str, tokenizer) -> tuple[list[int], list[int]]:
    """The token ids of ``parser``'s start and end markers (a thinking model has a token for each; another model
    spells them in pieces, as the same text in its output would be)."""
    start, end = MARKERS[parser]
    return tokenizer.encode(start), tokenizer.encode(end)


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(PARSERS)}")
    return name


class ReasoningStream:
    """One choice's output, piece by piece: ``feed`` returns what each piece adds to the reasoning and to the
    content; ``finish`` flushes what was held back."""

    def __init__(self, parser: str):
        if parser not in THINK_TAG_PARSERS:
            raise ValueError(f"{parser!r} is not a <think> tag parser ({', '.join(THINK_TAG_PARSERS)})")
        self.parser = parser
        self._state = "start"  # start -> reasoning -> content (or start -> content)
        self._held = ""

    def feed(self, text: str) -> Split:
        self._held += text
        out = Split()
        if self._state == "start":
            if self._held.startswith(START):
                self._held = self._held[len(START):]
                self._state = "reasoning"
            elif START.startswith(self._held):
                return out  # "<thi": the tag or not, the next piece says
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            at = self._held.find(END)
            if at < 0:
                keep = held_prefix_len(self._held, END)
                out.reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                return out
            out.reasoning = self._held[:at]
            self._held = self._held[at + len(END):]
            self._state = "content"
        out.content, self._held = self._held, ""
        return out

    def finish(self) -> Split:
        """The end of the output: text held back as a possible tag is what it was."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        return Split(reasoning=held) if self._state == "reasoning" else Split(content=held)


def reasoning_stream(parser: str):
    """The stream parser of ``parser``'s format: ReasoningStream, or gpt-oss's HarmonyStream (same interface)."""
    if check_reasoning_parser(parser) == HARMONY:
        return HarmonyStream()
    return ReasoningStream(parser)


def needs_special_tokens(parser: str | None) -> bool:
    """Whether ``parser`` reads markers that are special tokens (kept in the request's detokenized text)."""
    return parser == HARMONY


def split_reasoning(parser: str, text: str) -> Split:
    """A whole output's reasoning and content (the stream's rules, at once)."""
    stream = reasoning_stream(parser)
    return stream.feed(text) + stream.finish()


def reasoning_fields(reasoning: str | None) -> dict:
    """The message / delta fields of ``reasoning``: vLLM's ``reasoning`` and its older ``reasoning_content``."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}
