"""ClusterRouter.deliver, the router contract's push form (the router process behind API processes streams
every token through it): deltas go from the event handler straight to the caller's callback. Over the real
event stream (zmq, the router's loop) from a scripted decode worker: no Ray, no engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdcluster.cluster.api.router_contract import RouterError, TokenDelta
from pdcluster.cluster.router import ClusterRouter, RouterConfig
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.node.event_pusher import EventPusher
from pdcluster.node.events import ADMITTED, Admission, Failed, StepTokens, Tokens

PROMPT = [5, 6, 7]


class _ScriptedDecode:
    """A decode worker's actor handle as the router uses it: ``submit`` admits at once (an Admission on
    the event stream), ``abort`` is recorded; the test sends the tokens. ``after_admission``: awaited after
    the Admission is sent, inside the submit call (it may raise: the actor died after admitting)."""

    def __init__(self, event_address: str, worker_id: str = "d0", after_admission=None):
        self.pusher = EventPusher(event_address)
        self.worker_id = worker_id
        self.aborted: list[str] = []
        self.submitted: list[str] = []
        outer = self

        class submit:  # noqa: N801 - Ray's handle.method.remote(...) shape
            @staticmethod
            def remote(wid, prompt, params, prefill_id):
                async def admit():
                    outer.submitted.append(wid)
                    outer.pusher(Admission(wid, outer.worker_id, ADMITTED))
                    if after_admission is not None:
                        await after_admission()
                return admit()

        class abort:  # noqa: N801
            @staticmethod
            def remote(wid):
                outer.aborted.append(wid)

        self.submit, self.abort = submit, abort

    def join(self, router) -> None:
        """Join ``router`` as a decode worker in rotation (64 blocks of 16), as the launcher adds a worker."""
        router.decode[self.worker_id] = self
        router.membership.add(self.worker_id, "decode", self, 64, 16, incarnation=f"i-{self.worker_id}")

    def step(self, rows: dict[str, list[int]], num_output_tokens: int) -> None:
        """One decode step's columnar event: each request's new tokens."""
        wids = list(rows)
        n = len(wids)
        self.pusher(StepTokens(worker_id=self.worker_id, request_ids=wids, num_new_tokens=[len(rows[w]) for w in wids],
                               new_token_ids=[t for w in wids for t in rows[w]],
                               num_computed_tokens=[len(PROMPT) + num_output_tokens] * n,
                               num_output_tokens=[num_output_tokens] * n, num_draft_tokens=[0] * n,
                               num_accepted_tokens=[0] * n, num_cached_tokens=[0] * n, num_offloaded_tokens=[0] * n))

    def last(self, wid: str, token: int, num_output_tokens: int) -> None:
        self.pusher(Tokens(request_id=wid, worker_id=self.worker_id, new_token_ids=[token],
                           num_computed_tokens=len(PROMPT) + num_output_tokens, num_output_tokens=num_output_tokens,
                           finished=True, finish_reason="length"))


@pytest.fixture
def cluster():
    router = ClusterRouter({}, {}, None, "m", max_model_len=128, block_size=16,
                           config=RouterConfig(health_interval_s=3600))  # the worker is a script, not an actor
    worker = _ScriptedDecode(router.event_address)
    worker.join(router)
    try:
        yield router, worker
    finally:
        worker.pusher.close()
        router.close()


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _placed(router: ClusterRouter, request_id: str, on_delta, max_tokens: int) -> asyncio.Future:
    """``router.deliver`` running, once the decode worker admitted the request."""
    task = asyncio.ensure_future(router.deliver(request_id, PROMPT, SamplingParams(max_tokens=max_tokens), on_delta))
    await _until(lambda: request_id in router.requests and router.requests[request_id].attempt is not None)
    return task


def test_deliver_streams_each_delta_to_the_callback_and_returns_after_the_last(cluster):
    router, worker = cluster
    got: list[TokenDelta] = []

    async def main():
        task = await _placed(router, "a", got.append, 3)
        worker.step({"a#1": [11]}, 1)
        worker.step({"a#1": [12]}, 2)
        await _until(lambda: len(got) == 2)
        assert not task.done()
        worker.last("a#1", 13, 3)
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert [d.new_token_ids for d in got] == [[11], [12], [13]]
    assert [d.finished for d in got] == [False, False, True] and got[-1].finish_reason == "length"
    assert got[0].ttft_breakdown and not got[1].ttft_breakdown  # the first delta carries the TTFT parts
    assert "a" not in router.requests and not worker.aborted


def test_generate_merges_the_deltas_a_slow_consumer_left_queued(cluster):
    """The pull form: deltas that arrived while the consumer was busy come out as one (one SSE chunk to the
    client), tokens in order, the last one's counts and end, the first delta's TTFT parts kept."""
    router, worker = cluster

    async def main():
        stream = router.generate("a", PROMPT, SamplingParams(max_tokens=5))
        first = asyncio.ensure_future(stream.__anext__())
        await _until(lambda: "a" in router.requests and router.requests["a"].attempt is not None)
        worker.step({"a#1": [11]}, 1)
        deltas = [await asyncio.wait_for(first, 10)]
        for n, token in enumerate((12, 13, 14), start=2):
            worker.step({"a#1": [token]}, n)
        worker.last("a#1", 15, 5)
        await _until(lambda: "a" not in router.requests)  # every delta is in the stream's queue
        deltas += [d async for d in stream]
        return deltas

    deltas = asyncio.run(main())
    assert [d.new_token_ids for d in deltas] == [[11], [12, 13, 14, 15]]
    assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 5
    assert deltas[0].ttft_breakdown and not worker.aborted


def test_rows_of_a_stream_under_way_reach_on_row_as_the_deltas_they_stand_for(cluster):
    """With ``on_row`` (the router process's frontend service), a step's row of a request whose first token went out
    is handed over as its parts, without a TokenDelta; the first and the last delta still come to ``on_delta``. What
    the consumer gets, the router's S1 mirror, its recorder's reports and the tokens it keeps for a recovery equal
    those of a request streamed by deltas alone, over the same steps. A row ``on_row`` declines (False) comes to
    ``on_delta`` as the same delta."""
    router, worker = cluster
    recorder = router.record()
    deltas: dict[str, list] = {"rows": [], "deltas": [], "declined": []}
    rows: dict[str, list] = {"rows": [], "deltas": [], "declined": []}

    def on_row(rid, accept=True):
        def take(token_ids, num_output_tokens, num_draft_tokens, num_accepted_tokens):
            rows[rid].append((list(token_ids), num_output_tokens, num_draft_tokens, num_accepted_tokens))
            return accept
        return take

    mirrors: dict[str, list[int]] = {rid: [] for rid in deltas}
    emitted: dict[str, list[int]] = {}

    async def main():
        tasks = {}
        for rid, take in (("rows", on_row("rows")), ("deltas", None), ("declined", on_row("declined", False))):
            tasks[rid] = asyncio.ensure_future(router.deliver(rid, PROMPT, SamplingParams(max_tokens=4),
                                                              deltas[rid].append, take))
            await _until(lambda: rid in router.requests and router.requests[rid].attempt is not None)
        for n, tokens in enumerate(([11], [12, 13], [14]), start=1):
            num_output = sum(len(t) for t in ([11], [12, 13], [14])[:n])
            worker.step({f"{rid}#1": tokens for rid in deltas}, num_output)
            await _until(lambda: all(len(deltas[r]) + len(rows[r]) >= n for r in ("rows", "deltas")))
            for rid in deltas:
                mirrors[rid].append(router.requests[rid].attempt.num_computed_tokens)
                emitted[rid] = list(router.requests[rid].emitted)
        for rid in deltas:
            worker.last(f"{rid}#1", 15, 5)
        await asyncio.wait_for(asyncio.gather(*tasks.values()), 10)

    asyncio.run(main())

    def as_parts(d: TokenDelta):
        return (d.new_token_ids, d.num_output_tokens, d.num_draft_tokens, d.num_accepted_tokens)

    assert [as_parts(d) for d in deltas["deltas"]] == [([11], 1, 0, 0), ([12, 13], 3, 0, 0), ([14], 4, 0, 0),
                                                      ([15], 5, 0, 0)]
    assert [d.new_token_ids for d in deltas["rows"]] == [[11], [15]] and deltas["rows"][-1].finished
    assert deltas["rows"][0].ttft_breakdown  # the first delta: its TTFT parts, its prompt count
    assert rows["rows"] == [as_parts(d) for d in deltas["deltas"][1:3]]
    assert [as_parts(d) + (d.finished,) for d in deltas["declined"]] == [
        as_parts(d) + (d.finished,) for d in deltas["deltas"]]
    assert rows["declined"] == rows["rows"]  # offered, and declined: they came as deltas
    assert deltas["rows"][0].num_prompt_tokens == deltas["deltas"][0].num_prompt_tokens == len(PROMPT)
    assert mirrors["rows"] == mirrors["deltas"] == [len(PROMPT) + 1, len(PROMPT) + 3, len(PROMPT) + 4]  # S1
    assert emitted["rows"] == emitted["deltas"] == [11, 12, 13, 14]  # what a recovery would re-prefill
    assert len(recorder.reports) == 3 * 4  # one per row and per last event, whichever path took the row
    assert sorted(rep.reported_computed_tokens for rep in recorder.reports) == sorted(
        [len(PROMPT) + n for n in (1, 3, 4, 5)] * 3)
    assert all(rep.reported_computed_tokens == rep.mirrored_computed_tokens for rep in recorder.reports)
    assert not router.requests and not worker.aborted


def test_a_callback_that_fails_costs_only_its_own_request(cluster):
    """Deltas are made inside the event handler: a callback that raises must not stop the other rows of
    the same step. Its own request ends (deliver raises it, the worker is told to abort)."""
    router, worker = cluster
    got_b: list[TokenDelta] = []

    def broken(delta):
        raise RuntimeError("consumer broke")

    async def main():
        a = await _placed(router, "a", broken, 2)
        b = await _placed(router, "b", got_b.append, 2)
        worker.step({"a#1": [21], "b#1": [31]}, 1)  # a's row first: its failure must not drop b's
        with pytest.raises(RuntimeError, match="consumer broke"):
            await asyncio.wait_for(a, 10)
        worker.last("b#1", 32, 2)
        await asyncio.wait_for(b, 10)

    asyncio.run(main())
    assert [d.new_token_ids for d in got_b] == [[31], [32]] and got_b[-1].finished
    assert worker.aborted == ["a#1"] and not router.requests


def test_cancelled_deliver_aborts_and_calls_back_no_more(cluster):
    """Cancelling (the frontend's abort after its grace, shutdown) ends the request on the worker; the
    router's own final 'abort' delta does not reach the callback: the canceller ends the stream itself."""
    router, worker = cluster
    got: list[TokenDelta] = []

    async def main():
        task = await _placed(router, "a", got.append, 8)
        worker.step({"a#1": [11]}, 1)
        await _until(lambda: len(got) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        worker.step({"a#1": [12]}, 2)  # late: the request is gone
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert [d.new_token_ids for d in got] == [[11]] and not got[0].finished
    assert worker.aborted == ["a#1"] and not router.requests


def test_a_request_that_cannot_be_placed_raises_before_any_delta(cluster):
    router, _ = cluster
    got: list[TokenDelta] = []

    async def main():
        with pytest.raises(RouterError, match="max_model_len"):
            await router.deliver("big", list(range(200)), SamplingParams(max_tokens=2), got.append)

    asyncio.run(main())
    assert got == []


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_worker_that_fails_after_admitting_is_placed_once(how):
    """The decode worker admits (its Admission is handled: the request is its), then, under the submit call,
    dies (Ray raises ActorDiedError there) or hangs past the admission timeout (then a probe finds it dead).
    Marking it down recovers what it held, and the placing loop that made the failed call goes on placing:
    between them the request must be placed once. Two placements would both stream; the router routes one,
    and the other's stays in its table for good (test_soak saw ``num_placements == 1`` after every request
    ended). Fails without submit.py's return after a recovery ("dies") or its clearing of the attempt
    ("hangs")."""
    router = ClusterRouter({}, {}, None, "m", max_model_len=128, block_size=16,
                           config=RouterConfig(health_interval_s=3600, admission_timeout_s=0.5))
    got: list[TokenDelta] = []
    spare = _ScriptedDecode(router.event_address, "d1")

    async def fail_after_admitting():
        await _until(lambda: "a" in router.requests and router.requests["a"].attempt is not None)
        spare.join(router)  # a healthy worker to place on, from now on
        if how == "hangs":
            await asyncio.sleep(30)  # past the admission timeout; the probe's ping then fails (no ping here)
        raise RuntimeError("ActorDiedError: the actor died unexpectedly")

    failing = _ScriptedDecode(router.event_address, "d0", after_admission=fail_after_admitting)
    failing.join(router)

    async def main():
        task = asyncio.ensure_future(router.deliver("a", PROMPT, SamplingParams(max_tokens=2), got.append))
        await _until(lambda: spare.submitted)
        await asyncio.sleep(0.5)  # a second placement, if any, is made by now
        assert len(spare.submitted) == 1, f"placed twice on the spare: {spare.submitted}"
        assert router.streams.num_placements == 1
        wid = spare.submitted[0]
        spare.step({wid: [11]}, 1)
        spare.last(wid, 12, 2)
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(main())
    finally:
        failing.pusher.close()
        spare.pusher.close()
        router.close()
    assert [t for d in got for t in d.new_token_ids] == [11, 12] and got[-1].finished
    assert not router.requests and router.streams.num_placements == 0


def _recovered_onto_a_spare(after_admission, num_placements_on_spare: int, tail: list[int]) -> list[TokenDelta]:
    """Stream a request of 3 tokens: the first (11) from decode worker d0, which is then marked down; the recovery
    goes to d1, whose submit calls run ``after_admission(spare, router)`` after admitting. Once d1 has been asked
    ``num_placements_on_spare`` times and the recovery is done, d1's last placement sends ``tail`` (its last token
    finishes the request). Returns the deltas streamed, after checking that no placement was left behind."""
    router = ClusterRouter({}, {}, None, "m", max_model_len=128, block_size=16,
                           config=RouterConfig(health_interval_s=3600))
    got: list[TokenDelta] = []
    first = _ScriptedDecode(router.event_address, "d0")
    first.join(router)
    spare = _ScriptedDecode(router.event_address, "d1", after_admission=lambda: after_admission(spare, router))

    async def main():
        task = asyncio.ensure_future(router.deliver("a", PROMPT, SamplingParams(max_tokens=3), got.append))
        await _until(lambda: first.submitted)
        first.step({first.submitted[0]: [11]}, 1)
        await _until(lambda: got)
        spare.join(router)
        router.mark_down("d0", "killed")
        r = router.requests["a"]
        await _until(lambda: len(spare.submitted) == num_placements_on_spare and not r.recovering)
        await asyncio.sleep(0.3)  # a further placement, if any, is made by now
        assert len(spare.submitted) == num_placements_on_spare, spare.submitted
        assert spare.aborted == spare.submitted[:-1]
        assert router.streams.num_placements == 1
        wid, num_output_tokens = spare.submitted[-1], 3 - len(tail)
        for token in tail[:-1]:
            num_output_tokens += 1
            spare.step({wid: [token]}, num_output_tokens)
        spare.last(wid, tail[-1], num_output_tokens + 1)
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(main())
    finally:
        first.pusher.close()
        spare.pusher.close()
        router.close()
    assert not router.requests and router.streams.num_placements == 0
    return got


def test_a_recovered_placement_streams_the_tokens_sent_before_its_placing_call_returned():
    """A recovery places the request again; the new decode worker admits it and its first tokens reach the router
    before Ray's reply to the submit call does (events and replies travel separately: a fast re-prefill, as a
    multimodal one on a tiny model, outruns the reply). Those tokens belong to the request's placement from its
    admission on and must be streamed: the CI run of 7fa8135 lost one (test_multimodal's decode-worker recovery
    streamed 39 of 40 tokens, the one at the kill missing) while the router still counted it in its prompt for the
    recovery. Fails with stream.py's ``current`` dropping events while the request is ``recovering``."""
    async def first_token_before_the_reply(spare, router):
        spare.step({spare.submitted[-1]: [12]}, 1)
        await asyncio.sleep(0.3)  # the router's loop handles the step before this call returns

    got = _recovered_onto_a_spare(first_token_before_the_reply, 1, tail=[13])
    assert [t for d in got for t in d.new_token_ids] == [11, 12, 13] and got[-1].finished
    assert got[-1].num_output_tokens == 3


def test_a_recovered_placement_that_fails_before_its_placing_call_returned_is_recovered_again():
    """As above, but the recovery's new placement fails (a Failed event: its KV never came) before Ray's reply to
    its submit: that failure is the request's and places it once more, and the stream ends whole. Dropped (as
    ``current`` did while the request was ``recovering``), the request would wait for tokens that never come until
    its deadline."""
    async def fail_once_before_the_reply(spare, router):
        if len(spare.submitted) == 1:
            spare.pusher(Failed(spare.submitted[-1], "d1", "the KV transfer failed"))
            await asyncio.sleep(0.3)  # the router's loop handles the failure before this call returns

    got = _recovered_onto_a_spare(fail_once_before_the_reply, 2, tail=[12, 13])
    assert [t for d in got for t in d.new_token_ids] == [11, 12, 13] and got[-1].finished
