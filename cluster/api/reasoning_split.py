"""What a reasoning parser returns for each piece of output (cluster/api/reasoning.py, cluster/api/harmony.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Split:
    """A piece of output: its reasoning and its content (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)
