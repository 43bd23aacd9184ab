"""The serving front (AsyncEngine) on its own: idle without spinning, no state left behind, bounded queue,
failures isolated, clean shutdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.errors import ContextLengthError, InvalidRequestError
from kvcore.serving import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"


@pytest.fixture(scope="module")
def tiny_engine():
    torch.set_num_threads(1)

    def make(**config) -> Engine:
        return Engine.from_pretrained(str(TINY), EngineConfig(backend="paged", **config))

    return make


async def tokens_of(front: AsyncEngine, prompt, max_new_tokens: int, **params) -> list[int]:
    out = []
    async for _, event in front.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params)):
        assert event.error is None
        if event.token_id is not None:
            out.append(event.token_id)
    return out


class CountingEngine:
    """Wraps an engine and counts how often the loop looks at it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.num_polls = 0

    def has_unfinished(self) -> bool:
        self.num_polls += 1
        return self._engine.has_unfinished()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_idle_loop_sleeps_and_wakes_for_work(tiny_engine):
    engine = CountingEngine(tiny_engine(max_num_seqs=2))
    front = AsyncEngine(engine)
    try:
        time.sleep(0.3)
        polls = engine.num_polls
        time.sleep(0.5)
        assert engine.num_polls == polls  # asleep on the condition: no polling while idle
        assert len(asyncio.run(tokens_of(front, "wake up", 5, ignore_eos=True))) == 5
    finally:
        front.close()
    assert not front._thread.is_alive()


def test_many_requests_leave_no_state_behind(tiny_engine):
    """A small soak: after hundreds of requests (some aborted) the engine holds nothing."""
    engine = tiny_engine(max_num_seqs=8)
    front = AsyncEngine(engine)

    async def run() -> None:
        async def one(i: int) -> None:
            leaves_early = i % 10 == 0  # every tenth client hangs up after a few tokens of a long answer
            max_new_tokens = 200 if leaves_early else 8 + i % 9
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            stream = await front.submit(f"request {i} " * (i % 7 + 1), params)
            async with stream:
                async for n, (_, _event) in enumerate_async(stream):
                    if leaves_early and n == 2:
                        break

        for _ in range(5):
            await asyncio.gather(*(one(i) for i in range(60)))

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while front.stats.num_kv_blocks_used or front.stats.num_requests_tracked:
            assert time.monotonic() < deadline, front.stats
            time.sleep(0.01)
        assert front._entries == {} and front._owner == {} and front._num_in_flight == 0
        assert front.metrics.request_finished.value(status="abort") == 30
        assert front.metrics.request_finished.value(status="ok") == 270
    finally:
        front.close()


async def enumerate_async(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def test_invalid_requests_raise_at_submit_and_do_not_count(tiny_engine):
    front = AsyncEngine(tiny_engine(max_num_seqs=1), max_queue_len=0)

    async def run() -> None:
        with pytest.raises(ContextLengthError):
            await front.submit([5] * 300, SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidRequestError):
            await front.submit("", SamplingParams(max_new_tokens=4))
        # the failed submissions took no room: the single slot is still free
        assert len(await tokens_of(front, "fine", 3, ignore_eos=True)) == 3

    try:
        asyncio.run(run())
    finally:
        front.close()


def test_queue_full_then_room_again(tiny_engine):
    front = AsyncEngine(tiny_engine(max_num_seqs=2), max_queue_len=1)  # 3 in flight at most

    async def run() -> None:
        streams = [await front.submit(f"p{i}", SamplingParams(max_new_tokens=50, ignore_eos=True)) for i in range(3)]
        with pytest.raises(QueueFullError):
            await front.submit("one too many", SamplingParams(max_new_tokens=2))
        streams[0].abort()
        for s in streams[1:]:
            assert len([e async for _, e in s if e.token_id is not None]) == 50
        assert len(await tokens_of(front, "again", 2, ignore_eos=True)) == 2

    try:
        asyncio.run(run())
    finally:
        front.close()


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(tiny_engine):
    engine = tiny_engine(max_num_seqs=4)
    front = AsyncEngine(engine)
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step

    async def run() -> None:
        with pytest.raises(EngineStepError, match="boom"):
            await tokens_of(front, "doomed", 20, ignore_eos=True)
        assert len(await tokens_of(front, "survivor", 6, ignore_eos=True)) == 6

    try:
        asyncio.run(run())
        assert front.stats.num_kv_blocks_used == 0
    finally:
        front.close()


def test_close_ends_open_streams_and_refuses_new_work(tiny_engine):
    engine = tiny_engine(max_num_seqs=2)
    real_step = engine.step
    engine.step = lambda: (time.sleep(0.01), real_step())[1]
    front = AsyncEngine(engine)

    async def run() -> None:
        stream = await front.submit("long", SamplingParams(max_new_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(front.close)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await front.submit("late", SamplingParams(max_new_tokens=2))

    asyncio.run(run())
    assert not front._thread.is_alive() and engine.kv.blocks.num_free_blocks == engine.kv.blocks.num_blocks
