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

The scheduler owns the request lifecycle: admission, preemption, forks, finishing, rollback and recovery.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from kvcore.errors import ContextLengthError, OutOfBlocksError
from kvcore.scheduling.batch import ScheduledBatch, SchedulerOutput
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.prefix import shares_inflight_prefix
from kvcore.scheduling.request import EngineStats, Request

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = False,
        stats: EngineStats | None = None,
    ) -> None:
        self.kv = kv
        self.stats = stats if stats is not None else EngineStats()  # counts cache hits and preemptions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._seq_ids = itertools.count()

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
        self._free(req)

    def finish(self, req: Request) -> None:
        """``req`` ended (finished, failed or aborted): out of the queues, its blocks back; its ``n > 1``
        samples that waited for its prefill now prefill on their own, first in the queue."""
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

    def preempt(self, req: Request) -> None:
        """Give ``req``'s blocks back and queue it first; it is recomputed from its tokens so far."""
        if req in self.running:
            self.running.remove(req)
        self._free(req)
        if req not in self.waiting:
            self.waiting.appendleft(req)

    def _free(self, req: Request) -> None:
        if req.seq_id is not None:
            seq_id, req.seq_id = req.seq_id, None
            if self.kv.blocks.has_sequence(seq_id):
                self.kv.free_sequence(seq_id)
        req.num_computed_tokens = 0

    def _room(self, req: Request) -> int:
        """Running sequences ``req`` (with n > 1 its samples) will occupy once admitted."""
        return 1 + len(req.pending_samples)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.kv.blocks.has_windows:  # blocks no next query reads go back first: this step can use them
            for req in self.running:
                self.kv.blocks.slide(req.seq_id, req.num_computed_tokens)
        if not self.enable_chunked_prefill:
            rows = self._admit(out, self.max_num_batched_tokens, chunked=False)
            if rows:
                return self._batch(out, rows, [False] * len(rows[0]))
        while True:
            self._make_room(out)
            decodes = [r for r in self.running if r.is_decoding]
            rows: tuple[list[Request], list[int]] = (decodes, [1] * len(decodes))
            if self.enable_chunked_prefill:
                budget = self.max_num_batched_tokens - len(decodes)
                for req in self.running:  # partly prefilled requests continue, oldest first
                    if not req.is_decoding and budget > 0:
                        budget -= self._add_chunk(rows, req, budget)
                new = self._admit(out, budget, chunked=True, rows=rows)
                self.running.extend(new)
            if rows[0] or not self.running:
                break
            # Nothing could run although requests are resident: partly prefilled requests hold the blocks
            # each other needs (or, unchunked, a rolled-back prefill). The newest gives its blocks back;
            # alone with the whole pool to itself and still no room, it can never run.
            victim = self.running.pop()
            if not self.running and self.enable_chunked_prefill:
                self._free(victim)
                out.failed.append((victim, self._too_big(victim)))
                break
            self.preempt(victim)
            victim.metrics.num_preemptions += 1
            self.stats.num_preemptions += 1
        if not rows[0]:
            return out
        return self._batch(out, rows, [r.is_decoding and n == 1 for r, n in zip(*rows)])

    @staticmethod
    def _batch(out: SchedulerOutput, rows: tuple[list[Request], list[int]], is_decode: list[bool]) -> SchedulerOutput:
        out.batch = ScheduledBatch(list(rows[0]), list(rows[1]), is_decode)
        return out

    def _add_chunk(self, rows: tuple[list[Request], list[int]], req: Request, budget: int) -> int:
        """Schedule the largest chunk (at most ``budget`` tokens) of ``req``'s uncomputed tokens that the free
        blocks hold next to ``rows``; returns its length (0: none fits)."""
        blocks = self.kv.blocks
        seq_ids = [r.seq_id for r in rows[0]]
        free_after = blocks.num_free_blocks - blocks.num_blocks_needed(seq_ids, rows[1])
        seq_len = blocks.seq_len(req.seq_id)
        fits = blocks.num_tokens_fitting(req.seq_id, free_after)
        n = min(req.num_tokens - req.num_computed_tokens, budget, fits, blocks.max_seq_len - seq_len)
        if n <= 0 or not blocks.can_reserve(seq_ids + [req.seq_id], rows[1] + [n]):
            return 0
        rows[0].append(req)
        rows[1].append(n)
        return n

    def _too_big(self, req: Request) -> OutOfBlocksError | ContextLengthError:
        if req.num_tokens > self.kv.blocks.max_seq_len:
            # The engine never lets a sequence past the limit: a plugin changed the request's tokens.
            # Recomputed, it would be preempted at the limit and admitted again, forever.
            return ContextLengthError(
                f"request '{req.request_id}' holds {req.num_tokens} tokens, past the context limit of "
                f"{self.kv.blocks.max_seq_len}: its tokens were changed outside the engine (by a plugin that "
                "wrote into the request it was shown?)")
        return OutOfBlocksError(
            f"request '{req.request_id}' needs {req.num_tokens} tokens of KV cache, more than the whole "
            "cache holds; raise num_blocks or shorten the prompt"
        )

    def _admit(
        self, out: SchedulerOutput, budget: int, *, chunked: bool, rows: tuple[list[Request], list[int]] | None = None
    ) -> list[Request] | tuple[list[Request], list[int]]:
        """Admit waiting requests; chunked: append their first chunks to ``rows`` and return the admitted,
        else return the whole-prompt prefill rows."""
        rows = rows if rows is not None else ([], [])
        admitted: list[Request] = []
        blocks = self.kv.blocks
        # what the running and admitted requests occupy once their n > 1 samples fork, not one sequence each
        occupied = sum(self._room(r) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if occupied + self._room(req) > self.max_num_seqs:
                break
            if not self.kv.can_add_sequence():
                break
            # even alone it never fits (or its tokens grew past the context limit outside the engine)
            if req.num_tokens > blocks.max_seq_len or blocks.min_blocks_for(req.num_tokens) > blocks.num_blocks:
                self.waiting.popleft()
                out.failed.append((req, self._too_big(req)))
                continue
            seq_id = self.new_seq_id()
            tokens = req.all_ids  # a preempted request re-enters with prompt + generated so far
            cached = self.kv.add_sequence(seq_id, tokens, req.params.cache_salt)
            if shares_inflight_prefix(blocks, req, tokens, cached, [*self.running, *rows[0]]):
                self.kv.free_sequence(seq_id)  # its prefix is being computed: admitted next, as a cache hit
                break
            req.seq_id, req.num_computed_tokens = seq_id, cached
            if chunked:
                n = self._add_chunk(rows, req, budget)
                ok = n > 0
            else:
                n = len(tokens) - cached
                over_budget = sum(rows[1]) + n > budget and rows[0]
                # Count the whole prefill batch together: each may fit alone but not all at once.
                ok = not over_budget and self.kv.can_reserve([r.seq_id for r in rows[0]] + [seq_id], rows[1] + [n])
                if ok:
                    rows[0].append(req)
                    rows[1].append(n)
            if not ok:
                self._free(req)
                if not chunked and not self.running and not rows[0]:  # alone and still too big: never runs
                    self.waiting.popleft()
                    out.failed.append((req, self._too_big(req)))
                    continue
                break
            budget -= n if chunked else 0
            req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, cached)
            self.stats.num_cached_tokens += cached
            self.waiting.popleft()
            admitted.append(req)
            occupied += self._room(req)
        if chunked:
            return admitted
        self.running.extend(admitted)
        return rows if rows[0] else None

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt the newest running requests until every decoding one can append a token."""
        while self.running:
            decodes = [r for r in self.running if r.is_decoding]
            if not decodes or self.kv.can_reserve([r.seq_id for r in decodes], [1] * len(decodes)):
                return
            victim = self.running.pop()
            if not self.running:  # alone and still no room: it fails, its blocks are back in the pool
                self._free(victim)
                out.failed.append((victim, OutOfBlocksError(
                    f"request '{victim.request_id}' ran out of KV-cache blocks at {victim.num_tokens} tokens")))
                return
            self.preempt(victim)
            victim.metrics.num_preemptions += 1
            self.stats.num_preemptions += 1
