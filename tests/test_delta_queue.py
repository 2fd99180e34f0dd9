"""cluster/delta_queue.py: a stream's queue (one consumer, one loop) keeps order, wakes its consumer,
survives a cancelled get, and refuses a second consumer."""

import asyncio

import pytest

from pdcluster.cluster.delta_queue import DeltaQueue


def test_order_wake_and_cancel():
    async def main():
        q = DeltaQueue()
        q.put_nowait(1)
        q.put_nowait(2)
        assert q.qsize() == 2 and not q.empty()
        assert [await q.get(), await q.get()] == [1, 2] and q.empty()
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not getter.done()
        q.put_nowait(3)
        q.put_nowait(4)
        assert await asyncio.wait_for(getter, 1) == 3
        assert await q.get() == 4
        # A cancelled get leaves nothing behind: the next get waits and is woken as usual.
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        q.put_nowait(5)
        assert await asyncio.wait_for(q.get(), 1) == 5
        # A put that lands after the waiter was resolved but before it ran is not lost either.
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait(6)
        q.put_nowait(7)
        assert await getter == 6 and await q.get() == 7

    asyncio.run(main())


def test_one_consumer_only():
    async def main():
        q = DeltaQueue()
        first = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await q.get()
        q.put_nowait("x")
        assert await first == "x"

    asyncio.run(main())


def test_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        DeltaQueue()
