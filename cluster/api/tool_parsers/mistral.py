"""Mistral's calls (vLLM's ``mistral``): ``[TOOL_CALLS]`` then the calls, in one of the two forms Mistral's
tokenizers have used:
- a JSON array, ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (Mistral 7B v0.3, Mixtral 8x22B,
  Nemo, Small 3.1);
- one ``[TOOL_CALLS]f[ARGS]{...}`` per call, back to back (tokenizer v11 on: Small 3.2, Magistral, Devstral).
Text before the first ``[TOOL_CALLS]`` is content; a marker that is not followed by a call is text.
``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so a request this parser reads keeps special tokens in
its text (``needs_special_tokens``; vLLM sets skip_special_tokens false for it the same way).
"""

from __future__ import annotations

import json
import re

from pdcluster.cluster.api.tool_parsers.base import (CallSnapshot, Snapshot, ToolParser, call_arguments,
                                                 held_prefix_len, tools_system_prompt)
from pdcluster.cluster.api.tool_parsers.json_scan import scan_array, skip_ws, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
ARGS_KEYS = ("arguments",)
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = text.find(TOOL_CALLS)
        if start < 0:
            if final:
                return Snapshot([text])
            # What may still become the marker, and whitespace before it (not content then), waits.
            return Snapshot([text[: len(text) - held_prefix_len(text, TOOL_CALLS)].rstrip()])
        calls = self._calls(text, start, final)
        if calls is None:  # not calls after all: the marker is text
            return Snapshot([text])
        return Snapshot([text[:start].rstrip(), *calls])

    def _calls(self, text: str, start: int, final: bool) -> list[CallSnapshot] | None:
        """The calls from the marker at ``start`` on, so far (a call still being written last, unfinished);
        None if the text there cannot be calls (the caller then shows it as text)."""
        i = skip_ws(text, start + len(TOOL_CALLS))
        if i >= len(text):
            return None if final else []
        if text[i] == "[":
            scan = scan_array(text, i, ARGS_KEYS)
            if scan.bad or (final and scan.end is None) or (scan.end is not None and text[scan.end:].strip()):
                return None
            return [CallSnapshot(c.name, c.arguments(text), c.end is not None) for c in scan.calls]
        return self._named_calls(text, start, final)

    def _named_calls(self, text: str, pos: int, final: bool) -> list[CallSnapshot] | None:
        calls: list[CallSnapshot] = []
        while True:  # at a [TOOL_CALLS] marker
            name_at = pos + len(TOOL_CALLS)
            name = _NAME.match(text, name_at).group()
            args_tag = name_at + len(name)
            if not text.startswith(ARGS, args_tag):
                if final or not ARGS.startswith(text[args_tag:]) or not name and args_tag < len(text):
                    return None
                return calls + ([CallSnapshot(None, "")] if name else [])
            if not name:
                return None
            args_at = args_tag + len(ARGS)
            if args_at >= len(text):
                return None if final else calls + [CallSnapshot(name, "")]
            if text[args_at] != "{":
                return None
            end = value_end(text, args_at)
            if end == -1:
                return None
            if end is None:  # the arguments are still being written
                return None if final else calls + [CallSnapshot(name, text[args_at:])]
            calls.append(CallSnapshot(name, text[args_at:end], done=True))
            rest = skip_ws(text, end)
            if rest >= len(text):
                return calls
            if not text.startswith(TOOL_CALLS, rest):
                if not final and TOOL_CALLS.startswith(text[rest:]):
                    return calls  # the next call's marker is coming
                return None
            pos = rest

    def system_prompt(self, tools: list[dict]) -> str:
        how_to_call = ("To call functions, answer with the calls only, in this format:\n"
                       f'{TOOL_CALLS}[{{"name": "<function name>", "arguments": {{"<argument>": <value>}}}}]\n'
                       "Put several calls in the list to call several functions. If no function is needed, "
                       "answer in plain text.")
        return tools_system_prompt(tools, how_to_call, "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")

    def render_calls(self, calls: list[dict]) -> str:
        items = [{"name": c["function"]["name"], "arguments": call_arguments(c)} for c in calls]
        return TOOL_CALLS + json.dumps(items, ensure_ascii=False)
