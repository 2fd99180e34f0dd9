"""Reading tool calls out of a JSON prefix: how far one call object, or a sequence of them, has come.

The scanners look at a text that may still grow (a model's output so far) and say what it shows:
the function's name once its string is complete, where the arguments value starts and (once complete)
ends, and where the object ends. The arguments are reported as a span of the text, never re-encoded,
so what a stream sends piece by piece is exactly what the finished answer holds. Anything that can no
longer become a call object (a bad character, a name that is not a string, arguments that are not an
object, an object without a name) is ``bad``: the caller shows such text as plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\r\n"
# A complete JSON string, a bracket, or a lone quote (an unterminated string: the text is incomplete).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|"')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SCALAR_END = re.compile(r"[,}\]\s]")


@dataclass
class CallScan:
    """One call object as far as the text shows it."""

    name: str | None = None  # the "name" value, once its string is complete
    args_start: int | None = None  # where the arguments value starts
    args_end: int | None = None  # where it ends (None: not complete yet)
    end: int | None = None  # just after the closing brace (None: still open)
    bad: bool = False  # cannot become a call object

    def arguments(self, text: str) -> str:
        """The arguments text so far ("{}" for a finished call that gave none)."""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        return text[self.args_start: self.args_end if self.args_end is not None else len(text)]


@dataclass
class SequenceScan:
    """Call objects in a row (a JSON array, or objects joined by a separator)."""

    calls: list[CallScan] = field(default_factory=list)
    end: int | None = None  # just after the sequence (None: still open)
    bad: bool = False


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def value_end(text: str, pos: int) -> int | None:
    """Just after the JSON value starting at ``pos``; None while incomplete; -1 if it cannot be one."""
    c = text[pos]
    if c == '"':
        m = _STRING.match(text, pos)
        return m.end() if m else None
    if c in "{[":
        depth = 0
        for m in _TOKEN.finditer(text, pos):
            tok = m.group()
            if tok == '"':
                return None  # an unterminated string: more text to come
            if tok in "{[":
                depth += 1
            elif tok in "}]":
                depth -= 1
                if depth == 0:
                    end = m.end()
                    return end if is_json(text[pos:end]) else -1
        return None
    m = _SCALAR_END.search(text, pos)
    if m is None:
        return None  # a number or literal may go on
    return m.start() if m.start() > pos and is_json(text[pos:m.start()]) else -1


def is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def scan_call(text: str, pos: int, args_keys: tuple[str, ...], require_args: bool = False) -> CallScan:
    """Scan the call object that starts at ``pos`` (``{"name": ..., <args key>: {...}}``)."""
    out = CallScan()
    if pos >= len(text):
        return out
    if text[pos] != "{":
        out.bad = True
        return out
    i, expect, key = pos + 1, "key_or_close", None
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return out
        c = text[i]
        if expect in ("key_or_close", "key"):
            if c == "}" and expect == "key_or_close":
                break
            m = _STRING.match(text, i) if c == '"' else None
            if c != '"':
                out.bad = True
                return out
            if m is None:
                return out  # the key is still being written
            key, i, expect = json.loads(m.group()), m.end(), "colon"
        elif expect == "colon":
            if c != ":":
                out.bad = True
                return out
            i, expect = i + 1, "value"
        elif expect == "value":
            is_args = key in args_keys and out.args_start is None
            if is_args:
                out.args_start = i
                if c != "{":
                    out.bad = True
                    return out
            j = value_end(text, i)
            if j is None:
                return out
            if j < 0:
                out.bad = True
                return out
            if is_args:
                out.args_end = j
            elif key == "name":
                name = json.loads(text[i:j])
                if not isinstance(name, str) or not name:
                    out.bad = True
                    return out
                out.name = name
            i, expect = j, "comma_or_close"
        else:  # comma_or_close
            if c == "}":
                break
            if c != ",":
                out.bad = True
                return out
            i, expect = i + 1, "key"
    out.end = i + 1
    if out.name is None or (require_args and out.args_start is None) or not is_json(text[pos:out.end]):
        out.bad = True
    return out


def scan_array(text: str, pos: int, args_keys: tuple[str, ...], require_args: bool = False) -> SequenceScan:
    """Scan a JSON array of call objects starting at ``pos`` (``[`` expected)."""
    return _scan_sequence(text, pos, "[", ",", "]", args_keys, require_args)


def scan_joined(text: str, pos: int, sep: str, args_keys: tuple[str, ...]) -> SequenceScan:
    """Scan call objects joined by ``sep`` up to the end of the text (``end`` is set once the last
    object is complete and only whitespace follows it)."""
    return _scan_sequence(text, pos, None, sep, None, args_keys, False)


def _scan_sequence(text: str, pos: int, open_: str | None, sep: str, close: str | None,
                   args_keys: tuple[str, ...], require_args: bool) -> SequenceScan:
    out = SequenceScan()
    i = skip_ws(text, pos)
    if open_ is not None:
        if i >= len(text):
            return out
        if text[i] != open_:
            out.bad = True
            return out
        i = skip_ws(text, i + 1)
        if i < len(text) and text[i] == close:
            out.end = i + 1
            return out
    while True:
        call = scan_call(text, i, args_keys, require_args)
        if call.bad:
            out.bad = True
            return out
        if call.name is not None or call.args_start is not None or call.end is not None:
            out.calls.append(call)
        if call.end is None:
            return out
        i = skip_ws(text, call.end)
        if i >= len(text):
            if close is None:
                out.end = call.end
            return out
        if close is not None and text[i] == close:
            out.end = i + 1
            return out
        if text[i] != sep:
            out.bad = True
            return out
        i = skip_ws(text, i + 1)
