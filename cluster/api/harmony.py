"""gpt-oss's output format (OpenAI's "harmony"), read as vLLM's ``openai_gptoss`` reasoning parser reads it:
the chain of thought (channel ``analysis``) comes back as ``message.reasoning`` and the answer (channel ``final``)
as ``message.content``, the format's markers not shown.

A gpt-oss turn is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.

The prompt ends with ``<|start|>assistant``, so the first header is the channel alone. A header runs to
``<|message|>``; its ``<|channel|>`` names where the body goes; a body runs to ``<|end|>`` (another message
follows), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call). Bodies of ``analysis`` are
reasoning; of ``final`` and ``commentary`` (the preambles gpt-oss writes before calling tools) content.
The markers are special tokens: a request with this parser is detokenized with them kept (validation.py), as
vLLM keeps them for gpt-oss. An output with no marker at its start is all content (a model that does not
write harmony).

A tool call (a message whose header names a recipient, ``to=functions.get_weather``) goes to the content as the
harmony it is, header, body and ``<|call|>``: the tool-call parser ``openai`` (tool_parsers/openai_harmony.py)
reads it from there into ``tool_calls``.

The same interface as reasoning.ReasoningStream (``feed`` / ``finish``, a Split per piece), so the whole text and
the stream always agree: text that may be the start of a marker is held back until the next piece says.
"""

from __future__ import annotations

from pdcluster.cluster.api.reasoning_split import Split
from pdcluster.cluster.api.tool_parsers.base import held_prefix_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *BODY_ENDS)
REASONING_CHANNELS = ("analysis",)
CALL_MESSAGE = "to="  # the channel of a message with a recipient (a tool call), whatever its channel says


def _held_marker_len(text: str) -> int:
    """How much of the end of ``text`` may be the start of a marker."""
    return max(held_prefix_len(text, marker) for marker in MARKERS)


def _channel(header: str) -> str:
    """The channel a header names (``<|channel|>final``, ``<|channel|>commentary to=functions.f``); "" if none."""
    at = header.rfind(CHANNEL)
    if at < 0:
        return ""
    words = header[at + len(CHANNEL):].split()
    return words[0] if words else ""


class HarmonyStream:
    """One choice's gpt-oss output, piece by piece: ``feed`` returns what each piece adds to the reasoning and to
    the content; ``finish`` flushes what was held back."""

    def __init__(self):
        self._state = "start"  # start -> header <-> body, or start -> plain (no harmony)
        self._held = ""  # start / header: the header so far; body: text that may begin a marker
        self._channel = ""

    def feed(self, text: str) -> Split:
        self._held += text
        out = Split()
        while True:
            if self._state == "start":
                if not self._held:
                    return out
                if self._held.startswith((CHANNEL, START)):
                    self._state = "header"
                elif CHANNEL.startswith(self._held) or START.startswith(self._held):
                    return out  # "<|": a marker or not, the next piece says
                else:
                    self._state = "plain"
            if self._state == "plain":
                out.content += self._held
                self._held = ""
                return out
            if self._state == "header":
                at = self._held.find(MESSAGE)
                if at < 0:
                    return out  # the header is shown nowhere: keep it until its body starts
                header = self._held[:at]
                self._channel = CALL_MESSAGE if "to=" in header else _channel(header)
                if self._channel == CALL_MESSAGE:  # passed through whole, for the tool-call parser
                    out.content += header + MESSAGE
                self._held = self._held[at + len(MESSAGE):]
                self._state = "body"
            # body: up to the first end marker, else all but a possible marker's start
            ends = [(at, m) for m in BODY_ENDS if (at := self._held.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                self._emit(out, self._held[:at] + (marker if self._channel == CALL_MESSAGE else ""))
                self._held = self._held[at + len(marker):]
                self._state = "header"
                continue
            keep = _held_marker_len(self._held)
            self._emit(out, self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return out

    def _emit(self, out: Split, body: str) -> None:
        if self._channel in REASONING_CHANNELS:
            out.reasoning += body
        else:
            out.content += body

    def finish(self) -> Split:
        """The end of the output: a body's held-back text is what it was; an unfinished header is dropped (it
        is the format's, not the model's words), a lone start that never became a marker is content."""
        held, self._held = self._held, ""
        out = Split()
        if self._state == "body":
            self._emit(out, held)
        elif self._state in ("start", "plain"):
            out.content = held
        return out
