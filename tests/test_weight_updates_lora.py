"""Weight updates with LoRA adapters (engine/weight_update.py): the adapters stay, over the new base weights. Apart
from tests/test_weight_updates.py because the adapters are made with peft (which the GPU machine lacks)."""

from __future__ import annotations

from conftest import make_engine
from test_lora import adapters  # noqa: F401 - a fixture (peft-made adapters)
from test_weight_updates import PROMPTS, _params, checkpoints  # noqa: F401 - a fixture


def test_lora_adapters_stay_across_an_update(checkpoints, adapters):  # noqa: F811 - the fixture
    """The LoRA adapters a worker holds (at start-up and loaded since) stay across an update, now over the new base
    weights: base and adapter requests answer as a fresh engine on the checkpoint with the same adapters."""
    paths = adapters
    new_dir = checkpoints[("tiny-random", 1)]
    cfg = dict(lora_modules=(f"a1={paths['a1']}",), enable_lora=True)
    names = [None, "a1", "a2"]

    def run(e):
        return [e.generate([PROMPTS[1]], _params(lora_name=n))[0].token_ids for n in names]

    engine, fresh = make_engine("tiny-random", **cfg), make_engine(new_dir, **cfg)
    for e in (engine, fresh):
        e.load_lora("a2", paths["a2"])
    before = run(engine)
    engine.update_weights_from_disk(new_dir, "v1")
    want = run(fresh)
    assert before != want and len({tuple(t) for t in want}) == 3
    assert run(engine) == want
