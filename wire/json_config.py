"""The start of every vLLM JSON flag we read (--kv-transfer-config, --kv-events-config): the text is a JSON
object whose keys are known, else one line naming the flag."""

from __future__ import annotations

import json


def parse_json_object(text: str, name: str, error: type[ValueError], known: set[str]) -> dict:
    """``text`` as a dict; ``error`` (naming ``name``) for text that is not JSON, not an object, or has a key
    outside ``known``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{name}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(raw, dict):
        raise error(f"{name}: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise error(f"{name}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return raw
