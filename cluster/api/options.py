"""What the `serve` flags decide about the OpenAI app: one record, built once from the parsed flags, that the
launchers hand to ``build_app`` (its keyword arguments) or to every API process (it is pickled to them).

Imports only the standard library at module level (the multi-process supervisor imports it with its config).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
from dataclasses import dataclass, fields

from pdcluster.cluster.api.media_policy import MediaPolicy  # standard library only

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI (chat) and vLLM's default --max-logprobs


def json_flag(flag: str, value, hint: str = ""):
    """A flag's JSON value parsed (a value that is not a string is taken as parsed already); ValueError naming the
    flag, then ``hint``, when it is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"{flag}: not JSON ({e}){hint}") from None


def check_max_logprobs(value: int) -> int:
    if value < -1:
        raise ValueError(f"--max-logprobs: must be >= 0 (or -1: the whole vocabulary), got {value}")
    return value


@dataclass(frozen=True)
class CorsPolicy:
    """Which web pages' scripts may call the API from a browser (vLLM's --allowed-origins and its three siblings).
    Served only when origins are named: unlike vLLM (every origin by default), a page the user merely visits cannot
    drive a server on their machine unless told it may."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_flags(cls, origins, methods, headers, credentials: bool) -> CorsPolicy | None:
        """From the flags' JSON lists (ValueError naming the flag); None without --allowed-origins."""
        def strings(flag: str, value, default: tuple[str, ...]) -> tuple[str, ...]:
            if value is None:
                return default
            items = json_flag(flag, value, "; want a list such as '[\"http://localhost:3000\"]'")
            if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
                raise ValueError(f"{flag}: want a non-empty JSON list of strings, got {value!r}")
            return tuple(items)

        if origins is None:
            for flag, value in (("--allowed-methods", methods), ("--allowed-headers", headers)):
                if value is not None:
                    raise ValueError(f"{flag}: applies with --allowed-origins (no origin may call from a browser)")
            return None
        return cls(strings("--allowed-origins", origins, ()), strings("--allowed-methods", methods, ("*",)),
                   strings("--allowed-headers", headers, ("*",)), bool(credentials))


def _kv_role(kv_transfer_config: str) -> str:
    """--kv-transfer-config's kv_role ("" without one; serve_cli checked the JSON)."""
    if not kv_transfer_config:
        return ""
    from pdcluster.wire.external_kv import parse_config  # plain data, standard library and json only

    return parse_config(kv_transfer_config).role


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
    chat_template: str | None = None  # serve --chat-template's text, over the model directory's template
    default_chat_template_kwargs: dict | None = None  # under every request's chat_template_kwargs
    cors: CorsPolicy | None = None  # browser pages allowed to call (None: none)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs turns them off)
    max_logprobs: int = MAX_LOGPROBS  # alternatives per position a request may ask for (-1: the vocabulary)
    force_include_usage: bool = False  # every stream ends with its usage chunk
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" unless a request says otherwise
    kv_transfer: bool = False  # --kv-transfer-config given: requests' kv_transfer_params are served
    kv_role: str = ""  # its kv_role (SGLang's router's bootstrap fields: a prefill or a decode server)
    response_role: str = "assistant"  # vLLM's --response-role
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    server_load_tracking: bool = False  # vLLM's --enable-server-load-tracking: GET /load counts requests in flight
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers: X-Request-Id on every response
    metrics_prefix: str = "pdcluster"  # /metrics names: pdcluster:* or vllm:* (cluster/metrics.py METRIC_PREFIXES)
    otlp_traces_endpoint: str = ""  # vLLM's --otlp-traces-endpoint: a span per request (cluster/api/tracing.py)
    collect_detailed_traces: str = ""  # vLLM's --collect-detailed-traces: the span's children
    weight_updates: bool = False  # the RL routes: pause / resume and weight updates (cluster/api/weight_routes.py)
    # Where checkpoints a trainer broadcast are written for the workers to read (cluster/weights_from_trainer.py):
    # "" = the system's temporary directory; a directory every node sees on a multi-node cluster.
    weight_staging_dir: str = ""
    sleep_mode: bool = False  # vLLM's --enable-sleep-mode: /sleep, /wake_up and SGLang's pair (cluster/api/sleep_routes.py)
    # --served-model-name's names after the first (cluster/api/served_names.py): here, every API process gets them
    served_model_aliases: tuple[str, ...] = ()
    middleware: tuple[str, ...] = ()  # vLLM's --middleware: the operator's ASGI middleware (cluster/api/user_middleware.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace, runtime_lora: bool) -> ApiOptions:
        """From `serve`'s parsed flags (a flag another command lacks keeps its default)."""
        return cls(api_key=getattr(args, "api_key", None), max_body_bytes=getattr(args, "max_body_bytes", None),
                   tool_call_parser=getattr(args, "tool_call_parser", "auto"),
                   reasoning_parser=getattr(args, "reasoning_parser", None), runtime_lora=runtime_lora,
                   pooler=getattr(args, "pooler_config", None), media=getattr(args, "media_policy", None),
                   generation_config=getattr(args, "generation_config", "auto"),
                   override_generation_config=getattr(args, "override_generation_config", None),
                   chat_template=getattr(args, "chat_template", None),
                   default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None),
                   cors=getattr(args, "cors", None), fastapi_docs=not getattr(args, "disable_fastapi_docs", False),
                   max_logprobs=getattr(args, "max_logprobs", MAX_LOGPROBS),
                   force_include_usage=getattr(args, "enable_force_include_usage", False),
                   return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
                   kv_transfer=bool(getattr(args, "kv_transfer_config", "")),
                   kv_role=_kv_role(getattr(args, "kv_transfer_config", "")),
                   response_role=getattr(args, "response_role", "assistant"),
                   trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
                   server_load_tracking=getattr(args, "enable_server_load_tracking", False),
                   request_id_headers=getattr(args, "enable_request_id_headers", False),
                   metrics_prefix=getattr(args, "metrics_prefix", "pdcluster"),
                   otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", ""),
                   collect_detailed_traces=getattr(args, "collect_detailed_traces", ""),
                   weight_updates=getattr(args, "enable_weight_updates", False) or dev_mode_env(),
                   weight_staging_dir=getattr(args, "weight_staging_dir", ""),
                   sleep_mode=getattr(args, "enable_sleep_mode", False),
                   served_model_aliases=tuple(getattr(args, "served_model_aliases", ())),
                   middleware=tuple(getattr(args, "middleware", None) or ()))

    def app_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Variables the chat template gets from the server, which chat_template_kwargs (the request's or the server's
# defaults) cannot replace.
TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                               "raise_exception", "strftime_now"})
# vLLM's test for an inline template: a file name has none of these.
_TEMPLATE_CHARS = "{}\n"


def check_response_role(role: str) -> str:
    """--response-role: a non-empty name without spaces (a chat message's role); ValueError naming the flag."""
    if not isinstance(role, str) or not role or role != role.strip() or " " in role:
        raise ValueError(f"--response-role: want a role name such as 'assistant', got {role!r}")
    return role


def chat_template_text(value: str) -> str:
    """``serve --chat-template``'s value as vLLM reads it: the template itself (single-line form, ``\\n`` escapes
    decoded) when it holds a brace or a newline, else the path of a file holding it (ValueError if unreadable)."""
    if any(c in value for c in _TEMPLATE_CHARS):
        if "\\" in value and value.isascii():
            value = codecs.decode(value, "unicode_escape")
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template: {value!r} looks like a file name (no braces or newlines), but cannot be "
                         f"read: {e.strerror}") from None


def check_template_kwargs(kwargs, what: str) -> dict:
    """A JSON object of chat template variables that leaves the server's own alone (ValueError naming ``what``)."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{what}: want a JSON object of chat template variables, got {kwargs!r}")
    reserved = sorted(TEMPLATE_RESERVED & set(kwargs))
    if reserved:
        raise ValueError(f"{what}: {reserved} are set by the server; other variables are passed to the chat template")
    return kwargs


def dev_mode_env() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE=1, which serves its pause and weight routes: honoured as --enable-weight-updates."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true", "yes")
