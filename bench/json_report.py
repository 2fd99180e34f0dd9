"""The tail the bench scripts share: the result as JSON on stdout and, when --out names a file, the same
text there, so a saved result is exactly what the run printed."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, out: str | Path | None, indent: int = 1) -> None:
    """Prints ``result`` as JSON; when ``out`` is set, also writes it there (its folder made if missing)."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
