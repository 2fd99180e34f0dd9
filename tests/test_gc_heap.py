"""engine/gc_heap.py: a serving process's start-up objects leave the cyclic collector's sight; a process that builds
engines one after another gives them back."""

from __future__ import annotations

import gc

import pytest

from pdcluster.engine import gc_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_objects_are_out_of_the_collectors_sight_until_given_back(unfrozen):
    """Inside ``frozen`` a dropped cycle made before it is not collected (the collector no longer walks it); on
    leaving it is given back and collected."""
    cycle = _Cycle()
    collected = []
    import weakref

    ref = weakref.ref(cycle, lambda _: collected.append(True))
    with gc_heap.frozen():
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert ref() is not None and not collected  # frozen: kept, never walked
    assert gc.get_freeze_count() == 0 and ref() is None and collected


def test_a_worker_actor_freezes_once_its_engine_is_built(monkeypatch, unfrozen):
    """node/actor.py: the Ray actor process (one engine for its life) freezes after making its worker."""
    from pdcluster.engine.config import EngineConfig
    from pdcluster.node import actor

    order = []
    monkeypatch.setattr(actor, "freeze_startup_objects", lambda: order.append("freeze"))

    class Worker(actor.WorkerActor):
        def make_worker(self, worker_id, engine_config, transfer):
            order.append("worker")
            return object()

    Worker("w0", EngineConfig(), None)
    assert order == ["worker", "freeze"]
