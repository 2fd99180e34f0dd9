"""A tool-call parser over a stream: text pieces in, OpenAI chat ``delta`` objects out.

As OpenAI streams tool calls: a call's first delta has its ``index``, ``id``, ``type`` "function", the
``function.name`` and the arguments so far (sent once they have begun, so that a call whose arguments
are not an object never goes out); then deltas with the same ``index`` carry more
``function.arguments`` text. Text outside calls comes as ``content`` deltas. The deltas are the
differences between successive snapshots of the text so far (tool_parsers/base.py), and the last one
is the final snapshot, so for a well-formed output they add up to what ``parse`` gives the whole
output. A call that turns out malformed after its first delta went out cannot be taken back (as in
vLLM): the whole answer then shows it as text, the stream as a call.
"""

from __future__ import annotations

from pdcluster.cluster.api.tool_parsers.base import CallSnapshot, ToolParser, new_call_id


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""
        self._num_content = 0  # content characters sent
        self._arguments: list[str] = []  # per call sent: the arguments sent
        self._frozen = False  # the output stopped being what was sent: nothing more goes out
        self.num_final_calls = 0  # calls of the final snapshot (set by finish): "tool_calls" if any

    def feed(self, delta_text: str) -> list[dict]:
        """Deltas for ``delta_text`` (possibly none: text that may be a call is held back)."""
        if not delta_text:
            return []
        self.text += delta_text
        return self._diff(self.parser.snapshot(self.text, final=False))

    def finish(self) -> list[dict]:
        """The last deltas: what was held back, as text or calls."""
        snap = self.parser.snapshot(self.text, final=True)
        calls = snap.calls if self.max_calls is None else snap.calls[: self.max_calls]
        self.num_final_calls = len(calls)
        return self._diff(snap)

    def _diff(self, snap) -> list[dict]:
        if self._frozen or len(snap.calls) < len(self._arguments):
            self._frozen = True  # a call already sent turned out unfinished or malformed: it stays as sent
            return []
        out: list[dict] = []
        num_content, index = 0, 0
        for part in snap.parts:
            if isinstance(part, str):
                new = part[max(self._num_content - num_content, 0):] if num_content + len(part) > self._num_content else ""
                num_content += len(part)
                if new:
                    out.append({"content": new})
                    self._num_content = num_content
                continue
            if self.max_calls is not None and index >= self.max_calls:
                continue
            if part.name is None or not (part.arguments or part.done):
                break  # a call goes out once its name and the start of its arguments are there
            out.extend(self._call_deltas(index, part))
            index += 1
        return out

    def _call_deltas(self, index: int, call: CallSnapshot) -> list[dict]:
        if index == len(self._arguments):
            self._arguments.append(call.arguments)
            return [{"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                     "function": {"name": call.name, "arguments": call.arguments}}]}]
        sent = self._arguments[index]
        if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
            self._arguments[index] = call.arguments
            return [{"tool_calls": [{"index": index, "function": {"arguments": call.arguments[len(sent):]}}]}]
        return []
