"""`Run.outputs`, the loop every chat request reads the engine through, against a stand-in engine:
a cancellation (the client went away, `_guard` gave up) always ends the request and closes the
engine's generator, whenever it lands; the deadline ends it with TimeoutError. (On Python 3.11,
`asyncio.wait_for` swallowed a cancellation that landed as an output arrived: the request then
ran to max_tokens after its client had gone, found by tests/server/test_server.py under load.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from inferscale.server.chat import Run

N = 500  # outputs the stand-in engine would produce if nobody stopped it


class StepEngine:
    """An engine whose every output is ready one loop step after it is asked for, as vLLM's
    output queue is while a request decodes."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = False

    async def generate(self, prompt, params, rid):
        try:
            for i in range(N):
                await asyncio.sleep(0)
                self.produced += 1
                yield SimpleNamespace(outputs=[], finished=i == N - 1, num_cached_tokens=0)
        finally:
            self.closed = True


def _run(engine, deadline: float) -> Run:
    st = SimpleNamespace(engine=engine, metrics=MagicMock())
    prep = SimpleNamespace(prompt=[1, 2, 3], params=None, timings={"search": 0.0, "compose": 0.0},
                           injected_tokens=0, prompt_tokens=3, mode="none", policy=None)
    return Run(st, prep, "rid", 0.0, 0.0, deadline)


async def _consume(run: Run) -> int:
    n = 0
    async for _ in run.outputs():
        n += 1
    return n


def test_a_cancelled_request_stops_wherever_the_cancellation_lands():
    async def main():
        loop = asyncio.get_running_loop()
        for steps in range(1, 60):  # every phase of the read loop, output ready or not
            engine = StepEngine()
            task = asyncio.ensure_future(_consume(_run(engine, loop.time() + 60)))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.closed, steps
            assert engine.produced < N, steps

    asyncio.run(main())


def test_the_deadline_ends_the_request_with_timeout_error():
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):  # an engine that stalls after its first output
            await _consume(_run(SimpleNamespace(generate=_slow_generate), loop.time() + 0.2))
        # a deadline already past stops the request before its first output
        engine = StepEngine()
        with pytest.raises(TimeoutError):
            await _consume(_run(engine, loop.time() - 1))
        assert engine.produced == 0
        # one that is far off lets every output through
        engine = StepEngine()
        assert await _consume(_run(engine, loop.time() + 60)) == N

    asyncio.run(main())


async def _slow_generate(prompt, params, rid):
    yield SimpleNamespace(outputs=[], finished=False, num_cached_tokens=0)
    await asyncio.sleep(30)
    yield SimpleNamespace(outputs=[], finished=True, num_cached_tokens=0)
