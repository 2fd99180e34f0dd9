"""Llama 3.x JSON calls: the whole answer is ``{"name": "f", "parameters": {...}}`` (or "arguments"),
possibly after ``<|python_tag|>``, several joined by ``;``. Any other answer is text.
"""

from __future__ import annotations

import json

from pdcluster.cluster.api.tool_parsers.base import (CallSnapshot, Snapshot, ToolParser, call_arguments,
                                                 held_prefix_len, tools_system_prompt)
from pdcluster.cluster.api.tool_parsers.json_scan import scan_joined, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and held_prefix_len(text[i:], PYTHON_TAG) == len(text) - i:
            return Snapshot([])  # all whitespace, or the start of the tag: wait
        if i >= len(text):
            return Snapshot([text] if final else [])
        if text[i] != "{":
            return Snapshot([text])
        scan = scan_joined(text, i, ";", ARGS_KEYS)
        if scan.bad or (final and scan.end is None):
            return Snapshot([text])
        return Snapshot([CallSnapshot(c.name, c.arguments(text), c.end is not None) for c in scan.calls])

    def system_prompt(self, tools: list[dict]) -> str:
        return tools_system_prompt(tools, "To call a function, answer with only a JSON object in this format:\n"
                                   '{"name": "<function name>", "parameters": {"<argument>": <value>}}\n'
                                   "Join several calls with ';'. If no function is needed, answer in plain text.")

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": call_arguments(c)},
                                    ensure_ascii=False) for c in calls)
