"""Tokenizer wrapper for a Hugging Face model directory: `tokenizers` for text <-> ids, a sandboxed
jinja2 environment (the same one transformers uses) for chat templates. No transformers import."""

from __future__ import annotations

import copy
import json
import os
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte -> the byte
    (printable ASCII and Latin-1 bytes stand for themselves; the other 68 take the code points from 256 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL_DECODER = _byte_level_decoder()
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (its `raise_exception`) or is missing or broken."""


class ContinueFinalMessageError(ChatTemplateError):
    """continue_final_message cannot be done for this conversation (its message says why)."""


def _token_content(value) -> str | None:
    # Older tokenizer_config.json files spell special tokens as {"content": "...", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def compile_chat_template(template: str, what: str):
    """``template`` compiled in transformers' environment (so it renders byte-identically): a sandbox, since a
    template is code; ChatTemplateError naming ``what`` if it does not compile."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    # transformers' tojson (argument order included): no HTML escaping, unlike jinja's own.
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{what} does not compile: {exc}") from exc


@lru_cache(maxsize=32)
def _request_template(template: str):
    """A request's own template compiled once: a client sends the same one with every request."""
    return compile_chat_template(template, "the request's chat_template")


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization, applied only when the directory asks for it.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class Tokenizer:
    """Text <-> token ids and chat rendering for the model in `model_dir`."""

    def __init__(self, model_dir: str | os.PathLike):
        from tokenizers import Tokenizer as _HFTokenizer

        self.model_dir = Path(model_dir)
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(self.model_dir)!r}")
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        self._config = self._read_json("tokenizer_config.json")
        self._generation_config = self._read_json("generation_config.json")
        self.bos_token = _token_content(self._config.get("bos_token"))
        self.eos_token = _token_content(self._config.get("eos_token"))
        self.pad_token = _token_content(self._config.get("pad_token"))
        self._clean_up_spaces = bool(self._config.get("clean_up_tokenization_spaces", False))
        # decode() then cleans up spaces over the whole text: a Detokenizer cannot decode in windows.
        self.cleans_up_spaces = self._clean_up_spaces
        self._default_template_kwargs: dict = {}  # use_chat_template's: under every render's own variables

    def _read_json(self, name: str) -> dict:
        path = self.model_dir / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    # ---------------------------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special-token strings in the text (e.g. "<|im_start|>") become their ids,
        as in transformers; `add_special_tokens` adds what the tokenizer's post-processor adds (BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of two texts as one input, as transformers' ``tokenizer(text, text_pair)`` gives them (the
        post-processor's pair template where ``add_special_tokens``: what a cross-encoder reads)."""
        return self._tok.encode(text, pair, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def vocab(self) -> dict[str, int]:
        """Every token (added ones too) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (OpenAI's logprobs ``bytes``): a byte-level BPE token
        that is part of a multi-byte character gives its own bytes (e.g. b"\\xf0\\x9f"), where decoding it
        alone gives U+FFFD; a SentencePiece token keeps its leading space. The tokens of a text give its
        UTF-8 back when their bytes are joined. Tokenizers of another kind: the token decoded alone."""
        token_id = int(token_id)
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_token_ids:
            return token.encode("utf-8")
        kind = self._byte_alphabet
        if kind == "byte_level":
            try:
                return bytes(_BYTE_LEVEL_DECODER[ch] for ch in token)
            except KeyError:  # not a byte-level spelling after all
                return token.encode("utf-8")
        if kind == "sentencepiece":
            byte = _SENTENCEPIECE_BYTE.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @cached_property
    def _byte_alphabet(self) -> str:
        """How a token's string spells its bytes, from the tokenizer's decoder: "byte_level" (GPT-2's
        printable stand-ins for the 256 bytes), "sentencepiece" ("\u2581" for a space, <0xNN> byte tokens),
        else "text"."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or [] if isinstance(d, dict)}
        if "ByteLevel" in kinds:
            return "byte_level"
        if kinds & {"ByteFallback", "Metaspace"}:
            return "sentencepiece"
        return "text"

    # ---------------------------------------------------------------------------------- special ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_for(self.bos_token, "bos_token_id")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_for(self.eos_token, "eos_token_id")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_for(self.pad_token, "pad_token_id")

    def _id_for(self, token: str | None, generation_key: str) -> int | None:
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        fallback = self._generation_config.get(generation_key)
        return fallback[0] if isinstance(fallback, list) else fallback

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos followed by generation_config's eos ids (a model may end a turn on any)."""
        extra = self._generation_config.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [] if extra is None else [extra]
        ids: list[int] = []
        for token_id in [self.eos_token_id, *extra]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
        return tuple(ids)

    # ---------------------------------------------------------------------------------- chat

    @cached_property
    def chat_template(self) -> str | None:
        template = self._config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = self.model_dir / "chat_template.jinja"  # newer HF directories keep it separately
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        json_file = self.model_dir / "chat_template.json"  # multimodal checkpoints: the processor's template
        if template is None and json_file.is_file():
            try:
                template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
            except (ValueError, AttributeError):
                template = None
        return template

    @cached_property
    def _compiled_template(self):
        if self.chat_template is None:
            raise ChatTemplateError(f"model directory {str(self.model_dir)!r} has no chat template")
        return compile_chat_template(self.chat_template, f"chat template of {str(self.model_dir)!r}")

    def use_chat_template(self, template: str | None = None, default_kwargs: dict | None = None) -> None:
        """Render chats with ``template`` in place of the model directory's (``serve --chat-template``), and with
        ``default_kwargs`` under every render's own variables (``--default-chat-template-kwargs``). A template that
        does not compile is a ChatTemplateError now, not at the first chat."""
        if template is not None:
            compiled = compile_chat_template(template, "--chat-template")
            self.__dict__["chat_template"], self.__dict__["_compiled_template"] = template, compiled
        self._default_template_kwargs = dict(default_kwargs or {})

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer rendering chats with ``template`` (a request's, vLLM's ``chat_template`` field under
        ``--trust-request-chat-template``), the server's left as it is: a shallow copy sharing the vocabulary.
        ChatTemplateError if it does not compile."""
        compiled = _request_template(template)
        view = copy.copy(self)
        view.__dict__["chat_template"], view.__dict__["_compiled_template"] = template, compiled
        return view

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **template_kwargs) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); ``tools`` (OpenAI function
        tools) for templates that render them, ``template_kwargs`` more variables (vLLM's
        chat_template_kwargs, e.g. Qwen3's enable_thinking).

        ``continue_final_message`` (transformers' and vLLM's): the text ends inside the final message, right after
        its content, without the template's end of turn, so that generation continues that message (an assistant
        reply started by the client). ChatTemplateError where it cannot: with ``add_generation_prompt``, a final
        message without text, or a template that does not write that text."""
        if continue_final_message:
            if add_generation_prompt:
                raise ContinueFinalMessageError("continue_final_message and add_generation_prompt cannot both be "
                                                "true: set add_generation_prompt to false to continue the final "
                                                "message")
            return _cut_at_mark(self.apply_chat_template(_marked(messages), False, tools, **template_kwargs))
        import jinja2

        try:
            template_kwargs = {**self._default_template_kwargs, **template_kwargs}
            # Templates are untrusted code: they see plain JSON data only, never caller objects.
            plain = json.loads(json.dumps({"messages": messages, "tools": tools, "kwargs": template_kwargs}))
            extra = plain["kwargs"]
            if plain["tools"] is not None:
                extra["tools"] = plain["tools"]
            return self._compiled_template.render(
                **extra,
                messages=plain["messages"],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # e.g. content that is not a string / not JSON
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


# Written after the final message's text, then cut off with everything after it (transformers 5's way, so both give
# the same prompt): where the template trims the message, the text before it is trimmed too.
_CONTINUE_MARK = "PDCLUSTER_CONTINUE_FINAL_MESSAGE "


def _marked(messages: list[dict]) -> list[dict]:
    """``messages`` with the mark after the final message's text (its last text part)."""
    final = dict(messages[-1]) if messages else {}
    content = final.get("content")
    text_parts = ([i for i, p in enumerate(content) if isinstance(p, dict) and isinstance(p.get("text"), str)]
                  if isinstance(content, list) else [])
    if isinstance(content, str) and content:
        final["content"] = content + _CONTINUE_MARK
    elif text_parts:
        parts = list(content)
        parts[text_parts[-1]] = {**parts[text_parts[-1]], "text": parts[text_parts[-1]]["text"] + _CONTINUE_MARK}
        final["content"] = parts
    else:
        raise ContinueFinalMessageError("continue_final_message: the final message has no text to continue")
    return [*messages[:-1], final]


def _cut_at_mark(rendered: str) -> str:
    at = rendered.rfind(_CONTINUE_MARK.strip())
    if at < 0:
        raise ContinueFinalMessageError("continue_final_message: the chat template does not write the final "
                                        "message's text, so there is no place to continue it from")
    if rendered.startswith(_CONTINUE_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's end: its trailing whitespace goes too


# ---------------------------------------------------------------------------------- output text


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string starts in ``text`` (at or after ``start``), and which one (the first
    listed on a tie)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def _stop_prefix_len(text: str, stops: list[str], end: int | None = None) -> int:
    """Length of the longest tail of ``text[:end]`` that is a proper prefix of a stop string."""
    end = len(text) if end is None else end
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, end), best, -1):
            if text.endswith(s[:k], 0, end):
                best = k
                break
    return best


class Detokenizer:
    """One request's output text, the single place where stop strings apply (the HTTP API streams
    through it; ``LLMEngine.generate`` builds offline outputs with it; the engine's step loop never
    decodes text).

    ``add`` hands out only the new, stable suffix of the output's text: it holds back an unfinished UTF-8
    character and any tail that could begin a stop string, so a stream never shows half a character or
    text at or past a stop string. ``text`` is the output so far, cut before the earliest stop string;
    once one appears, ``stop`` names it and ``text`` no longer grows. The final text is
    ``tokenizer.decode`` of the whole output.

    Decoding is incremental (vLLM's incremental detokenization): each token decodes a window of the
    tokens since the last clean character boundary, with the token before it as left context (a
    SentencePiece decoder strips a window's first space: the context absorbs that), so a token costs
    O(window), not O(output): decoding the whole output per token made a stream O(n^2) in the API
    process (1.4 ms a token at 8,000 tokens). tokenizers' own DecodeStream does the same walk but
    withholds the characters before a pending partial one, which the per-token offsets below need.
    Tokenizers that clean up spaces over the whole text (``clean_up_tokenization_spaces``) decode the
    whole output each time, as before.

    ``token_ends[i]``: characters of output text up to and including token i (stable characters only);
    ``token_complete[i]``: token i's text does not end inside a character (cluster/api/text.py aligns
    logprobs with the text by them).
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False):
        """``skip_special_tokens``: special tokens' text left out (the default, as vLLM); ``include_stop``: the
        text ends after the stop string rather than before it (vLLM's include_stop_str_in_output)."""
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.token_ids: list[int] = []
        self.text = ""
        self.num_sent = 0  # characters of ``text`` already handed out
        self.stop: str | None = None  # the stop string that ended the text, once one appeared
        self.token_ends: list[int] = []
        self.token_complete: list[bool] = []
        self._incremental = not getattr(tokenizer, "cleans_up_spaces", False)
        self._committed = ""  # text of token_ids[:_read], which ended on a character boundary
        self._context = 0  # the window's left context starts here (the token before _read)
        self._read = 0  # tokens before this are in _committed
        self._max_stop_len = max((len(s) for s in self.stops), default=0)

    @property
    def hit_stop(self) -> bool:
        return self.stop is not None

    def add(self, token_ids: list[int], final: bool) -> str:
        """Append ``token_ids``; return the text that is now safe to show (everything left when ``final``
        or a stop string appeared)."""
        if self.hit_stop:  # the text ended at the stop string: later tokens are not shown
            return ""
        # No stop string starts before this: the text so far had none (a partial character at its end
        # may still become anything).
        searched = max(0, len(self.text.rstrip("\ufffd")) - self._max_stop_len + 1)
        for token_id in token_ids:
            self.token_ids.append(token_id)
            text = self._step() if self._incremental else self._decode(self.token_ids)
            complete = not text.endswith("\ufffd")
            end = len(text) if complete else len(text.rstrip("\ufffd"))
            self.token_ends.append(max(end, self.token_ends[-1] if self.token_ends else 0))
            self.token_complete.append(complete)
        if final:  # exactly decode()'s text (an output may end inside a character)
            text, searched = self._decode(self.token_ids), 0
        found = find_stop(text, self.stops, searched) if self.stops and token_ids else None
        if found is not None:
            text, self.stop = text[: found[0] + (len(found[1]) if self.include_stop else 0)], found[1]
            final = True
        if token_ids or final:
            self.text = text
        text = self.text
        end = len(text)
        if not final:
            while end > self.num_sent and text[end - 1] == "\ufffd":  # an unfinished UTF-8 character
                end -= 1
            end -= _stop_prefix_len(text, self.stops, end)
        if end <= self.num_sent:
            return ""
        new, self.num_sent = text[self.num_sent : end], end
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self) -> str:
        """The output's text after the newest token (a partial character at its end shows as U+FFFD),
        decoding only the tokens since the last character boundary, after their left context."""
        decode = self._decode
        ids = self.token_ids
        context_text = decode(ids[self._context : self._read]) if self._read > self._context else ""
        window_text = decode(ids[self._context :])
        if window_text.startswith(context_text):
            pending = window_text[len(context_text) :]
        else:  # the context's text changed with what followed (not seen with local decoders): start over
            self._committed, self._context, self._read = "", 0, 0
            pending = decode(ids)
        text = self._committed + pending
        if pending and not pending.endswith("\ufffd"):  # a clean boundary: commit, the newest token is context
            self._committed, self._context, self._read = text, len(ids) - 1, len(ids)
        return text


