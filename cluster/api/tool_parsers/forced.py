"""The outputs of forced tool choices (cluster/api/structured.py makes the grammar): a named function's
arguments object, or for "required" a JSON array of ``{"name": ..., "parameters": {...}}``. Output that
is not that (cut by max_tokens) is text.
"""

from __future__ import annotations

import json

from pdcluster.cluster.api.tool_parsers.base import CallSnapshot, Snapshot, ToolParser
from pdcluster.cluster.api.tool_parsers.json_scan import scan_array, skip_ws


class NamedParser(ToolParser):
    """The whole output is the arguments of the function ``function``."""

    def __init__(self, function: str):
        self.function = function

    def snapshot(self, text: str, final: bool) -> Snapshot:
        if not final:
            return Snapshot([CallSnapshot(self.function, text)])
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return Snapshot([text])
        return Snapshot([CallSnapshot(self.function, text, done=True)])


class RequiredParser(ToolParser):
    """The whole output is a JSON array of at least one call."""

    def snapshot(self, text: str, final: bool) -> Snapshot:
        scan = scan_array(text, 0, ("parameters",), require_args=True)
        complete = scan.end is not None and skip_ws(text, scan.end) == len(text) and scan.calls
        if scan.bad or (final and not complete):
            return Snapshot([text] if final else [])
        return Snapshot([CallSnapshot(c.name, c.arguments(text), c.end is not None) for c in scan.calls])
