"""Prompts given as embeddings (vLLM's ``prompt_embeds``, SGLang's ``input_embeds``): a [num_tokens, hidden] tensor
that stands where the embedding table's rows of a prompt would.

A request carries them in ``SamplingParams.prompt_embeds`` (their raw bytes, dtype and shape, and a content
digest), so they go wherever the parameters go: the router, a prefill worker, a decode worker that recomputes the
prompt after a preemption or a recovery. The prompt's token ids are placeholders (``PLACEHOLDER_TOKEN_ID``, as
vLLM's) that only count positions: the step reads each prompt row's embedding from the request
(``rows_for_step``), never the table. Each block of rows is keyed by its digest in the block hashes
(engine/block_manager.py ``block_keys``), so the prefix cache shares a prefix of the same rows, never other rows
behind the same placeholder ids.

The rows are what the model's own embedding lookup gives (vLLM's ``embed_input_ids``; transformers'
``get_input_embeddings()(ids)``): what the model does after it (a Granite's embedding multiplier) applies to them
too, and for Gemma they carry the sqrt(hidden) scale as transformers' and vLLM's do.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import TYPE_CHECKING

from pdcluster.engine.multimodal.inputs import EMBED_DTYPES  # the element types carried; another is sent as float32

if TYPE_CHECKING:  # torch and numpy are imported where rows are made or read: SamplingParams imports this module
    import numpy as np
    import torch

PLACEHOLDER_TOKEN_ID = 0  # a prompt row's token id when the row is given as an embedding (vLLM's)


class PromptEmbeds(dict):
    """A checked ``SamplingParams.prompt_embeds``: {"dtype", "num_tokens": its rows, "hidden", "data", "digest",
    "spans": [[offset, length], ...]: where the rows stand in the prompt, in order (one span from 0 for a prompt
    given whole as embeddings; a chat's prompt_embeds parts stand between its template's tokens)}. A copy made by
    dataclasses.replace keeps this object (its digest not computed again); one that crossed msgpack or Ray arrives
    as a plain dict and is checked once there."""

    @property
    def num_tokens(self) -> int:
        return self["num_tokens"]

    @property
    def end(self) -> int:
        """The prompt position after the last row."""
        offset, length = self["spans"][-1]
        return offset + length

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(first position, end position, first row) of each run of rows within prompt positions ``start .. end``."""
        out, row = [], 0
        for offset, length in self["spans"]:
            lo, hi = max(offset, start), min(offset + length, end)
            if lo < hi:
                out.append((lo, hi, row + lo - offset))
            row += length
        return out

    def outside_rows(self, token_ids: list[int]) -> list[int]:
        """The tokens of ``token_ids`` (the prompt's first positions) that are no row's placeholder."""
        kept, last = [], 0
        for offset, length in self["spans"]:
            kept += token_ids[last:offset]
            last = offset + length
        return kept + token_ids[last:]

    def block_keys(self, block_size: int) -> list[bytes]:
        """A digest of each block's rows and their places in it (b"" for a block without rows), up to the last
        row's block, computed once per block size: what the prefix cache keys the blocks by besides their
        placeholder ids (engine/block_manager.py ``block_keys``), so a prefix of rows shared by two prompts is a
        hit, as vLLM's."""
        cached = self.__dict__.get("_block_keys")
        if cached is not None and cached[0] == block_size:
            return cached[1]
        width = self["hidden"] * EMBED_DTYPES[self["dtype"]]
        data, keys = memoryview(self["data"]), []
        for first in range(0, self.end, block_size):
            pieces = self.pieces(first, first + block_size)
            if not pieces:
                keys.append(b"")
                continue
            digest = hashlib.blake2b(self["dtype"].encode(), digest_size=16)
            for lo, hi, row in pieces:
                digest.update(f":{lo - first}:{hi - lo}:".encode())
                digest.update(data[row * width : (row + hi - lo) * width])
            keys.append(digest.digest())
        self.__dict__["_block_keys"] = (block_size, keys)
        return keys

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo .. hi`` (in the order given) as a CPU tensor of the request's dtype (a copy of those rows'
        bytes: the request's own are immutable)."""
        import torch

        width = self["hidden"] * EMBED_DTYPES[self["dtype"]]
        data = bytearray(memoryview(self["data"])[lo * width : hi * width])
        return torch.frombuffer(data, dtype=getattr(torch, self["dtype"])).view(hi - lo, self["hidden"])


def embeds_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _checked_rows(tensor, what: str):
    """``tensor`` as a contiguous CPU [num_tokens, hidden] tensor of a carried dtype, and that dtype's name."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a tensor of shape (num_tokens, hidden_size), got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} must be a dense tensor, got a {str(tensor.layout).removeprefix('torch.')} one")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(f"{what} must be a non-empty 2D tensor of shape (num_tokens, hidden_size); got shape "
                         f"{tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {str(tensor.dtype).removeprefix('torch.')}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in EMBED_DTYPES:
        tensor, dtype = tensor.float(), "float32"
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds a NaN or an infinity")
    return tensor.detach().to("cpu").contiguous(), dtype


def prompt_embeds_from_tensor(tensor: torch.Tensor, what: str = "prompt_embeds") -> PromptEmbeds:
    """A [num_tokens, hidden] floating tensor (or [1, num_tokens, hidden]) as a request's ``prompt_embeds``, the
    whole prompt; a ValueError naming ``what`` for anything else."""
    return prompt_embeds_from_pieces([tensor], [0], [what])


def prompt_embeds_from_pieces(tensors: list, offsets: list[int], names: list[str]) -> PromptEmbeds:
    """Runs of rows standing at prompt positions ``offsets`` (ascending, not overlapping) as one ``prompt_embeds``
    (a chat's prompt_embeds parts); a ValueError naming the piece (``names``) that is wrong. Pieces of different
    element types are carried as float32."""
    checked = [_checked_rows(t, name) for t, name in zip(tensors, names)]
    hidden = checked[0][0].shape[1]
    for (rows, _), name in zip(checked, names):
        if rows.shape[1] != hidden:
            raise ValueError(f"{name} is {rows.shape[1]} wide, but {names[0]} is {hidden}")
    dtypes = {dtype for _, dtype in checked}
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    spans, end = [], 0
    for (rows, _), offset in zip(checked, offsets):
        if offset < end:
            raise ValueError("prompt_embeds: runs of rows overlap or are out of order")
        spans.append([int(offset), int(rows.shape[0])])
        end = offset + rows.shape[0]
    import torch

    whole = torch.cat([rows.to(getattr(torch, dtype)) for rows, _ in checked])
    data = whole.view(torch.uint8).numpy().tobytes()
    return PromptEmbeds(dtype=dtype, num_tokens=int(whole.shape[0]), hidden=int(hidden), data=data,
                        digest=embeds_digest(data), spans=spans)


_FIELDS = {"dtype", "num_tokens", "hidden", "data", "digest", "spans"}


def check_prompt_embeds(value) -> PromptEmbeds:
    """``SamplingParams.prompt_embeds`` as a PromptEmbeds of the right types (it crosses msgpack and Ray)."""
    if isinstance(value, PromptEmbeds):
        return value
    if not isinstance(value, dict) or set(value) != _FIELDS:
        raise ValueError(f"prompt_embeds must be a dict with {', '.join(sorted(_FIELDS))}")
    dtype, num_tokens, hidden, data = value["dtype"], value["num_tokens"], value["hidden"], value["data"]
    if dtype not in EMBED_DTYPES:
        raise ValueError(f"prompt_embeds.dtype must be one of {', '.join(EMBED_DTYPES)}, got {dtype!r}")
    if not all(_positive(n) for n in (num_tokens, hidden)):
        raise ValueError("prompt_embeds: num_tokens and hidden must be positive integers")
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) != num_tokens * hidden * EMBED_DTYPES[dtype]:
        raise ValueError(f"prompt_embeds.data must be {num_tokens} x {hidden} {dtype} values")
    spans, end, total = value["spans"], 0, 0
    for span in spans if isinstance(spans, (list, tuple)) else [None]:
        if (not isinstance(span, (list, tuple)) or len(span) != 2 or not _positive(span[1])
                or not isinstance(span[0], int) or isinstance(span[0], bool) or span[0] < end):
            raise ValueError("prompt_embeds.spans must be [offset, length] pairs in order, not overlapping")
        end, total = span[0] + span[1], total + span[1]
    if not spans or total != num_tokens:
        raise ValueError(f"prompt_embeds.spans must place its {num_tokens} rows")
    data = bytes(data)
    if value["digest"] != embeds_digest(data):
        raise ValueError("prompt_embeds.digest does not match its data")
    return PromptEmbeds(dtype=dtype, num_tokens=num_tokens, hidden=hidden, data=data, digest=value["digest"],
                        spans=[[int(o), int(n)] for o, n in spans])


def _positive(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def rows_for_step(starts_np: np.ndarray, q_lens_np: np.ndarray, params_of_row, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed row indices [n] int64, embeddings [n, hidden] in ``dtype``) on ``device`` for the step's rows
    ``start .. start + q_len`` that are prompt rows given as embeddings (``params_of_row(i)``: row i's
    SamplingParams), or None when no row is."""
    import numpy as np
    import torch

    rows: list[np.ndarray] = []
    pieces: list[torch.Tensor] = []
    first = 0
    for i, (start, q_len) in enumerate(zip(starts_np.tolist(), q_lens_np.tolist())):
        embeds = params_of_row(i).prompt_embeds
        if embeds is not None and start < embeds.end:
            for lo, hi, row in embeds.pieces(start, start + q_len):
                rows.append(np.arange(first + lo - start, first + hi - start, dtype=np.int64))
                pieces.append(embeds.rows(row, row + hi - lo))
        first += q_len
    if not pieces:
        return None
    embeds = torch.cat([p.to(dtype) for p in pieces]).to(device, non_blocking=True)
    return torch.from_numpy(np.concatenate(rows)).to(device, non_blocking=True), embeds


PROMPT_EMBEDS_OFF = "prompt embeddings are off: start the server with --enable-prompt-embeds to send prompt_embeds"


def embeds_prompt(prompt: dict, params) -> tuple[list[int], object]:
    """vLLM's ``{"prompt_embeds": tensor}`` prompt as its placeholder ids and ``params`` carrying the embeddings
    (a ValueError naming what is wrong)."""
    if set(prompt) != {"prompt_embeds"}:
        raise ValueError(f"a prompt given as embeddings is {{'prompt_embeds': tensor}} alone; got {sorted(prompt)}")
    embeds = prompt_embeds_from_tensor(prompt["prompt_embeds"])
    return [PLACEHOLDER_TOKEN_ID] * embeds.num_tokens, replace(params, prompt_embeds=embeds)


def check_fits(prompt_token_ids: list[int], params, *, enabled: bool, takes_embeds: bool, hidden_size: int,
               model_name: str) -> None:
    """A request's prompt embeddings fit this engine and its prompt (checked on every worker, as images are: a bad
    request is an error for that request, not a failed step). A ValueError saying what does not."""
    embeds = params.prompt_embeds
    if embeds is None:
        return
    if not enabled:
        raise ValueError(PROMPT_EMBEDS_OFF)
    if not takes_embeds:
        raise ValueError(f"this model ({model_name}) does not take its prompt as embeddings")
    if embeds["hidden"] != hidden_size:
        raise ValueError(f"prompt_embeds hidden size {embeds['hidden']} does not match the model's hidden size "
                         f"{hidden_size}")
    # Token ids may follow the last row: a chat template's, a recovery's outputs so far, a beam search step's beam.
    if embeds.end > len(prompt_token_ids):
        raise ValueError(f"prompt_embeds places rows up to position {embeds.end} in a prompt of "
                         f"{len(prompt_token_ids)} tokens")
