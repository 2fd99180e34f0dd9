"""gpt-oss's calls (vLLM's ``openai``): in OpenAI's harmony format a call is a message to a function, its
recipient in the header, its arguments the body, ended by ``<|call|>``::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also follow the role: ``<|start|>assistant to=functions.get_weather<|channel|>commentary``).
Everything else is content as it is. ``<|call|>`` is one of gpt-oss's end-of-turn tokens, so a served output usually
stops on it without showing it: a call whose body runs to the end of a finished output is whole when the body is
complete JSON (cut by max_tokens, it is not, and is shown as text). With ``--reasoning-parser openai_gptoss`` (cluster/api/harmony.py) the content
this parser reads is the answer's channels, call messages passed through in this form. The markers are special
tokens: a request it reads keeps them in its text (``needs_special_tokens``).
"""

from __future__ import annotations

import json
import re

from pdcluster.cluster.api.tool_parsers.base import (CallSnapshot, Snapshot, ToolParser, call_arguments,
                                                 held_prefix_len, tools_system_prompt)
from pdcluster.cluster.api.tool_parsers.json_scan import is_json

START, CHANNEL, MESSAGE, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|call|>"
# A whole header (from its <|start|> or <|channel|>) that names a function as its recipient, up to <|message|>.
_CALL_HEADER = re.compile(r"(?:<\|start\|>|<\|channel\|>)(?:(?!<\|message\|>|<\|end\|>|<\|call\|>|<\|return\|>).)*?"
                          r"to=functions\.(?P<name>[A-Za-z0-9_\-.]+)(?:(?!<\|message\|>).)*<\|message\|>", re.S)


def _held_header_start(text: str) -> int:
    """Where a header that may still name a function starts in ``text`` (a <|start|> or <|channel|> with no
    <|message|> after it, or a marker cut at the end); len(text) if none."""
    held = len(text)
    for marker in (START, CHANNEL):
        at = text.rfind(marker)
        if at >= 0 and MESSAGE not in text[at:]:
            held = min(held, at)
    return min(held, len(text) - max(held_prefix_len(text, m) for m in (START, CHANNEL)))


class OpenAIHarmonyParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def snapshot(self, text: str, final: bool) -> Snapshot:
        parts: list = []
        pos = 0
        for header in _CALL_HEADER.finditer(text):
            if header.start() < pos:
                continue
            if text[pos:header.start()]:
                parts.append(text[pos:header.start()])
            args_at = header.end()
            end = text.find(CALL, args_at)
            if end < 0:
                if final and is_json(text[args_at:]):  # <|call|> is an end-of-turn token: the stop took it
                    parts.append(CallSnapshot(header["name"], text[args_at:], done=True))
                    return Snapshot(parts)
                if final:  # a call the output never finished (max_tokens): shown as the text it is
                    parts.append(text[header.start():])
                    return Snapshot(parts)
                parts.append(CallSnapshot(header["name"], text[args_at:len(text) - held_prefix_len(text, CALL)]))
                return Snapshot(parts)
            parts.append(CallSnapshot(header["name"], text[args_at:end], done=True))
            pos = end + len(CALL)
        rest = text[pos:]
        if not final:
            rest = rest[:_held_header_start(rest)]
        if rest:
            parts.append(rest)
        return Snapshot(parts)

    def system_prompt(self, tools: list[dict]) -> str:
        how_to_call = ("To call a function, write a commentary message to it with its arguments as JSON:\n"
                       "<|start|>assistant<|channel|>commentary to=functions.<function name> <|constrain|>json"
                       '<|message|>{"<argument>": <value>}<|call|>')
        return tools_system_prompt(tools, how_to_call)

    def render_calls(self, calls: list[dict]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{c['function']['name']} <|constrain|>json"
                       f"{MESSAGE}{json.dumps(call_arguments(c), ensure_ascii=False)}{CALL}" for c in calls)
