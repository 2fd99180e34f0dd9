"""Beam search as vLLM serves it (``LLM.beam_search``, ``use_beam_search`` in its OpenAI API): the search
itself, apart from whoever runs the model steps (``LLMEngine.beam_search`` offline, cluster/api/beam.py
through a router).

Each step asks the model, once per live beam, for one token with the ``2 * beam_width`` most likely
continuations (``step_params``): every beam + continuation is a candidate, a candidate ending in an end
token is complete, and the ``beam_width`` best of the others are the next step's beams. At the end the
``beam_width`` best of the complete and live beams are the answer. "Best" is vLLM's score:
``cum_logprob / len(tokens) ** length_penalty``, where ``tokens`` counts the prompt too and an end token
is not counted. The model steps are whole requests (prompt + beam so far, one new token), so the prefix
cache serves what beams share; the scores are the model's raw log-probabilities (engine/logprobs.py).

The search is a state machine, so a synchronous and an asynchronous driver share it; ``BeamSearches`` runs
several prompts' searches as one batch a step:
``while batch := searches.pending(): searches.advance([run(tokens) for _, tokens in batch])``, then
``searches.best(decode)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.wire.logprobs import TokenLogprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (``include_stop_str_in_output`` aside: beam search stops on end tokens only)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    # Alternatives each returned token's record holds (the API's logprobs); the search itself always looks at
    # the 2 x beam_width most likely, so this never changes which beams win.
    num_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs!r}")

    def step_params(self, request: SamplingParams | None = None) -> SamplingParams:
        """One model step of one beam: a token and the 2 x beam_width most likely continuations. From the
        request's own parameters it keeps what says where and how it runs (adapter, cache salt, priority, seed,
        the prompt's images or its rows given as embeddings),
        not the sampling filters (vLLM's beam search ignores them: the scores are raw log-probabilities)."""
        keep = {} if request is None else dict(lora_name=request.lora_name, lora_digest=request.lora_digest,
                                                cache_salt=request.cache_salt, priority=request.priority,
                                                seed=request.seed, mm_inputs=request.mm_inputs,
                                                prompt_embeds=request.prompt_embeds)
        return SamplingParams(max_tokens=1, temperature=self.temperature,
                              logprobs=max(2 * self.beam_width, self.num_logprobs), ignore_eos=True, **keep)


@dataclass
class Beam:
    """One hypothesis: the prompt's tokens and then the output's (``tokens[num_prompt_tokens:]``)."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token
    finish_reason: str | None = None  # "stop" (an end token) or "length", once the search ended
    text: str = ""  # the output's text, set by the driver that returns the beam

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


def beam_score(beam: Beam, end_token_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the prompt counts in the length, an end token does not."""
    seq_len = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in end_token_ids else 0)
    return beam.cum_logprob / (seq_len ** length_penalty)


def continuations(record: TokenLogprobs, num_top: int) -> list[tuple[int, float]]:
    """(token, logprob) of the step's sampled token and its ``num_top`` most likely alternatives, each token once
    (vLLM's logprobs dict: the top-k and the sampled token, which at a temperature may be outside them)."""
    seen: dict[int, float] = dict(zip(record.top_token_ids[:num_top], record.top_logprobs[:num_top]))
    seen.setdefault(record.token_id, record.logprob)
    return list(seen.items())


class BeamSearch:
    """The search for one prompt."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, end_token_ids: frozenset[int]):
        self.params = params
        self.end_token_ids = frozenset() if params.ignore_eos else frozenset(end_token_ids)
        self.beams = [Beam(list(prompt_token_ids), len(prompt_token_ids))]
        self.completed: list[Beam] = []
        self.num_steps = 0

    @property
    def live(self) -> bool:
        return bool(self.beams) and self.num_steps < self.params.max_tokens

    def pending(self) -> list[list[int]]:
        """The token sequences to run one step on, one per live beam, in beam order."""
        return [beam.tokens for beam in self.beams] if self.live else []

    def advance(self, records: list[TokenLogprobs]) -> None:
        """One step: ``records[i]`` is the logprob record of the token generated after ``pending()[i]``."""
        if len(records) != len(self.beams):
            raise ValueError(f"beam search: {len(records)} step results for {len(self.beams)} beams")
        candidates: list[Beam] = []
        for beam, record in zip(self.beams, records):
            for token_id, logprob in continuations(record, 2 * self.params.beam_width):
                picked = TokenLogprobs(token_id, logprob, _rank(record, token_id), record.top_token_ids,
                                       record.top_logprobs)
                child = Beam(beam.tokens + [token_id], beam.num_prompt_tokens, beam.cum_logprob + logprob,
                             beam.logprobs + [picked])
                if token_id in self.end_token_ids:
                    child.finish_reason = "stop"
                    self.completed.append(child)
                else:
                    candidates.append(child)
        self.beams = sorted(candidates, key=self._key, reverse=True)[: self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[Beam]:
        """The answer: the beam_width best of the completed and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.completed + self.beams, key=self._key, reverse=True)
        return ranked[: self.params.beam_width]

    def _key(self, beam: Beam) -> float:
        return beam_score(beam, self.end_token_ids, self.params.length_penalty)


class BeamSearches:
    """The searches of several prompts run together: a step's pending sequences of all of them as one batch
    (``pending``), its records handed back in that order (``advance``)."""

    def __init__(self, searches: list[BeamSearch]):
        self.searches = searches
        self._counts: list[int] = []

    def pending(self) -> list[tuple[int, list[int]]]:
        """(the search's index, a sequence to run one step on) for every live beam of every search."""
        batches = [search.pending() for search in self.searches]
        self._counts = [len(batch) for batch in batches]
        return [(i, tokens) for i, batch in enumerate(batches) for tokens in batch]

    def advance(self, records: list[TokenLogprobs]) -> None:
        """``records``: one per sequence of the last ``pending()``, in its order."""
        if len(records) != sum(self._counts):
            raise ValueError(f"beam search: {len(records)} step results for {sum(self._counts)} beams")
        start = 0
        for search, count in zip(self.searches, self._counts):
            if count:
                search.advance(records[start:start + count])
            start += count

    def best(self, decode) -> list[list[Beam]]:
        """Per search, its answer (``BeamSearch.best``), each beam's text ``decode(output token ids)``."""
        results = [search.best() for search in self.searches]
        for beams in results:
            for beam in beams:
                beam.text = decode(beam.output_token_ids)
        return results


def _rank(record: TokenLogprobs, token_id: int) -> int:
    if token_id == record.token_id:
        return record.rank
    return record.top_token_ids.index(token_id) + 1
