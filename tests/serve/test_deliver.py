"""`online.deliver`: a round's chunks reach their handlers' queues in order, with one wake-up of
each event loop (one hand-over to each sink) for the whole round."""

import asyncio
import threading
import types

from eagle_jax.serve import online


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the thread-safe calls made into it."""

    def __init__(self):
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def drain(loop, queue):
    async def items():
        found = []
        while not queue.empty():
            found.append(queue.get_nowait())
        return found
    return loop.run_until_complete(items())


def test_one_wakeup_per_loop_and_round_in_order():
    loops = [CountingLoop(), CountingLoop()]
    try:
        handles = [types.SimpleNamespace(sink=online.AsyncioSink(loops[i % 2]), queue=asyncio.Queue())
                   for i in range(5)]
        first = [(handle, online.Chunk([i, i + 1])) for i, handle in enumerate(handles)]
        second = [(handle, online.Chunk([10 + i])) for i, handle in enumerate(handles)] + [(handles[3], None)]
        for items in (first, second):  # from another thread, as the device loop calls it
            thread = threading.Thread(target=online.deliver, args=(items,))
            thread.start()
            thread.join()
        assert [loop.wakeups for loop in loops] == [2, 2]
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0))  # runs what the wake-ups scheduled
        for i, handle in enumerate(handles):
            expected = [online.Chunk([i, i + 1]), online.Chunk([10 + i])] + ([None] if i == 3 else [])
            assert drain(handle.sink.loop, handle.queue) == expected
        online.deliver([])
        assert [loop.wakeups for loop in loops] == [2, 2]  # nothing to hand over: no wake-up
    finally:
        for loop in loops:
            loop.close()
