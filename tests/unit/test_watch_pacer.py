"""A view change wakes a thousand watches; the chief's loop wakes them a slice at a time, so a call
that arrives during the fan-out (a heartbeat) waits for one slice, not for every watcher (chief/aio.py)."""
import asyncio
import threading

import pytest

from shoal.chief.aio import WAKE_BATCH, _Pacer, _Waker


def run_fanout(watchers: int, wake_from_thread: bool) -> tuple[list, int]:
    """``watchers`` coroutines wait on their wakers; all are woken at once; the first one woken
    schedules a 'heartbeat' (a call that arrived meanwhile). Returns the order things ran in."""
    order: list = []

    async def main():
        loop = asyncio.get_running_loop()
        pacer = _Pacer(loop)
        wakers = [_Waker(pacer) for _ in range(watchers)]

        async def watch(i, w):
            await w.event.wait()
            order.append(i)
            if len(order) == 1:
                loop.call_soon(order.append, "heartbeat")
        tasks = [asyncio.create_task(watch(i, w)) for i, w in enumerate(wakers)]
        await asyncio.sleep(0)
        if wake_from_thread:        # the ticker thread expiring a member wakes them too
            t = threading.Thread(target=lambda: [w.set() for w in wakers])
            t.start()
            t.join()
        else:
            for w in wakers:
                w.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    asyncio.run(main())
    return order, order.index("heartbeat")


@pytest.mark.parametrize("from_thread", [False, True])
def test_a_call_arriving_during_a_fan_out_waits_for_one_slice_not_every_watcher(from_thread):
    order, hb = run_fanout(1000, from_thread)
    assert sorted(i for i in order if i != "heartbeat") == list(range(1000))     # every watch woken once
    assert hb <= 2 * WAKE_BATCH, f"the heartbeat ran after {hb} watchers"


def test_wakes_while_a_fan_out_runs_are_not_lost():
    """Watches woken from another thread while the pacer is between slices are all woken."""
    async def main():
        loop = asyncio.get_running_loop()
        pacer = _Pacer(loop, batch=3)
        events = [asyncio.Event() for _ in range(300)]
        done = threading.Event()

        def other():
            for e in events[100:]:
                pacer.wake(e)
            done.set()
        for e in events[:100]:
            pacer.wake(e)
        threading.Thread(target=other).start()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
        assert done.is_set() and not pacer._due and not pacer._scheduled
    asyncio.run(main())
