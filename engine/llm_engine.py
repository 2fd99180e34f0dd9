"""The engine loop: scheduler + model runner + tokenizer. One object per worker."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.kv_cache import KVCacheSpec, allocate_kv_cache, num_blocks_for_budget
from pdcluster.engine.kv_connector import KVConnector
from pdcluster.engine.model import LlamaModel, ModelArch
from pdcluster.engine.model_registry import resolve_model
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.request import Request, RequestStatus
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.engine.warmup import warmup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InvalidRequestError(ValueError):
    """The request can never run (bad prompt, too long, ...). The message says why."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None, progress: bool = True):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir: Path = resolve_model(config.model, cache_dir=config.cache_dir or None, progress=progress)
        self.tokenizer = Tokenizer(self.model_dir)
        arch = ModelArch.from_dir(self.model_dir)
        self.arch = arch
        self.max_model_len = config.max_model_len or min(arch.max_position_embeddings, 4096)
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({arch.max_position_embeddings})"
            )
        dtype = DTYPES[config.dtype]
        self.model = LlamaModel.load(self.model_dir, dtype, self.max_model_len + config.num_spec_steps + 1)
        num_draft_layers = 0  # MTP layers are appended here by the speculative-decoding setup
        probe = KVCacheSpec(arch.num_layers + num_draft_layers, num_draft_layers, 1, config.block_size,
                            arch.num_kv_heads, arch.head_dim, dtype)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(probe.bytes_per_block, config.kv_cache_memory_gib)
        self.kv_spec = replace(probe, num_blocks=num_blocks)
        self.kv_cache = allocate_kv_cache(self.kv_spec, config.device)
        eos = set(arch.eos_token_ids) | set(self.tokenizer.stop_token_ids)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, eos)
        self.runner = ModelRunner(config, self.model, self.kv_cache, self.max_model_len, connector)
        self.warmup_batch_kinds = warmup(self.runner, num_blocks=num_blocks)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: give at least one token of text")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {self.arch.vocab_size}): {bad[:5]}")
        need = -(-(n + 1 + self.config.num_spec_steps) // self.config.block_size)
        if need > self.kv_spec.num_blocks:
            raise InvalidRequestError(
                f"prompt needs {need} KV blocks but the pool holds {self.kv_spec.num_blocks}"
            )

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        if params.seed is None:
            # Deterministic per engine seed and request order; the sampler keys draws by (seed, position).
            params = replace(params, seed=self._rng.randrange(1 << 31))
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, prompt_token_ids, params, arrival_time=time.monotonic())
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.runner.execute_model(sched)
        runner_output, _kv_output = self.runner.sample_tokens()
        outputs = []
        for result in self.scheduler.update_from_output(sched, runner_output):
            request = result.request
            text = self.tokenizer.decode(request.output_token_ids)
            finished = result.finished
            if request.sampling_params.stop:
                text, hit = _truncate_at_stop(text, request.sampling_params.stop)
                if hit is not None:
                    if not finished:
                        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, hit
                    finished = True
            outputs.append(self._output(request, text, finished, result.new_token_ids))
        return outputs

    def _output(self, request: Request, text: str, finished: bool, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            new_token_ids=new_token_ids,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams], max_steps: int = 1_000_000
    ) -> list[RequestOutput]:
        """Run the prompts to completion (offline batch). Outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        else:
            raise RuntimeError(f"generate() did not finish within {max_steps} steps")
        return [done[i] for i in ids]


def _truncate_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    best = None
    for s in stops:
        pos = text.find(s)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:
        return text, None
    return text[: best[0]], best[1]
