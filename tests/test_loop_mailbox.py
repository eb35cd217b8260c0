"""LoopMailbox: events from other threads reach the loop in order, a burst costs one wake-up, a
closed loop raises for every post, and one failing callback keeps the others' events."""

from __future__ import annotations

import asyncio
import threading

import pytest

from forklm.runtime.engine.loop_mailbox import LoopMailbox, mailbox_for


def count_wake_ups(loop: asyncio.AbstractEventLoop) -> list[None]:
    """A list that grows by one per call_soon_threadsafe on `loop` from now on."""
    calls: list[None] = []
    real = loop.call_soon_threadsafe

    def counting(*args):
        calls.append(None)
        return real(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign, assignment]
    return calls


def test_events_from_threads_arrive_in_order_with_one_wake_up_per_burst():
    async def main() -> tuple[dict[int, list[int]], int]:
        loop = asyncio.get_running_loop()
        box = LoopMailbox(loop)
        wake_ups = count_wake_ups(loop)
        got: dict[int, list[int]] = {0: [], 1: []}
        burst = threading.Event()

        def producer(name: int) -> None:
            burst.wait()
            for i in range(500):
                box.post(got[name].append, i)

        threads = [threading.Thread(target=producer, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        burst.set()
        while any(t.is_alive() for t in threads) or sum(map(len, got.values())) < 1000:
            await asyncio.sleep(0.001)
        return got, len(wake_ups)

    got, wake_ups = asyncio.run(main())
    assert got == {0: list(range(500)), 1: list(range(500))}
    assert wake_ups < 1000  # bursts shared their wake-ups (one each when the loop was busy)


def test_a_burst_posted_before_the_loop_runs_is_one_drain():
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        box, seen = LoopMailbox(loop), []
        scheduled = count_wake_ups(loop)
        thread = threading.Thread(target=lambda: [box.post(seen.append, i) for i in range(16)])
        thread.start()
        thread.join()  # the loop has not run since: all 16 wait for one drain
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return seen, len(scheduled)

    seen, scheduled = asyncio.run(main())
    assert seen == list(range(16)) and scheduled == 1


def test_closed_loop_raises_for_every_post():
    loop = asyncio.new_event_loop()
    box = mailbox_for(loop)
    assert mailbox_for(loop) is box
    loop.close()
    for _ in range(3):
        with pytest.raises(RuntimeError):
            box.post(print, "never")


def test_failing_callback_keeps_the_other_events():
    async def main() -> tuple[list[int], list[dict]]:
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        box, seen = LoopMailbox(loop), []

        def bad(_: int) -> None:
            raise ValueError("boom")

        thread = threading.Thread(target=lambda: [box.post(seen.append, 1), box.post(bad, 2),
                                                  box.post(seen.append, 3)])
        thread.start()
        thread.join()
        await asyncio.sleep(0.01)
        return seen, errors

    seen, errors = asyncio.run(main())
    assert seen == [1, 3]
    assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)
