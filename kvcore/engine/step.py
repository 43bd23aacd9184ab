"""One engine step: the scheduler's batch → the runner's forward → the sampler → outputs, and how it
fails safely.

Kept apart from :mod:`kvcore.engine.core` (construction and the request API); :class:`~kvcore.engine.core.Engine`
inherits :class:`EngineStep`. The request lifecycle (queues, blocks, forks, recovery) is the scheduler's;
the step only reads requests and commits their progress.

Interruption safety: a request's progress is committed per request at the end of the step
(:meth:`EngineStep._advance`: computed tokens, the new token, its event, together). If an exception or
KeyboardInterrupt escapes anywhere, :meth:`~kvcore.scheduling.scheduler.Scheduler.recover` restores the
invariants.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcore.engine.verify import SpeculativeStep
from kvcore.errors import BackendError, GrammarError, KVCoreError, ModelFileChangedError, NonFiniteRowsError
from kvcore.execution.runner import Executor
from kvcore.interfaces.attention import AttentionBackend
from kvcore.interfaces.layer_attention import LayerAttention
from kvcore.interfaces.sampler import Sampler
from kvcore.loaders.watched import model_file_problem
from kvcore.model.decoder import LlamaModel
from kvcore.sampling.sampler import sample_checked
from kvcore.sampling.structured import apply_grammar_masks, dead_end
from kvcore.scheduling.batch import ScheduledBatch
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.request import EngineStats, FinishReason, Request, TokenEvent
from kvcore.scheduling.scheduler import Scheduler
from kvcore.text.outputs import TextOutput

__all__ = ["EngineStep"]


class EngineStep(SpeculativeStep):
    kv: KVCacheManager
    scheduler: Scheduler
    stats: EngineStats
    runner: Executor
    model: LlamaModel
    attention_layers: tuple[LayerAttention, ...]  # the model's, with the engine's attention variants bound
    sampler: Sampler
    prefill_backend: AttentionBackend
    decode_backend: AttentionBackend
    eos_token_ids: frozenset[int]
    max_model_len: int
    _requests: dict[str, Request]
    _outputs: dict[str, TextOutput]
    _events: list[TokenEvent]  # made by the current step (or an interrupted one) and not yet returned
    grammars: Any  # a kvcore.sampling.structured.GrammarCompiler, or None (no tokenizer)

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
        problem = self.model_problem()
        if problem is not None:  # the weights are no longer those loaded, or no longer there: run nothing on them
            return self._fail(batch.requests, ModelFileChangedError(problem))
        if self.speculator is not None:
            self.speculator.release(self.scheduler.waiting)  # preempted requests start again when they decode
            if not batch.is_prefill and self._speculate(batch):
                return  # a speculative step (kvcore.engine.verify)
        reqs = batch.requests
        backend = self.prefill_backend if batch.is_prefill else self.decode_backend
        sampling = [i for i, s in enumerate(batch.samples) if s]
        try:
            meta = self.kv.prepare([r.seq_id for r in reqs], batch.query_lens, self.model.attention_scale,
                                   self.attention_layers)
        except KVCoreError as exc:  # reserve() is all or nothing: nothing to roll back
            return self._fail(reqs, exc)
        try:
            logits = self.runner.forward(
                batch.is_prefill, backend, self.kv.cache, meta, batch.input_ids, self.kv.last_copies, sampling
            )
        except NonFiniteRowsError as exc:  # only some sequences are not finite: they fail, the others go on
            batch, sampling, logits = self._drop_rows(batch, sampling, exc)
            reqs = batch.requests
        except Exception as exc:
            error = exc if isinstance(exc, KVCoreError) else BackendError(
                f"backend '{backend.name}' failed: {type(exc).__name__}: {exc}")
            return self._failed(batch, error)
        self.scheduler.commit(reqs, batch.query_lens)  # their K/V are written now
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
                apply_grammar_masks(logits, rows, self.grammars)
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

    def model_problem(self) -> str | None:
        """Why the model can no longer run, or None: a file its weights, or a draft model's, are read from as it
        runs was truncated or written to in place (:mod:`kvcore.loaders.watched`). One ``fstat`` per such file;
        any thread."""
        return model_file_problem(self.model, *(self.speculator.models if self.speculator is not None else ()))

    def _drop_rows(
        self, batch: ScheduledBatch, sampling: list[int], error: NonFiniteRowsError
    ) -> tuple[ScheduledBatch, list[int], torch.Tensor]:
        """Fail the sequences ``error`` names (their reservation rolled back) and return the rest of the
        batch, its sampling rows and their logits, as if only they had run."""
        bad = set(error.seq_indices)
        for i in sorted(bad):
            req = batch.requests[i]
            self.kv.truncate(req.seq_id, req.num_computed_tokens)
            self._finish(req, FinishReason.ERROR, error)
        keep = [i for i in range(len(batch.requests)) if i not in bad]
        position = {old: new for new, old in enumerate(keep)}
        kept_rows = [j for j, i in enumerate(sampling) if i not in bad]
        logits = error.logits[torch.tensor(kept_rows, dtype=torch.long, device=error.logits.device)]
        rest = ScheduledBatch([batch.requests[i] for i in keep], [batch.query_lens[i] for i in keep],
                              [batch.is_decode[i] for i in keep])
        return rest, [position[sampling[j]] for j in kept_rows], logits

    def _failed(self, batch: ScheduledBatch, error: KVCoreError) -> None:
        """A forward or the sampler failed after the batch was reserved: roll the reservation back; a batch
        mixing decode and prefill rows is run again as two batches, one per phase, else its requests fail."""
        reqs = batch.requests
        self.scheduler.roll_back(reqs)
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
            self.scheduler.fork(leader, child)
            child.metrics.num_cached_tokens = leader.num_computed_tokens + num_new
            self.stats.num_cached_tokens += leader.num_computed_tokens + num_new
            self._advance(child, leader.num_computed_tokens + num_new, tokens[id(child)])

    def _suppress_eos(self, reqs: list[Request], logits: torch.Tensor) -> None:
        # ignore_eos suppresses EOS (llama.cpp --ignore-eos, transformers min_new_tokens): the stream then
        # holds exactly max_new_tokens real tokens instead of EOS followed by noise.
        banned_rows = [i for i, r in enumerate(reqs) if r.params.ignore_eos]
        if not (banned_rows and self.eos_token_ids):
            return
        key = (self.eos_token_ids, logits.device)
        if getattr(self, "_eos_columns", (None,))[0] != key:  # made once, not per step
            self._eos_columns = (key, torch.tensor(sorted(self.eos_token_ids), device=logits.device))
        cols = self._eos_columns[1]
        if len(banned_rows) == logits.shape[0]:
            logits.index_fill_(1, cols, float("-inf"))  # one op; indexing assignment dispatches several
        else:
            logits[torch.tensor(banned_rows, device=logits.device)[:, None], cols[None, :]] = float("-inf")

    def _advance(self, req: Request, num_computed: int, sampled: tuple[int, Any] | None) -> None:
        """Commit one row: ``num_computed`` more tokens are in the cache, and (when it sampled) the new token,
        its text and its event."""
        req.num_computed_tokens += num_computed
        if sampled is None:
            return
        token_id, lp = sampled
        if req.matcher is not None and not self._accept(req, token_id):
            return
        req.output_ids.append(token_id)
        if lp is not None:
            req.logprobs.append(lp[0])
            req.top_logprobs.append(lp[1])
        self.stats.num_generated_tokens += 1
        m = req.metrics
        m.num_generated_tokens = len(req.output_ids)
        if m.last_token_step != self.stats.num_steps:  # a verification gives several tokens in one step
            m.num_token_steps, m.last_token_step = m.num_token_steps + 1, self.stats.num_steps
        if m.first_token_time is None:
            m.first_token_time = time.perf_counter()
        m.kv_bytes = max(m.kv_bytes, self.kv.kv_bytes_in_use(req.seq_id))
        reason = req.stop_reason_after(token_id, self.max_model_len)
        out = self._outputs.get(req.request_id)
        text, hit = out.push(token_id, reason is not None) if out is not None else ("", False)
        reason = FinishReason.STOP if hit else reason
        if reason is None and req.matcher is not None and req.matcher.is_stopped():
            reason = FinishReason.STOP  # the constrained output is complete: nothing but EOS may follow
        req.finish_reason = reason  # with the token: an interrupted _finish cannot make it run on
        top = lp[1] if lp is not None else None
        self._events.append(TokenEvent(req.request_id, token_id, text, reason, None, lp[0] if lp else None, top))
        if reason is not None:
            self._finish(req, reason, emit=False)

    def _accept(self, req: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's grammar; a token it refuses (a sampler that ignored the
        mask) fails the request, and so does a grammar with no way on (its mask held only EOS, which llguidance
        takes and stays in error: the output would end early, as if complete)."""
        took = req.matcher.consume_token(token_id)
        if took and not req.matcher.is_error():
            return True
        if took:
            n = len(req.output_ids)
            error = GrammarError(f"the structured output cannot be completed after {n} token{'s' * (n != 1)}: "
                                 f"{dead_end(req.matcher)}")
        else:
            error = GrammarError(f"token {token_id} breaks the request's structured output: {dead_end(req.matcher)}")
        self._finish(req, FinishReason.ERROR, error)
        return False

    def _finish(self, req: Request, reason: FinishReason, error: KVCoreError | None = None, emit: bool = True) -> None:
        if error is not None:  # kept for its message: its traceback's frames hold the step's batch and requests, req
            error.__traceback__ = None  # among them, a cycle that would keep them until a full garbage collection
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        self.stats.num_finished_requests += 1
        self.scheduler.finish(req)
        if self.speculator is not None:
            self.speculator.finish(req)
        if emit:
            self._events.append(TokenEvent(req.request_id, None, "", reason, error))

    def _recover(self) -> None:
        self.scheduler.recover(self._requests.values())
        for req in self._requests.values():
            if req.is_finished:
                req.metrics.finish_time = req.metrics.finish_time or time.perf_counter()
