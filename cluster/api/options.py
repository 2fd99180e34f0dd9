"""What the `serve` flags decide about the OpenAI app: one record, built once from the parsed flags, that the
launchers hand to ``build_app`` (its keyword arguments) or to every API process (it is pickled to them).

Imports only the standard library at module level (the multi-process supervisor imports it with its config).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pdcluster.cluster.api.media_policy import MediaPolicy  # standard library only


@dataclass(frozen=True)
class ApiOptions:
    """``build_app``'s keyword arguments as `serve` sets them (see build_app for each one's meaning)."""

    api_key: str | None = None
    max_body_bytes: int | None = None  # None: build_app's default for the model
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None
    runtime_lora: bool = False  # vLLM's runtime LoRA routes (the workers run with EngineConfig.enable_lora)
    pooler: str | None = None  # serve --pooler-config (JSON), over the model directory's own pooler
    media: MediaPolicy | None = None  # where chat images may be fetched from (None: build_app's default)
    generation_config: str = "auto"  # where requests' sampling defaults come from (cluster/api/generation_defaults.py)
    override_generation_config: dict | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, runtime_lora: bool) -> ApiOptions:
        """From `serve`'s parsed flags (a flag another command lacks keeps its default)."""
        return cls(api_key=getattr(args, "api_key", None), max_body_bytes=getattr(args, "max_body_bytes", None),
                   tool_call_parser=getattr(args, "tool_call_parser", "auto"),
                   reasoning_parser=getattr(args, "reasoning_parser", None), runtime_lora=runtime_lora,
                   pooler=getattr(args, "pooler_config", None), media=getattr(args, "media_policy", None),
                   generation_config=getattr(args, "generation_config", "auto"),
                   override_generation_config=getattr(args, "override_generation_config", None))

    def app_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
