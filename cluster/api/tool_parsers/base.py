"""What every tool-call parser gives: a ``Snapshot`` of an output (finished, or so far), in order, as
plain text and calls; ``parse`` (a finished output -> content and OpenAI ``tool_calls``) is read off
the final snapshot, so a stream (tool_parsers/stream.py) and a whole answer cannot disagree.

A parser's snapshot of a growing text only grows: text it shows, and a call's name and arguments, stay
as they were while more text comes (what might still turn out to be a call is held back, not shown and
taken back). With ``final`` nothing is held: an unfinished or malformed call is shown as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass
class CallSnapshot:
    """One call as far as the text shows it."""

    name: str | None  # None until the name is complete
    arguments: str  # the arguments (a JSON object's text) so far
    done: bool = False


@dataclass
class Snapshot:
    """An output as text and calls, in the order they came."""

    parts: list[str | CallSnapshot]

    @property
    def content(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def calls(self) -> list[CallSnapshot]:
        return [p for p in self.parts if isinstance(p, CallSnapshot)]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def openai_call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tools_system_prompt(tools: list[dict], how_to_call: str, open_tag: str = "", close_tag: str = "") -> str:
    """What a parser's ``system_prompt`` says: the tools as JSON Schema (between the format's tags where it
    has them), then ``how_to_call`` in that format."""
    return ("You may call functions to help answer. These are the functions you can call, described in "
            f"JSON Schema:\n{open_tag}{json.dumps(tools, ensure_ascii=False)}{close_tag}\n{how_to_call}")


class ToolParser:
    """A model's tool-call format. Subclasses give ``snapshot``; the ones a server can pick for
    tool_choice "auto" (``name`` set) also say how to describe tools in a prompt and how past calls
    look in a conversation."""

    name = ""
    # Its markers are special tokens (Mistral's [TOOL_CALLS]): a request it reads keeps them in its text.
    needs_special_tokens = False

    def for_tools(self, tools: list) -> ToolParser:
        """The parser for one request's ``tools`` (cluster/api/protocol.py ``Tool``s): a format whose values
        are typed by the tools' schemas (Qwen3-Coder's XML) reads them; the others are the same for every
        request."""
        return self

    def snapshot(self, text: str, final: bool) -> Snapshot:
        raise NotImplementedError

    def parse(self, text: str, max_calls: int | None = None) -> tuple[str, list[dict]]:
        """The content (text outside calls; the whole text when there are none) and the calls."""
        snap = self.snapshot(text, final=True)
        calls = snap.calls[:max_calls] if max_calls is not None else snap.calls
        assert all(c.done and c.name for c in calls), "a final snapshot holds finished calls only"
        return snap.content, [openai_call(c.name, c.arguments) for c in calls]

    def system_prompt(self, tools: list[dict]) -> str:
        """Tells the model which tools it has and how to call them (for templates that ignore ``tools``)."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict]) -> str:
        """Past calls (OpenAI ``tool_calls``) as the model would have written them."""
        raise NotImplementedError


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments as an object (they travel as a JSON string)."""
    args = call.get("function", {}).get("arguments") or "{}"
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tagged_blocks_snapshot(text: str, final: bool, open_tag: str,
                           read_block: Callable[[str, int, bool], tuple[list[CallSnapshot], int | None] | None]
                           ) -> Snapshot:
    """The snapshot of a format whose calls are blocks opened by ``open_tag`` with text around them (hermes,
    qwen3_coder). ``read_block(text, body, final)``: the calls of the block whose body starts at ``body`` and
    where it ends (None: still open), or None if it is no call block (its tag is text). Whitespace next to a
    block is not content; before ``final``, what may still become a tag (and whitespace before it) waits."""
    parts: list = []
    pending, pos, after_block = "", 0, False
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            pending += text[pos:]
            break
        body = start + len(open_tag)
        block = read_block(text, body, final)
        if block is None:  # not a call: the tag is text
            pending, pos = pending + text[pos:body], body
            continue
        calls, end = block
        before = pending + text[pos:start]
        parts.append((before.lstrip() if after_block else before).rstrip())
        parts.extend(calls)
        if end is None:  # still being written: nothing after it yet
            return Snapshot(parts)
        pending, pos, after_block = "", end, True
    tail = pending.lstrip() if after_block else pending
    if not final:
        tail = tail[: len(tail) - held_prefix_len(tail, open_tag)].rstrip()
    parts.append(tail)
    return Snapshot(parts)


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
