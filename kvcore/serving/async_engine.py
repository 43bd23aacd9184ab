"""A thread-safe serving front over one :class:`~kvcore.Engine` (vLLM's ``AsyncLLM``, llama.cpp's slot loop).

One dedicated thread, the *engine loop*, owns the engine: it is the only thread that ever calls it.
Callers (any thread running an asyncio loop) hand it commands through a locked deque and get their
tokens back through one :class:`asyncio.Queue` per request, fed with ``loop.call_soon_threadsafe``::

    submit() ──► commands (deque + Condition) ──► engine loop: add/abort, Engine.step() ──► per-request
                                                                                           asyncio.Queue
The loop sleeps on the condition when there is nothing to do (no spinning), releases every request the
step it finishes (``Engine.release``: no state outlives a request), aborts a request whose stream is
closed early (a client that disconnected), and refuses new requests with :class:`QueueFullError` once
``max_num_seqs + max_queue_len`` are in flight. :meth:`AsyncEngine.health` says why it cannot serve: the
loop has died, a rank has ended, a step has run past ``step_watchdog_s``, or a model file changed in place.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kvcore.engine.core import Engine
from kvcore.errors import ConfigError, KVCoreError
from kvcore.interfaces.sampler import SamplingParams
from kvcore.scheduling.request import TokenEvent
from kvcore.serving.metrics import ServingMetrics
from kvcore.serving.stream import (
    END,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
    ServingStats,
    StreamEntry,
    serving_stats,
)

__all__ = ["AsyncEngine", "ServingStats", "RequestStream", "QueueFullError", "EngineDeadError"]

logger = logging.getLogger(__name__)

#: seconds one engine step may run before :meth:`AsyncEngine.health` reports the engine stalled
DEFAULT_STEP_WATCHDOG_S = 60.0


class AsyncEngine:
    """Serve one engine to many concurrent asyncio callers.

    :param engine: the engine; from now on only the loop thread may touch it.
    :param max_queue_len: requests allowed to wait beyond the ``max_num_seqs`` the engine runs at once;
        past that, :meth:`submit` raises :class:`QueueFullError`.
    :param metrics: where the loop records token counts, TTFT / TPOT and finish reasons.
    :param step_watchdog_s: a step running longer than this makes :meth:`health` fail (None: never).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue_len: int = 256,
        metrics: ServingMetrics | None = None,
        step_watchdog_s: float | None = DEFAULT_STEP_WATCHDOG_S,
    ) -> None:
        if max_queue_len < 0:
            raise ConfigError(f"max_queue_len must be >= 0, got {max_queue_len}")
        if step_watchdog_s is not None and not step_watchdog_s > 0:
            raise ConfigError(f"step_watchdog_s must be > 0 (or None: no watchdog), got {step_watchdog_s}")
        self.step_watchdog_s = step_watchdog_s
        self._step_started: float | None = None  # time.monotonic() when the running step began
        self.engine = engine
        self.metrics = metrics or ServingMetrics()
        self.max_in_flight = engine.config.max_num_seqs + max_queue_len
        self.error: BaseException | None = None  # why the loop died, when it did
        self._cv = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._unhandled: list[tuple] = []  # the commands taken from the queue and not yet handled (loop thread)
        self._num_in_flight = 0  # submitted and not yet ended; guarded by _cv
        self._stopping = False
        self._entries: dict[str, StreamEntry] = {}  # loop thread only
        self._owner: dict[str, StreamEntry] = {}  # sample id -> its request; loop thread only
        self._ids = itertools.count()
        self.stats = serving_stats(self.engine, 0)
        self._thread = threading.Thread(target=self._run, name="kvcore-engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (any thread) ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def health(self) -> str | None:
        """Why this front cannot serve now, or None: the loop has stopped, a tensor-parallel rank has
        ended, the running step has taken longer than ``step_watchdog_s``, or a model file the engine reads
        weights from was changed in place (:meth:`Engine.model_problem`). Cheap; any thread."""
        if not self.is_running:
            return self._dead_reason()
        started = self._step_started
        if started is not None and self.step_watchdog_s is not None:
            running = time.monotonic() - started
            if running > self.step_watchdog_s:
                return (f"the engine is stalled: its current step has run for {running:.1f} s, past the watchdog "
                        f"limit of {self.step_watchdog_s:g} s")
        return self.engine.runner.failure() or self.engine.model_problem()

    async def submit(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises what :meth:`Engine.add_request` raises for an invalid request (``InvalidRequestError``,
        ``ContextLengthError``), :class:`QueueFullError` when the server is full, :class:`EngineDeadError`
        when the loop has stopped. The request is aborted if the awaiting task is cancelled.
        """
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        num_prompt = 0 if isinstance(prompt, str) else len(prompt)
        stream = RequestStream(lambda rid: self._command(("abort", rid)), request_id, params, num_prompt)
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError(self._dead_reason())
            if self._num_in_flight >= self.max_in_flight:
                raise QueueFullError(f"the server is full ({self._num_in_flight} requests in flight, "
                                     f"limit {self.max_in_flight}); retry later")
            self._num_in_flight += 1
            self._commands.append(("add", stream, prompt, params, time.perf_counter()))
            self._cv.notify()
        try:
            accepted = await stream._queue.get()
        except BaseException:
            stream.abort()
            raise
        if isinstance(accepted, BaseException):
            stream.is_finished = True
            raise accepted
        stream.sample_ids = accepted
        return stream

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[tuple[int, TokenEvent]]:
        """``submit`` and iterate in one: yields ``(index, TokenEvent)``; aborts if left early."""
        async with await self.submit(prompt, params, request_id) as stream:
            async for item in stream:
                yield item

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop: requests still in flight end with :class:`EngineDeadError`. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _command(self, cmd: tuple) -> None:
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed and stopped serving: {type(self.error).__name__}: {self.error}"
        return "the server is shutting down"

    # -- the engine loop (its own thread) -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._stopping and not self.engine.has_unfinished():
                        self._cv.wait()  # idle: no spinning, woken by the next command
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                self._unhandled = commands  # what the finally below answers if a command kills the loop
                while self._unhandled:
                    self._handle(self._unhandled[0])
                    self._unhandled.pop(0)
                if stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
                self.stats = self._stats()
        except BaseException as exc:  # noqa: BLE001 - a dying loop must still end every stream
            logger.exception("kvcore engine loop failed")
            self.error = exc
        finally:
            with self._cv:
                self._stopping = True
                leftover = self._unhandled + list(self._commands)
                self._unhandled = []
                self._commands.clear()
            dead = EngineDeadError(self._dead_reason())
            registered = {id(entry.stream) for entry in self._entries.values()}
            for cmd in leftover:
                if cmd[0] == "add" and id(cmd[1]) not in registered:
                    self._reject(cmd[1], dead)
            for entry in list(self._entries.values()):
                self._end(entry, "abort", notify=dead)
            self.stats = self._stats()

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, stream, prompt, params, submit_time = cmd
            if stream.is_finished:  # aborted before the engine saw it
                self._reject(stream, None)
                return
            try:
                rid = self.engine.add_request(prompt, params, request_id=stream.request_id)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own, the loop serves on
                if not isinstance(exc, KVCoreError):
                    logger.exception("internal error while adding request %s", stream.request_id)
                self._reject(stream, exc)
                return
            sample_ids = list(self.engine.sample_ids(rid)) if hasattr(self.engine, "sample_ids") else [rid]
            entry = StreamEntry(stream, sample_ids, submit_time, index={sid: i for i, sid in enumerate(sample_ids)})
            self._entries[rid] = entry
            for sid in sample_ids:
                self._owner[sid] = entry
            if not stream._put(sample_ids):
                self._end(entry, "abort")
        elif cmd[0] == "abort":
            entry = self._entries.get(cmd[1])
            if entry is not None:
                self._end(entry, "abort")

    def _reject(self, stream: RequestStream, exc: BaseException | None) -> None:
        with self._cv:  # first, so a caller that sees the error can submit again at once
            self._num_in_flight -= 1
        if exc is not None:
            stream._put(exc)

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            events = self.engine.step()
        except Exception as exc:
            # The engine reports a request's own failure as an event; a step that raises is a bug or a broken
            # backend: fail the requests in flight (their blocks go back) and keep serving new ones.
            logger.exception("kvcore engine step failed; failing the requests in flight")
            failure = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
            for entry in list(self._entries.values()):
                self._end(entry, "error", notify=failure)
            return
        finally:
            self._step_started = None
        now = time.perf_counter()
        for event in events:
            entry = self._owner.get(event.request_id)
            if entry is None:
                continue
            if event.token_id is not None:
                entry.num_tokens += 1
                self.metrics.generation_tokens.inc()
                if entry.first_token_time is None:
                    entry.first_token_time = now
                    self.metrics.time_to_first_token.observe(now - entry.submit_time)
                entry.last_token_time = now
            alive = entry.stream._put((entry.index[event.request_id], event))
            if not alive:
                self._end(entry, "abort")
            elif event.finished:
                entry.num_finished += 1
                if event.error is not None:
                    entry.status = "error"
                if entry.num_finished == len(entry.sample_ids):
                    self._end(entry, entry.status)

    def _end(self, entry: StreamEntry, status: str, notify: BaseException | None = None) -> None:
        """Abort what is unfinished, release every sample, close the stream, count it (once)."""
        rid = entry.stream.request_id
        if self._entries.pop(rid, None) is None:
            return
        for i, sid in enumerate(entry.sample_ids):
            self._owner.pop(sid, None)
            try:
                self.engine.abort(sid)
                result = self.engine.release(sid)
            except KeyError:
                continue
            if i == 0:  # the prompt counts once; samples 1..n-1 share sample 0's prompt blocks
                self.metrics.prompt_tokens.inc(result.metrics.num_prompt_tokens)
                entry.stream.num_cached_tokens = result.metrics.num_cached_tokens
        m = self.metrics
        m.request_finished.labels(status=status).inc()
        m.e2e_latency.observe(time.perf_counter() - entry.submit_time)
        per_sample = entry.num_tokens / max(1, len(entry.sample_ids))
        if entry.first_token_time is not None and per_sample >= 2:
            m.time_per_output_token.observe((entry.last_token_time - entry.first_token_time) / (per_sample - 1))
        with self._cv:
            self._num_in_flight -= 1
        # Last, so that whoever reads the end of the stream sees the blocks back and the request counted.
        self.stats = self._stats()
        entry.stream._put(notify if notify is not None else END)

    def _stats(self) -> ServingStats:
        with self._cv:
            queued = sum(1 for c in self._commands if c[0] == "add")  # submitted, not yet handed to the engine
        return serving_stats(self.engine, queued)
