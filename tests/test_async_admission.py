"""``StreamHandle.abegin_turn``: waiting for a stream slot on an event loop holds no thread, shares the
first-come-first-served queue with the blocking callers, times out at the queue timeout, and a cancelled
wait leaves the queue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from service_helpers import wait_for


def test_async_waiters_hold_no_thread_and_keep_the_order(model):
    from engine.errors import CapacityError
    from engine.serving.scheduler import Scheduler

    queue_timeout = 2
    scheduler = Scheduler(model, slots=1, queue_timeout=queue_timeout)
    try:
        holder = scheduler.open_stream()
        holder.begin_turn(wait=0)

        async def run():
            threads_before = threading.active_count()
            order: list[str] = []
            handles = {name: scheduler.open_stream() for name in ("a", "b", "c", "d")}

            async def wait(name: str, timeout: float | None = 30):
                await handles[name].abegin_turn(wait=timeout)
                order.append(name)

            # 50 waiters that time out: no thread each, all in the queue at once (not one after another), and
            # each refusal comes at its queue timeout (a lower bound: no wall-clock margin a slow machine breaks)
            t0 = time.monotonic()
            async def all_queued() -> bool:           # on the loop: a probe thread would count as one
                while scheduler.stats().queued != 50:
                    await asyncio.sleep(0.01)
                return True

            saw, *refusals = await asyncio.gather(asyncio.wait_for(all_queued(), 30), *[
                scheduler.open_stream().abegin_turn() for _ in range(50)], return_exceptions=True)
            assert saw is True, saw
            assert all(isinstance(r, CapacityError) for r in refusals), refusals
            assert time.monotonic() - t0 >= queue_timeout - 0.01
            assert threading.active_count() <= threads_before
            # a blocking caller queued between async ones keeps its place
            async def queued(n: int) -> None:            # arrivals in order: each waits until it is in the queue
                await asyncio.to_thread(wait_for, lambda: scheduler.stats().queued == n, 10, f"{n} in the queue")

            tasks = [asyncio.create_task(wait("a"))]
            await queued(1)
            blocking = threading.Thread(target=lambda: (handles["b"].begin_turn(wait=30), order.append("b")))
            blocking.start()
            await queued(2)
            cancelled = asyncio.create_task(wait("c"))
            await queued(3)
            tasks.append(asyncio.create_task(wait("d")))
            await queued(4)
            cancelled.cancel()                       # a client that went away leaves the queue
            await queued(3)
            assert scheduler.stats().queued == 3
            current = holder
            for name in ("a", "b", "d"):
                current.close()
                deadline = time.monotonic() + 10
                while name not in order and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                current = handles[name]
            current.close()
            await asyncio.gather(*tasks)
            await asyncio.to_thread(blocking.join, 10)
            return order

        assert asyncio.run(asyncio.wait_for(run(), 60)) == ["a", "b", "d"]
        assert scheduler.stats().active == 0 and scheduler.stats().queued == 0
    finally:
        scheduler.stop()


def test_async_wait_ends_when_the_scheduler_stops(model):
    from engine.errors import CapacityError
    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=1, queue_timeout=60)
    holder = scheduler.open_stream()
    holder.begin_turn(wait=0)

    async def run():
        waiter = asyncio.create_task(scheduler.open_stream().abegin_turn())
        while scheduler.stats().queued != 1:           # in the queue (an event, not a sleep that load outlasts)
            await asyncio.sleep(0.01)
        await asyncio.to_thread(scheduler.stop)
        with pytest.raises(CapacityError):
            await asyncio.wait_for(waiter, 10)

    asyncio.run(run())
