"""Router accounting for hybrid models: a transferred prompt holds its Mamba state's blocks on the
decode worker beside its KV (engine/mamba_state_blocks.py), so the router's view of the worker counts them."""

import asyncio

from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.placement import PairPlacement
from pdcluster.cluster.router.state import Attempt, RequestState
from pdcluster.engine.sampling_params import SamplingParams


def _request(request_id: str, prefill_id, num_prompt_tokens: int, num_computed_tokens: int = 0) -> RequestState:
    loop = asyncio.new_event_loop()
    r = RequestState(request_id, [1] * num_prompt_tokens, SamplingParams(), asyncio.Queue())
    r.attempt = Attempt(request_id, 0, "d0", prefill_id, num_prompt_tokens, loop.create_future(),
                        num_computed_tokens=num_computed_tokens)
    loop.close()
    return r


def test_state_blocks_count_on_the_decode_worker():
    placement = PairPlacement(RouterConfig())
    placement.add_worker("d0", "decode", num_blocks=100, block_size=16)
    placement.views["d0"].num_state_blocks = 3
    placement.refresh([_request("remote", "p0", 20)])
    assert placement.views["d0"].kv_tokens == (2 + 3) * 16  # prompt blocks + state blocks
    placement.refresh([_request("local", None, 20)])  # prefilled on the decode worker: no state blocks
    assert placement.views["d0"].kv_tokens == 20
    placement.refresh([_request("long", "p0", 20, num_computed_tokens=200)])  # the state blocks hold KV now
    assert placement.views["d0"].kv_tokens == 200
    placement.views["d0"].num_state_blocks = 0  # attention-only model: unchanged accounting
    placement.refresh([_request("remote", "p0", 20)])
    assert placement.views["d0"].kv_tokens == 20
