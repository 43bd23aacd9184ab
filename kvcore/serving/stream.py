"""The caller's side of a served request: its async stream of token events, and the serving errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcore.errors import KVCoreError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.scheduling.request import TokenEvent

if TYPE_CHECKING:
    from kvcore.engine.core import Engine

__all__ = [
    "RequestStream", "StreamEntry", "ServingStats", "serving_stats", "QueueFullError", "EngineDeadError",
    "EngineStepError", "END",
]


class QueueFullError(KVCoreError):
    """The server already holds as many requests as it may queue; the client should retry later."""


class EngineStepError(KVCoreError):
    """An engine step raised; the requests in that step failed with it, and the engine goes on serving."""


class EngineDeadError(KVCoreError):
    """The engine loop has stopped (the server is shutting down, or the engine failed); nothing can run."""


@dataclass(frozen=True)
class ServingStats:
    """A snapshot the engine loop publishes after every step (read from any thread)."""

    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests waiting in the engine, plus submitted ones not yet handed to it
    num_kv_blocks_total: int = 0  # KV-cache blocks (slots, for a per-sequence layout)
    num_kv_blocks_used: int = 0
    num_requests_tracked: int = 0  # requests the engine still holds state for (0 when idle: nothing leaks)
    engine_counters: tuple[tuple[str, int], ...] = ()  # the engine's monotonic counters (Engine.stats)


END = object()  # queue item: the request is over (every sample finished, or it was aborted)


class RequestStream:
    """The async side of one request: iterate it for ``(index, TokenEvent)``, ``index`` in ``range(n)``.

    It ends after every sample's finishing event. Leaving it early (``abort()``, ``async with`` exit, or a
    cancelled task) aborts the request in the engine and frees its KV blocks.
    """

    def __init__(
        self, abort: Callable[[str], None], request_id: str, params: SamplingParams, num_prompt_tokens: int
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.sample_ids: list[str] = []  # the engine's id of each sample (set when the engine accepts it)
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served (set when the request ends)
        self.is_finished = False
        self._abort = abort  # tells the engine thread to abort a request id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def _put(self, item: object) -> bool:
        """Called from the engine loop thread; False when the caller's event loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the event loop was closed: nobody is listening any more
            return False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if self.is_finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is END:
            self.is_finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        return item

    def abort(self) -> None:
        """Stop the request now (no-op once it has ended). Safe to call from a ``finally`` while cancelled."""
        if not self.is_finished:
            self.is_finished = True
            self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()


def serving_stats(engine: Engine, num_queued: int) -> ServingStats:
    """The gauges and counters of ``engine`` as the server reports them; ``num_queued`` requests not yet handed
    to it."""
    now = engine.gauges()
    return ServingStats(
        num_running=now.num_running,
        num_waiting=now.num_waiting + num_queued,
        num_kv_blocks_total=now.num_kv_blocks,
        num_kv_blocks_used=now.num_kv_blocks - now.num_kv_blocks_free,
        num_requests_tracked=now.num_requests_held,
        engine_counters=tuple(engine.stats.as_dict().items()),
    )


@dataclass
class StreamEntry:
    """Engine-loop-side state of one request."""

    stream: RequestStream
    sample_ids: list[str]
    submit_time: float
    index: dict[str, int] = field(default_factory=dict)
    num_finished: int = 0
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    status: str = "ok"  # "error" once any sample failed
