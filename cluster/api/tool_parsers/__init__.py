"""Tool-call parsers: a model's free text -> content and OpenAI ``tool_calls``, whole or streamed.

One format a file (``hermes``, ``llama3_json``, ``pythonic``, ``mistral``, ``qwen3_coder``, ``openai`` (gpt-oss's
harmony); ``forced`` reads
the grammar-constrained outputs of tool_choice "required" and a named function), all behind base.py's
``ToolParser``;
stream.py turns any of them into OpenAI stream deltas. ``pdcluster serve --tool-call-parser NAME``
picks one for tool_choice "auto"; ``auto`` (the default) picks from the chat template, see
``parser_for_template``.
"""

from __future__ import annotations

from pdcluster.cluster.api.tool_parsers.base import Snapshot, ToolParser
from pdcluster.cluster.api.tool_parsers.forced import NamedParser, RequiredParser
from pdcluster.cluster.api.tool_parsers.hermes import HermesParser
from pdcluster.cluster.api.tool_parsers.llama3_json import Llama3JsonParser
from pdcluster.cluster.api.tool_parsers.mistral import MistralParser
from pdcluster.cluster.api.tool_parsers.openai_harmony import OpenAIHarmonyParser
from pdcluster.cluster.api.tool_parsers.pythonic import PythonicParser
from pdcluster.cluster.api.tool_parsers.qwen3_coder import Qwen3CoderParser
from pdcluster.cluster.api.tool_parsers.stream import ToolCallStream

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser,
                                                             MistralParser, Qwen3CoderParser, OpenAIHarmonyParser)}
PARSER_CHOICES = ("auto", *PARSERS)

__all__ = ["PARSERS", "PARSER_CHOICES", "NamedParser", "RequiredParser", "Snapshot", "ToolCallStream",
           "ToolParser", "parser_for_template", "select_parser"]


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template shows, where that is unambiguous; None otherwise.

    - it writes Qwen3-Coder's ``<function=`` blocks -> qwen3_coder;
    - it writes harmony's ``<|channel|>`` and addresses ``functions.`` (gpt-oss) -> openai;
    - it mentions ``[TOOL_CALLS]`` (Mistral's) -> mistral;
    - it mentions ``<tool_call>`` -> hermes;
    - it mentions ``<|python_tag|>``, or is a Llama 3 template (``<|start_header_id|>``) that asks for
      ``"parameters"`` -> llama3_json;
    - a ChatML template (``<|im_start|>``) without a tools section -> hermes: the ChatML models that
      call tools (Hermes, Qwen, SmolLM2) write ``<tool_call>`` blocks;
    - anything else -> None: tool_choice "auto" is refused until the server is started with
      ``--tool-call-parser`` (pythonic output looks like code a model may well write as its answer, so
      it is never guessed).
    """
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<|channel|>" in template and "functions." in template:
        return "openai"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3_json"
    if "<|im_start|>" in template:
        return "hermes"
    return None


def select_parser(name: str, template: str | None) -> ToolParser | None:
    """The parser ``--tool-call-parser name`` means for a model with this chat template."""
    if name == "auto":
        name = parser_for_template(template)
        if name is None:
            return None
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not one of {list(PARSER_CHOICES)}")
    return PARSERS[name]()
