"""vLLM's dotted form of a JSON flag, as newer `vllm serve` manifests write them: ``--hf-overrides.rope_theta 1e6``,
``--speculative-config.method ngram --speculative-config.num_speculative_tokens 3``, ``--limit-mm-per-prompt.image=2``,
a list item with ``+`` (``--json-arg.key+ v``, or ``+=a,b`` for several). Each is folded into the flag's JSON value
(merged over a plain ``--flag '{...}'`` given too) before argparse sees the command line. A value is read as JSON where
it parses (``3``, ``true``, ``[1, 2]``), else as a string, as vLLM reads it.

The flags that take JSON are the parser's own with metavar ``JSON``: nothing else is rewritten.
"""

from __future__ import annotations

import argparse
import json

from pdcluster.engine.config import ConfigError
from pdcluster.engine.models.hf_overrides import merged_config  # nested objects merged key by key


def json_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long flags of ``parser`` whose value is a JSON object."""
    return {flag for flag, action in parser._option_string_actions.items()
            if flag.startswith("--") and action.metavar == "JSON"}


def expand_dotted_json_args(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with every ``--flag.key[.key...][+] value`` folded into ``--flag JSON`` (at the flag's first place,
    over its plain JSON where that is given too); ``argv`` itself where there is none. ConfigError for a dotted key on
    a flag that takes no JSON object, or one missing its value."""
    wanted = json_flags(parser)
    dotted = set()
    for arg in argv:
        if arg == "--":
            break
        flag, dot, _ = arg.split("=", 1)[0].partition(".")
        if arg.startswith("--") and dot:
            if flag in wanted:
                dotted.add(flag)
            elif flag in parser._option_string_actions:
                raise ConfigError(f"{arg.split('=', 1)[0]}: {flag} takes no JSON object, so it has no keys to set")
    if not dotted:
        return argv
    out: list[str] = []
    values: dict[str, dict] = {flag: {} for flag in dotted}
    plain: dict[str, dict] = {}
    where: dict[str, int] = {}  # flag -> its place in ``out``
    i = 0
    while i < len(argv):
        arg = argv[i]
        head = arg.split("=", 1)[0]
        flag, dot, path = head.partition(".")
        if arg == "--":
            out += argv[i:]
            break
        if not arg.startswith("--") or flag not in dotted:
            out.append(arg)
            i += 1
            continue
        if "=" in arg:
            value, i = arg.split("=", 1)[1], i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:
            raise ConfigError(f"{head}: give a value")
        if flag not in where:
            where[flag] = len(out)
            out.append(flag)
        if dot:
            _set(values[flag], path, value, head)
            continue
        try:  # the plain form: its object, under the dotted keys
            whole = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{flag}: not JSON ({e})") from None
        if not isinstance(whole, dict):
            raise ConfigError(f"{flag}: want a JSON object, got {value!r}")
        plain[flag] = whole
    for flag, place in sorted(where.items(), key=lambda item: -item[1]):
        out.insert(place + 1, json.dumps(merged_config(plain.get(flag, {}), values[flag])))
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set(obj: dict, path: str, text: str, head: str) -> None:
    append = path.endswith("+")
    keys = path.removesuffix("+").split(".")
    if not all(keys):
        raise ConfigError(f"{head}: an empty key")
    for key in keys[:-1]:
        inner = obj.setdefault(key, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"{head}: {key} is already set to {inner!r}, not an object")
        obj = inner
    if not append:
        obj[keys[-1]] = _value(text)
        return
    items = obj.setdefault(keys[-1], [])
    if not isinstance(items, list):
        raise ConfigError(f"{head}: {keys[-1]} is already set to {items!r}, not a list")
    items.extend(_value(part) for part in text.split(","))
