"""Hermes-style calls: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one block per call,
text around them. Also read: a JSON array of such objects in one block (SmolLM2's format, which it was
trained on: ``<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>``; ``[]`` means no call),
and a last block whose closing tag never came. Whitespace next to a block is not content.
"""

from __future__ import annotations

import json

from pdcluster.cluster.api.tool_parsers.base import (CallSnapshot, Snapshot, ToolParser, call_arguments,
                                                 tagged_blocks_snapshot, tools_system_prompt)
from pdcluster.cluster.api.tool_parsers.json_scan import SequenceScan, scan_array, scan_call, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


class HermesParser(ToolParser):
    name = "hermes"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return tagged_blocks_snapshot(text, final, OPEN, self._block)

    def _block(self, text: str, body: int, final: bool) -> tuple[list[CallSnapshot], int | None] | None:
        """The calls of the block whose body starts at ``body`` and where it ends (None: open), or None
        if it is not a call block."""
        i = skip_ws(text, body)
        if i >= len(text):
            return None if final else ([], None)
        if text[i] == "[":
            scan = scan_array(text, i, ARGS_KEYS)
        else:
            one = scan_call(text, i, ARGS_KEYS)
            scan = SequenceScan([one] if one.name or one.args_start is not None else [], one.end, one.bad)
        if scan.bad or (final and scan.end is None):
            return None
        calls = [CallSnapshot(c.name, c.arguments(text), c.end is not None) for c in scan.calls]
        if scan.end is None:
            return calls, None
        j = skip_ws(text, scan.end)
        if text.startswith(CLOSE, j):
            return calls, j + len(CLOSE)
        if CLOSE.startswith(text[j:]):  # the closing tag is coming (or never came: the text ended)
            return calls, (len(text) if final else None)
        return calls, scan.end  # no closing tag: the block ends with its JSON

    def system_prompt(self, tools: list[dict]) -> str:
        how_to_call = ("To call functions, answer with the calls only, in this format:\n"
                       '<tool_call>[{"name": "<function name>", "arguments": {"<argument>": <value>}}]</tool_call>\n'
                       "Put several calls in the list to call several functions. If no function is needed, "
                       "answer in plain text.")
        return tools_system_prompt(tools, how_to_call, "<tools>", "</tools>")

    def render_calls(self, calls: list[dict]) -> str:
        items = [{"name": c["function"]["name"], "arguments": call_arguments(c)} for c in calls]
        return f"{OPEN}{json.dumps(items, ensure_ascii=False)}{CLOSE}"
