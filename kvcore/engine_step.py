"""One engine step: schedule → prepare → forward → sample → post-process, and how it fails safely.

Kept apart from :mod:`kvcore.engine` (construction and the request API); :class:`~kvcore.engine.Engine`
inherits :class:`EngineStep`.

Interruption safety: a request's progress is committed per request at the end of the step
(:meth:`EngineStep._advance`: computed tokens, the new token, its event, together). If an exception or
KeyboardInterrupt escapes anywhere, :meth:`EngineStep._recover` restores the invariants: every unfinished
request is running with exactly its computed tokens in the cache, or waiting without blocks (it is then
recomputed, which gives the same stream), and every KV sequence belongs to a running request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from kvcore.errors import BackendError, KVCoreError
from kvcore.model_runner import last_token_logits
from kvcore.request import EngineStats, FinishReason, Request, TokenEvent
from kvcore.sampling import sample_checked
from kvcore.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from kvcore.kv_manager import KVCacheManager
    from kvcore.outputs import TextOutput
    from kvcore.scheduler import Scheduler

__all__ = ["EngineStep"]


class EngineStep:
    kv: KVCacheManager
    scheduler: Scheduler
    stats: EngineStats
    model: Any
    sampler: Any
    prefill_backend: Any
    decode_backend: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    _requests: dict[str, Request]
    _guards: dict[int, Any]  # id(backend) -> its BackendGuard (kvcore/backend_check.py)
    compiled_decode: Any  # a kvcore.compile.CompiledDecode (EngineConfig.compile), else None
    lm_head: Any  # a kvcore.lm_head.RescoredInt4Head (EngineConfig.lm_head "int4"), else None (dense)
    _outputs: dict[str, TextOutput]
    _events: list[TokenEvent]  # made by the current step (or an interrupted one) and not yet returned

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Run one forward of the scheduled rows; returns the events it made (one per sampled token, and one
        per request that failed)."""
        try:
            scheduled = self.scheduler.schedule()
            for req, error in scheduled.failed:
                self._finish(req, FinishReason.ERROR, error)
            if scheduled.batch is not None:
                self.stats.num_steps += 1
                self._execute(scheduled.batch)
        except BaseException:
            self._recover()
            raise
        events, self._events = self._events, []
        return events

    def _execute(self, batch: ScheduledBatch) -> None:
        """Forward and sample one batch; a KVCoreError fails its requests (a mixed batch is first retried
        split by phase, so the failure lands on the rows that cause it), every other request untouched."""
        reqs = batch.requests
        backend = self.prefill_backend if batch.is_prefill else self.decode_backend
        sampling = [i for i, s in enumerate(batch.samples) if s]
        try:
            meta = self.kv.prepare([r.seq_id for r in reqs], batch.query_lens, self.model.attention_scale,
                                   self.model.attention_layers)
        except KVCoreError as exc:  # reserve() is all or nothing: nothing to roll back
            return self._fail(reqs, exc)
        try:
            if self.runner is not None:  # tensor parallelism: every rank runs its shard of this step
                logits = self.runner.forward(
                    batch.is_prefill, backend, self.kv.cache, meta, batch.input_ids, self.kv.last_copies, sampling
                )
            else:
                guard = self._guards.get(id(backend))
                logits = last_token_logits(
                    self.model, backend, self.kv.cache, meta, batch.input_ids, sampling, guard, self.compiled_decode,
                    self.lm_head,
                )
        except Exception as exc:
            error = exc if isinstance(exc, KVCoreError) else BackendError(
                f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            return self._failed(batch, error)
        if self.kv.blocks.enable_prefix_caching:
            for req, n in zip(reqs, batch.query_lens):  # their K/V are written now: shareable
                self.kv.blocks.commit(req.seq_id, req.all_ids[: req.num_computed_tokens + n])
        # n > 1: a leader finishing its prompt samples for its whole group from the same logits row
        rows, index = [], []
        for j, i in enumerate(sampling):
            group = [reqs[i]] + [c for c in reqs[i].pending_samples if not c.is_finished]
            rows += group
            index += [j] * len(group)
        next_ids, logprobs = [], []
        try:
            if rows:  # a step of partial prefill chunks only samples nothing
                logits = logits[torch.tensor(index, device=logits.device)] if len(index) != len(sampling) else logits
                self._suppress_eos(rows, logits)
                next_ids, logprobs = sample_checked(self.sampler, logits, rows)
        except KVCoreError as exc:
            return self._failed(batch, exc)
        self.stats.num_prefill_tokens += sum(n for n, d in zip(batch.query_lens, batch.is_decode) if not d)
        self.stats.num_decode_tokens += sum(batch.is_decode)
        tokens = {id(r): (t, lp) for r, t, lp in zip(rows, next_ids, logprobs)}
        for req, n in zip(reqs, batch.query_lens):
            if req.pending_samples and id(req) in tokens:
                self._fork(req, n, tokens)  # before the leader's token: it may finish and free its blocks
            self._advance(req, n, tokens.get(id(req)))

    def _failed(self, batch: ScheduledBatch, error: KVCoreError) -> None:
        """A forward or the sampler failed after the batch was reserved: roll the reservation back; a batch
        mixing decode and prefill rows is run again as two batches, one per phase, else its requests fail."""
        reqs = batch.requests
        for req in reqs:  # the slots the failed call reserved hold nothing valid
            self.kv.blocks.truncate(req.seq_id, req.num_computed_tokens)
        if not (batch.is_prefill and any(batch.is_decode)):
            return self._fail(reqs, error)
        for phase in (True, False):
            rows = [i for i, d in enumerate(batch.is_decode) if d == phase]
            q = [batch.query_lens[i] for i in rows]
            self._execute(ScheduledBatch([reqs[i] for i in rows], q, [phase] * len(rows)))

    def _fail(self, reqs: list[Request], error: KVCoreError) -> None:
        for req in reqs:
            self._finish(req, FinishReason.ERROR, error)

    def _fork(self, leader: Request, num_new: int, tokens: dict[int, tuple[int, Any]]) -> None:
        """Give the leader's samples 1..n-1 its prompt blocks (shared, copy-on-write) and their first tokens."""
        children, leader.pending_samples = leader.pending_samples, []
        for child in children:
            if child.is_finished or id(child) not in tokens:
                continue
            child.seq_id = self.scheduler.new_seq_id()
            self.kv.fork_sequence(leader.seq_id, child.seq_id)
            self.scheduler.running.append(child)
            child.metrics.num_cached_tokens = leader.num_computed_tokens + num_new
            self.stats.num_cached_tokens += leader.num_computed_tokens + num_new
            self._advance(child, leader.num_computed_tokens + num_new, tokens[id(child)])

    def _suppress_eos(self, reqs: list[Request], logits: torch.Tensor) -> None:
        # ignore_eos suppresses EOS (llama.cpp --ignore-eos, transformers min_new_tokens): the stream then
        # holds exactly max_new_tokens real tokens instead of EOS followed by noise.
        banned_rows = [i for i, r in enumerate(reqs) if r.params.ignore_eos]
        if banned_rows and self.eos_token_ids:
            rows = torch.tensor(banned_rows, device=logits.device)[:, None]
            cols = torch.tensor(sorted(self.eos_token_ids), device=logits.device)[None, :]
            logits[rows, cols] = float("-inf")

    def _advance(self, req: Request, num_computed: int, sampled: tuple[int, Any] | None) -> None:
        """Commit one row: ``num_computed`` more tokens are in the cache, and (when it sampled) the new token,
        its text and its event."""
        req.num_computed_tokens += num_computed
        if sampled is None:
            return
        token_id, lp = sampled
        req.output_ids.append(token_id)
        if lp is not None:
            req.logprobs.append(lp[0])
            req.top_logprobs.append(lp[1])
        self.stats.num_generated_tokens += 1
        m = req.metrics
        m.num_generated_tokens = len(req.output_ids)
        if m.first_token_time is None:
            m.first_token_time = time.perf_counter()
        m.kv_bytes = max(m.kv_bytes, self.kv.kv_bytes_in_use(req.seq_id))
        reason = req.stop_reason_after(token_id, self.max_model_len)
        out = self._outputs.get(req.request_id)
        text, hit = out.push(token_id, reason is not None) if out is not None else ("", False)
        reason = FinishReason.STOP if hit else reason
        req.finish_reason = reason  # with the token: an interrupted _finish cannot make it run on
        top = lp[1] if lp is not None else None
        self._events.append(TokenEvent(req.request_id, token_id, text, reason, None, lp[0] if lp else None, top))
        if reason is not None:
            self._finish(req, reason, emit=False)

    def _finish(self, req: Request, reason: FinishReason, error: KVCoreError | None = None, emit: bool = True) -> None:
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        self.stats.num_finished_requests += 1
        self.scheduler.remove(req)
        # n > 1 samples that waited for this one's prefill now prefill on their own
        for child in reversed(req.pending_samples):
            if not child.is_finished:
                self.scheduler.waiting.appendleft(child)
        req.pending_samples = []
        if emit:
            self._events.append(TokenEvent(req.request_id, None, "", reason, error))

    def _recover(self) -> None:
        """Restore the scheduler's invariants after an exception escaped a step (see the module docstring)."""
        sched, blocks = self.scheduler, self.kv.blocks
        waiting_for_fork = {id(c) for r in self._requests.values() if not r.is_finished for c in r.pending_samples}
        running: list[Request] = []
        for req in sched.running:
            if req.is_finished or req in running:
                continue
            seq = req.seq_id
            if seq is not None and blocks.has_sequence(seq) and blocks.seq_len(seq) == req.num_computed_tokens:
                running.append(req)
            else:  # its last forward did not complete: recompute it
                sched.preempt(req)
        sched.running = running
        queued = {id(r) for r in running} | waiting_for_fork
        waiting = []
        for req in [*sched.waiting, *self._requests.values()]:
            if req.is_finished or id(req) in queued:
                continue
            queued.add(id(req))
            req.seq_id, req.num_computed_tokens = None, 0
            waiting.append(req)
        sched.waiting.clear()
        sched.waiting.extend(waiting)
        owned = {r.seq_id for r in running}
        for seq in blocks.seq_ids:
            if seq not in owned:
                blocks.free_sequence(seq)
        for req in self._requests.values():
            if req.is_finished:
                req.seq_id, req.pending_samples = None, []
                req.metrics.finish_time = req.metrics.finish_time or time.perf_counter()
