"""Structured output at the API: ``response_format`` and forced ``tools`` become one grammar spec for
the engine (SamplingParams.structured_output, a JSON string engine/structured_output.py compiles), and
the text of a choice becomes ``message.tool_calls`` through a tool-call parser (cluster/api/tool_parsers/).

As vLLM:
- ``response_format`` ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` -> that schema (always enforced: ``strict`` is moot
  under a grammar).
- ``tool_choice`` {"type": "function", "function": {"name": f}} -> the text is f's arguments: the grammar
  is f's ``parameters`` schema.
- ``tool_choice`` "required" -> the text is a JSON array of at least one ``{"name": <one of the tools>,
  "parameters": <that tool's schema>}`` (one at most with ``parallel_tool_calls: false``).
- ``tool_choice`` "auto" (the default when tools are given) -> free text, read by the server's parser
  for the model's format (``pdcluster serve --tool-call-parser``; ``auto`` picks it from the chat
  template): the model answers in text or calls tools. With no parser for the model, refused with a 400.
- ``tool_choice`` "none" -> the tools are ignored.
- vLLM's ``structured_outputs`` {"json" | "regex" | "choice" | "grammar" | "json_object"} and its older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (EBNF in xgrammar's dialect):
  the same constraints; one constraint a request (two, or one with response_format or a forced tool, is a
  400 naming both).
Every tool choice streams: calls come as OpenAI ``delta.tool_calls`` (cluster/api/tool_parsers/stream.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdcluster.cluster.api.middleware import APIError
from pdcluster.cluster.api.protocol import NamedToolChoice, SamplingFields, short
from pdcluster.cluster.api.tool_parsers import NamedParser, RequiredParser, ToolParser

_EMPTY_OBJECT = {"type": "object", "properties": {}}
# Compiling a schema grows fast with its nesting (xgrammar: 0.04 s at 64 levels of "properties", 11 s at
# 400), and it runs here and on a worker: deeper schemas are refused. Real ones nest a handful of levels.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class ToolCalls:
    """The output may be tool calls: with ``parser`` (tool_choice "auto"), free text in the model's
    format; else forced, the arguments of the function ``name``, or (None) a JSON array naming them."""

    name: str | None
    parser: ToolParser | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1

    def reader(self) -> ToolParser:
        if self.parser is not None:
            return self.parser
        return NamedParser(self.name) if self.name is not None else RequiredParser()


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def structured_request(body: SamplingFields, tool_parser: ToolParser | None = None
                       ) -> tuple[str | None, ToolCalls | None]:
    """The grammar spec (a JSON string, or None for free text) and how to read the output.
    ``tool_parser``: the server's parser for tool_choice "auto" (None: the model has none)."""
    tool_spec, tool_calls = _tools_spec(body, tool_parser)
    specs = [(param, spec) for param, spec in (("tools", tool_spec), ("response_format", _response_format_spec(body)),
                                               *_vllm_specs(body)) if spec is not None]
    if len(specs) > 1:
        names = [("tool_choice 'required' or a named function" if p == "tools" else p) for p, _ in specs]
        raise _bad(specs[1][0], f"cannot be combined with {names[0]} (each constrains the output): send one of "
                                "them")
    if not specs:
        return None, tool_calls
    param, spec = specs[0]
    check_spec(spec, param)
    return spec, tool_calls


def _vllm_specs(body: SamplingFields) -> list[tuple[str, str | None]]:
    """vLLM's structured-output fields as (field, spec): ``structured_outputs`` {json | regex | choice | grammar |
    json_object} and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``."""
    so = body.structured_outputs
    out = []
    if so is not None:
        for key in ("structural_tag", "whitespace_pattern"):
            if getattr(so, key) is not None:
                raise _bad(f"structured_outputs.{key}", "is not supported (leave it out)")
        kinds = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None]
        if len(kinds) > 1:
            raise _bad("structured_outputs", f"give one constraint, got {[k for k, _ in kinds]}")
        if kinds:
            key, value = kinds[0]
            out.append((f"structured_outputs.{key}", _constraint_spec(f"structured_outputs.{key}", key, value)))
    if body.guided_whitespace_pattern is not None:
        raise _bad("guided_whitespace_pattern", "is not supported (leave it out): JSON is generated compact")
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            out.append((f"guided_{key}", _constraint_spec(f"guided_{key}", key, value)))
    return out


def _constraint_spec(param: str, kind: str, value) -> str:
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _bad(param, f"a schema given as a string must be JSON: {e}") from None
        if not isinstance(value, dict):
            raise _bad(param, f"must be a JSON schema object, got {short(value)}")
        _check_depth(value, param)
        return json.dumps({"type": "json_schema", "schema": value})
    if kind == "regex":
        return json.dumps({"type": "regex", "pattern": value})
    if kind == "grammar":
        return json.dumps({"type": "grammar", "grammar": value})
    if not value or not all(value):  # choice
        raise _bad(param, f"must be a non-empty list of non-empty strings, got {short(value)}")
    return json.dumps({"type": "choice", "choices": value})


def _response_format_spec(body: SamplingFields) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "json_object"})
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise _bad("response_format.json_schema", 'give the schema: {"type": "json_schema", "json_schema": '
                                                      '{"name": "...", "schema": {...}}}')
        _check_depth(fmt.json_schema.schema_, "response_format.json_schema.schema")
        return json.dumps({"type": "json_schema", "schema": fmt.json_schema.schema_})
    raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {fmt.type!r}")


def _tools_spec(body: SamplingFields, tool_parser: ToolParser | None) -> tuple[str | None, ToolCalls | None]:
    tools = getattr(body, "tools", None) or []  # chat only
    choice = getattr(body, "tool_choice", None)
    choice = choice if choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None, None
    if not tools:
        raise _bad("tool_choice", f"{_choice_text(choice)} needs tools: give tools or leave tool_choice out")
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        _check_depth(tool.function.parameters, f"tools[{i}].function.parameters")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _bad("tools", f"function names must be unique, {dupes[0]!r} appears {names.count(dupes[0])} times")
    if choice == "auto":
        if tool_parser is None:
            raise _bad("tool_choice", "'auto' (the default when tools are given) needs a tool-call parser, and "
                                      "this model's chat template does not show its format: start the server "
                                      "with --tool-call-parser hermes, llama3_json, pythonic, mistral or "
                                      "qwen3_coder, or send "
                                      "tool_choice 'required' or {\"type\": \"function\", \"function\": "
                                      "{\"name\": ...}} (or 'none')")
        single = 1 if getattr(body, "parallel_tool_calls", None) is False else None
        return None, ToolCalls(None, tool_parser.for_tools(tools), single)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise _bad("tool_choice.function.name", f"{name!r} is not one of the tools {names}")
        parameters = tools[names.index(name)].function.parameters or _EMPTY_OBJECT
        return json.dumps({"type": "json_schema", "schema": parameters}), ToolCalls(name)
    # "required": an array of calls, each naming one tool and giving its parameters.
    defs: dict[str, dict] = {}
    options = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _EMPTY_OBJECT)
        for def_name, def_schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, def_schema) != def_schema:
                raise _bad("tools", f"two tools define $defs {def_name!r} differently: rename one")
        options.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                       "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if getattr(body, "parallel_tool_calls", None) is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps({"type": "json_schema", "schema": schema}), ToolCalls(None)


def _check_depth(schema, param: str) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH (iterative: the schema may be very deep)."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _bad(param, f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep: flatten it "
                              "(or use $defs and $ref)")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _choice_text(choice) -> str:
    return f"tool_choice {choice!r}" if isinstance(choice, str) else "a named tool_choice"


def check_spec(spec: str, param: str) -> None:
    """Validate ``spec`` once, here, so a bad schema is a 400 naming the field (not an engine error)."""
    # xgrammar and the transformers it imports take ~4 s: loaded by the first request with a grammar,
    # not by every process that builds the app (or answers `pdcluster --help`).
    from pdcluster.engine.structured_output import StructuredOutputError
    from pdcluster.engine.structured_output import check_spec as engine_check_spec

    try:
        engine_check_spec(spec)
    except StructuredOutputError as e:
        raise _bad(param, str(e)) from e


def tool_calls_from_text(mode: ToolCalls, text: str) -> list[dict] | None:
    """``message.tool_calls`` for the output ``text``, or None when it holds no call (for a forced
    choice: when it does not parse as what the grammar allows, e.g. cut by max_tokens): the caller
    then answers with plain content."""
    return mode.reader().parse(text, mode.max_calls)[1] or None
