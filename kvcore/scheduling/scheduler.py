"""Admission, preemption and the per-step token budget.

Each step fills one forward call with rows: ``query_lens[i]`` new tokens of ``requests[i]`` after the
``num_computed_tokens`` it already has in the cache.

Chunked prefill (``enable_chunked_prefill``, vLLM's default): every running request that is decoding
gets its one token first; the rest of ``max_num_batched_tokens`` goes to prefill chunks, first of
requests whose prompt is partly computed (oldest first), then of newly admitted ones. So a long prompt
is split over several steps and the running requests keep producing a token every step while it is
admitted. A partly prefilled request produces no token until its last chunk.

Without chunking, a step either admits waiting requests for a whole-prompt prefill (as many as fit the
running-sequence limit, the free KV blocks and ``max_num_batched_tokens``; a lone prompt may exceed the
budget) or, when none can be admitted, runs one decode row for every running request.

Preemption: when the decode rows do not fit the free blocks, the newest running requests give their blocks back
and wait at the front of the queue; recomputed later (prompt + tokens so far), their streams are unchanged.

Sliding windows: each step first has every running request's window groups give back the blocks its next
query cannot read (:meth:`~kvcore.scheduling.block_manager.BlockManager.slide`, from its committed tokens, so
a rollback never needs them back).

The scheduler owns the request lifecycle: admission, preemption, the KV room of each step (reserved in
:meth:`Scheduler.schedule`, with the drafts of a speculative step in :meth:`Scheduler.add_drafts`), then in
:meth:`Scheduler.update_from_output` what the forward gave: computed tokens committed, sampled tokens appended
with their stop checks, forks, a verification's rejected drafts given back, finished requests freed. Also
failures, rollback and recovery.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable

from kvcore.errors import KVCoreError, OutOfBlocksError
from kvcore.scheduling.admission import Admission, Rows, add_chunk, free, too_big
from kvcore.scheduling.batch import ModelOutput, Sampled, ScheduledBatch, SchedulerOutput
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.outputs import emit
from kvcore.scheduling.request import EngineStats, FinishReason, Request, TokenEvent

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = False,
        stats: EngineStats | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_model_len = max_model_len or kv.max_seq_len  # a request ends with CONTEXT there
        self.stats = stats if stats is not None else EngineStats()  # counts cache hits and preemptions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._seq_ids = itertools.count()
        self.admission = Admission(kv, self.stats, max_num_seqs, self.new_seq_id)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and give its KV blocks back (finished, failed or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        free(self.kv, req)

    def finish(self, req: Request, reason: FinishReason, error: KVCoreError | None = None) -> None:
        """``req`` ended (finished, failed or aborted): out of the queues, its blocks back; its ``n > 1``
        samples that waited for its prefill now prefill on their own, first in the queue."""
        if error is not None:  # kept for its message: its traceback's frames hold the step's batch and requests, req
            error.__traceback__ = None  # among them, a cycle that would keep them until a full garbage collection
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        self.stats.num_finished_requests += 1
        self.remove(req)
        for child in reversed(req.pending_samples):
            if not child.is_finished:
                self.waiting.appendleft(child)
        req.pending_samples = []

    def fork(self, leader: Request, child: Request) -> None:
        """Start sample ``child`` of ``leader``'s group on the leader's computed blocks (shared,
        copy-on-write): it runs from the next step on."""
        child.seq_id = self.new_seq_id()
        self.kv.fork_sequence(leader.seq_id, child.seq_id)
        self.running.append(child)

    def commit(self, reqs: list[Request], query_lens: list[int]) -> None:
        """A forward wrote the K/V of ``query_lens[i]`` more tokens of ``reqs[i]``: with prefix caching,
        their full blocks become shareable."""
        if self.kv.blocks.enable_prefix_caching:
            for req, n in zip(reqs, query_lens):
                self.kv.blocks.commit(req.seq_id, req.all_ids[: req.num_computed_tokens + n])

    def roll_back(self, reqs: list[Request]) -> None:
        """A reserved forward failed: the slots it reserved hold nothing valid; each sequence goes back to
        its computed tokens."""
        for req in reqs:
            self.kv.blocks.truncate(req.seq_id, req.num_computed_tokens)

    def add_drafts(self, batch: ScheduledBatch, num_drafts: list[int]) -> ScheduledBatch | None:
        """``batch`` (decode rows, reserved) with ``num_drafts[i]`` draft tokens after row ``i``'s last token and
        their room reserved; None when there are none or they do not fit (the batch then runs as it is)."""
        rows = [i for i, n in enumerate(num_drafts) if n > 0]
        seq_ids, lens = [batch.requests[i].seq_id for i in rows], [num_drafts[i] for i in rows]
        if not rows or not self.kv.can_reserve(seq_ids, lens):
            return None
        copies = self.kv.reserve(seq_ids, lens)
        return ScheduledBatch(batch.requests, [1 + n for n in num_drafts], batch.is_decode, batch.copies + copies)

    def draft_budgets(self, wanted: list[int]) -> list[int]:
        """How many drafts each decode row may score this step: ``wanted[i]``, while the step's token budget
        lasts (earlier rows first)."""
        budgets, room = [], self.max_num_batched_tokens - len(wanted)
        for n in wanted:
            budgets.append(min(n, room))
            room -= budgets[-1]
        return budgets

    def update_from_output(self, output: ModelOutput, events: list[TokenEvent]) -> None:
        """Settle one forward: the K/V its rows wrote are computed (prefix-cached), their tokens appended with
        their stop checks, ``n > 1`` samples forked, a verification's rejected drafts given back, the requests
        that ended freed. Each token's event (or a failure's) goes to ``events`` as it is made, so an interrupted
        update loses none."""
        batch = output.batch
        self.stats.num_prefill_tokens += sum(n for n, d in zip(batch.query_lens, batch.is_decode) if not d)
        self.stats.num_decode_tokens += sum(batch.is_decode)
        if output.num_drafts is None:
            self.commit(batch.requests, batch.query_lens)
            for req, n, tokens in zip(batch.requests, batch.query_lens, output.tokens):
                if req.pending_samples and tokens:  # before the leader's token: it may finish and free its blocks
                    self._fork_samples(req, n, output.forks, events)
                if tokens:
                    self._emit(req, n, tokens[0], events)
                else:
                    req.num_computed_tokens += n
            return
        for req, tokens in zip(batch.requests, output.tokens):
            for token in tokens:  # one by one: a stop ends the stream exactly where it would without drafts
                if not req.is_finished:
                    self._emit(req, 1, token, events)
            if not req.is_finished:
                self.roll_back([req])  # the cache keeps the last token and the kept drafts only
                self.commit([req], [0])

    def _emit(self, req: Request, num_computed: int, sampled: Sampled, events: list[TokenEvent]) -> None:
        kv_bytes = self.kv.kv_bytes_in_use(req.seq_id)
        event = emit(req, num_computed, sampled, self.stats, self.max_model_len, kv_bytes, events)
        if event.finish_reason is not None:
            self.finish(req, event.finish_reason, event.error)

    def _fork_samples(self, leader: Request, num_new: int, forks: dict[str, Sampled], events: list[TokenEvent]
                      ) -> None:
        """Give the leader's samples 1..n-1 its prompt blocks (shared, copy-on-write) and their first tokens."""
        children, leader.pending_samples = leader.pending_samples, []
        num_cached = leader.num_computed_tokens + num_new
        for child in children:
            if child.is_finished or child.request_id not in forks:
                continue
            self.fork(leader, child)
            child.metrics.num_cached_tokens = num_cached
            self.stats.num_cached_tokens += num_cached
            self._emit(child, num_cached, forks[child.request_id], events)

    def recover(self, requests: Iterable[Request]) -> None:
        """Restore the invariants after an exception escaped a step: every unfinished request of ``requests``
        runs with exactly its computed tokens in the cache, or waits without blocks (it is then recomputed,
        which gives the same stream); every KV sequence belongs to a running request."""
        requests = list(requests)
        blocks = self.kv.blocks
        waiting_for_fork = {id(c) for r in requests if not r.is_finished for c in r.pending_samples}
        running: list[Request] = []
        for req in self.running:
            if req.is_finished or req in running:
                continue
            seq = req.seq_id
            if seq is not None and blocks.has_sequence(seq) and blocks.seq_len(seq) == req.num_computed_tokens:
                running.append(req)
            else:  # its last forward did not complete: recompute it
                self.preempt(req)
        self.running = running
        queued = {id(r) for r in running} | waiting_for_fork
        waiting = []
        for req in [*self.waiting, *requests]:
            if req.is_finished or id(req) in queued:
                continue
            queued.add(id(req))
            req.seq_id, req.num_computed_tokens = None, 0
            waiting.append(req)
        self.waiting.clear()
        self.waiting.extend(waiting)
        owned = {r.seq_id for r in running}
        for seq in blocks.seq_ids:
            if seq not in owned:
                blocks.free_sequence(seq)
        for req in requests:
            if req.is_finished:
                req.seq_id, req.pending_samples = None, []
                req.metrics.finish_time = req.metrics.finish_time or time.perf_counter()

    def preempt(self, req: Request) -> None:
        """Give ``req``'s blocks back and queue it first; it is recomputed from its tokens so far."""
        if req in self.running:
            self.running.remove(req)
        free(self.kv, req)
        if req not in self.waiting:
            self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.kv.blocks.has_windows:  # blocks no next query reads go back first: this step can use them
            for req in self.running:
                self.kv.blocks.slide(req.seq_id, req.num_computed_tokens)
        if not self.enable_chunked_prefill:
            rows = self.admission.admit(self.waiting, self.running, out, self.max_num_batched_tokens, chunked=False)
            if rows:
                return self._batch(out, rows, [False] * len(rows[0]))
        while True:
            self._make_room(out)
            decodes = [r for r in self.running if r.is_decoding]
            rows: Rows = (decodes, [1] * len(decodes))
            if self.enable_chunked_prefill:
                budget = self.max_num_batched_tokens - len(decodes)
                for req in self.running:  # partly prefilled requests continue, oldest first
                    if not req.is_decoding and budget > 0:
                        budget -= add_chunk(self.kv, rows, req, budget)
                new = self.admission.admit(self.waiting, self.running, out, budget, chunked=True, rows=rows)
                self.running.extend(new)
            if rows[0] or not self.running:
                break
            # Nothing could run although requests are resident: partly prefilled requests hold the blocks
            # each other needs (or, unchunked, a rolled-back prefill). The newest gives its blocks back;
            # alone with the whole pool to itself and still no room, it can never run.
            victim = self.running.pop()
            if not self.running and self.enable_chunked_prefill:
                free(self.kv, victim)
                out.failed.append((victim, too_big(victim, self.kv.max_seq_len)))
                break
            self.preempt(victim)
            victim.metrics.num_preemptions += 1
            self.stats.num_preemptions += 1
        if not rows[0]:
            return out
        return self._batch(out, rows, [r.is_decoding and n == 1 for r, n in zip(*rows)])

    def _batch(self, out: SchedulerOutput, rows: Rows, is_decode: list[bool]
               ) -> SchedulerOutput:
        """The step's batch, its KV room reserved (all or nothing: a batch that cannot have it fails)."""
        batch = ScheduledBatch(list(rows[0]), list(rows[1]), is_decode)
        failed = self.reserve(batch)
        out.failed += failed
        out.batch = None if failed else batch
        return out

    def reserve(self, batch: ScheduledBatch) -> list[tuple[Request, KVCoreError]]:
        """Make room for ``batch``'s rows in the KV cache, all or nothing; returns the rows' requests with why
        not when it cannot ([]: reserved)."""
        try:
            batch.copies = self.kv.reserve([r.seq_id for r in batch.requests], batch.query_lens)
        except KVCoreError as exc:
            return [(req, exc) for req in batch.requests]
        return []

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt the newest running requests until every decoding one can append a token."""
        while self.running:
            decodes = [r for r in self.running if r.is_decoding]
            if not decodes or self.kv.can_reserve([r.seq_id for r in decodes], [1] * len(decodes)):
                return
            victim = self.running.pop()
            if not self.running:  # alone and still no room: it fails, its blocks are back in the pool
                free(self.kv, victim)
                out.failed.append((victim, OutOfBlocksError(
                    f"request '{victim.request_id}' ran out of KV-cache blocks at {victim.num_tokens} tokens")))
                return
            self.preempt(victim)
            victim.metrics.num_preemptions += 1
            self.stats.num_preemptions += 1
