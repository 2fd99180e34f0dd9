"""Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

one block a call, text around them. A parameter's value is raw text (one newline after its opening tag and
before its closing tag is layout, not value), typed by the request's tool schema as vLLM types it: strings
stay strings, integers / numbers / booleans / null are converted, objects and arrays read as JSON; a
parameter the schema does not name (or a value that does not convert) stays a string. The arguments object
grows a whole parameter at a time, so a stream never sends a value it would later change.
"""

from __future__ import annotations

import json
import re

from pdcluster.cluster.api.tool_parsers.base import (CallSnapshot, Snapshot, ToolParser, call_arguments,
                                                 tagged_blocks_snapshot, tools_system_prompt)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
PARAM_CLOSE, FUNCTION_CLOSE = "</parameter>", "</function>"


def _typed(raw: str, schema: dict | None):
    """A parameter's raw text as its schema's type (vLLM's conversions); the text itself when the schema
    says string, names no type, or the text does not convert."""
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    text = raw.strip()
    if text.lower() == "null" and "string" not in kinds:
        return None
    for k in kinds:
        try:
            if k in ("integer", "int"):
                return int(text)
            if k in ("number", "float"):
                value = float(text)
                return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
            if k == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if k in ("object", "array"):
                return json.loads(text)
        except ValueError:
            continue
    return raw


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: dict[str, dict] | None = None):
        self.schemas = schemas or {}  # function name -> its parameters' properties

    def for_tools(self, tools: list) -> ToolParser:
        return Qwen3CoderParser({t.function.name: (t.function.parameters or {}).get("properties") or {}
                                 for t in tools})

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return tagged_blocks_snapshot(text, final, OPEN, self._block)

    def _block(self, text: str, body: int, final: bool) -> tuple[list[CallSnapshot], int | None] | None:
        """The block's call (one) and where the block ends (None: still open), or None: no call block."""
        m = _FUNCTION.match(text, body)
        if m is None:
            rest = text[body:].lstrip()
            return None if final or not "<function=".startswith(rest[:10]) else ([CallSnapshot(None, "")], None)
        name = m.group(1).strip()
        schema = self.schemas.get(name, {})
        args: dict = {}
        pos = m.end()
        while True:
            p = _PARAMETER.match(text, pos)
            if p is None:
                rest = text[pos:].lstrip()
                if rest.startswith(FUNCTION_CLOSE):
                    function_end = text.find(FUNCTION_CLOSE, pos) + len(FUNCTION_CLOSE)
                    j = function_end + len(text[function_end:]) - len(text[function_end:].lstrip())
                    done = [CallSnapshot(name, json.dumps(args, ensure_ascii=False), done=True)]
                    if text.startswith(CLOSE, j):
                        return done, j + len(CLOSE)
                    if not final and CLOSE.startswith(text[j:]):  # the closing tag is coming
                        return [CallSnapshot(name, self._open_arguments(args))], None
                    return done, function_end  # no closing tag: the block ends with its function
                if final or not ("<parameter=".startswith(rest[:11]) or FUNCTION_CLOSE.startswith(rest)):
                    return None
                return [CallSnapshot(name, self._open_arguments(args))], None
            value_start = p.end() + (1 if text.startswith("\n", p.end()) else 0)
            close = text.find(PARAM_CLOSE, value_start)
            if close < 0:
                if final:
                    return None
                return [CallSnapshot(name, self._open_arguments(args))], None
            raw = text[value_start:close]
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            args[key] = _typed(raw, schema.get(key))
            pos = close + len(PARAM_CLOSE)

    @staticmethod
    def _open_arguments(args: dict) -> str:
        """The arguments object so far: its finished parameters, the object still open."""
        return json.dumps(args, ensure_ascii=False)[:-1] if args else ""

    def system_prompt(self, tools: list[dict]) -> str:
        how_to_call = ("To call a function, answer with a block in this format:\n"
                       "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n"
                       "</function>\n</tool_call>\nOne block a call. If no function is needed, answer in plain text.")
        return tools_system_prompt(tools, how_to_call, "<tools>", "</tools>")

    def render_calls(self, calls: list[dict]) -> str:
        blocks = []
        for c in calls:
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                             f"</parameter>\n" for k, v in call_arguments(c).items())
            blocks.append(f"{OPEN}\n<function={c['function']['name']}>\n{params}{FUNCTION_CLOSE}\n{CLOSE}")
        return "\n".join(blocks)
