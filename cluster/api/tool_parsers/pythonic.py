"""Pythonic calls (Llama 3.2/4 and others): the whole answer is a Python list of calls with keyword
arguments of literal values, ``[get_weather(city="Paris"), get_time(zone="CET")]``. Any other answer
is text. The arguments become JSON, so a stream sends each call whole, once its ``)`` has come.
"""

from __future__ import annotations

import ast
import json
import re

from pdcluster.cluster.api.tool_parsers.base import CallSnapshot, Snapshot, ToolParser, call_arguments, tools_system_prompt

# A complete Python string literal, a bracket or comma, or a lone quote (an unterminated string).
_TOKEN = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"|[\[\](){},]|['\"]")


class PythonicParser(ToolParser):
    name = "pythonic"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        stripped = text.strip()
        if not stripped:
            return Snapshot([text] if final else [])
        if not stripped.startswith("["):
            return Snapshot([text])
        items, closed = _top_level_items(text, text.index("["))
        calls = []
        for item in items:
            call = _call(item)
            if call is None:
                return Snapshot([text])
            calls.append(call)
        if closed is not None and text[closed:].strip():
            return Snapshot([text])  # more after the list: not a call list
        if final and (closed is None or not calls):
            return Snapshot([text])
        return Snapshot(calls)

    def system_prompt(self, tools: list[dict]) -> str:
        return tools_system_prompt(tools, "To call functions, answer with only a Python list of calls with keyword "
                                   "arguments, like:\n"
                                   '[function_name(argument="value", other=1)]\n'
                                   "If no function is needed, answer in plain text.")

    def render_calls(self, calls: list[dict]) -> str:
        def one(c: dict) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in call_arguments(c).items())
            return f"{c['function']['name']}({args})"

        return "[" + ", ".join(one(c) for c in calls) + "]"


def _top_level_items(text: str, start: int) -> tuple[list[str], int | None]:
    """The list's complete items (each an expression's text) and where the list ends (None: open)."""
    items, depth, item_start = [], 0, start + 1
    for m in _TOKEN.finditer(text, start):
        tok = m.group()
        if tok in ("'", '"'):
            break  # an unterminated string
        if tok in "[({":
            depth += 1
        elif tok in "])}":
            depth -= 1
            if depth == 0:
                last = text[item_start:m.start()]
                if last.strip() or items:
                    items.append(last)
                return items, m.end()
        elif tok == "," and depth == 1:
            items.append(text[item_start:m.start()])
            item_start = m.end()
    return items, None


def _call(item: str) -> CallSnapshot | None:
    try:
        node = ast.parse(item.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except ValueError:
        return None
    if len(args) != len(node.keywords):
        return None  # **kwargs
    try:
        arguments = json.dumps(args, ensure_ascii=False)
    except TypeError:
        return None  # a tuple key, bytes, a set: not JSON
    return CallSnapshot(node.func.id, arguments, done=True)
