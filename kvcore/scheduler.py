"""Admission, preemption and the per-step token budget.

Each step the scheduler either admits waiting requests for a prefill (as many as fit: running-sequence
limit, free KV blocks for the whole batch together, and ``max_num_batched_tokens``) or, when none can
be admitted, schedules one decode row for every running request, first preempting the newest running
requests until the rest can each append a token. A preempted request gives its blocks back and waits at
the front of the queue; it is recomputed later (prompt + tokens so far), so its stream is unchanged.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from kvcore.errors import KVCoreError, OutOfBlocksError
from kvcore.kv_manager import KVCacheManager
from kvcore.request import Request

__all__ = ["ScheduledBatch", "SchedulerOutput", "Scheduler"]


@dataclass
class ScheduledBatch:
    """One forward call: ``query_lens[i]`` new tokens of ``requests[i]`` after its cached ones."""

    requests: list[Request]
    query_lens: list[int]
    is_prefill: bool

    @property
    def input_ids(self) -> list[int]:
        """The packed token ids to compute: each request's last ``query_len`` tokens."""
        ids: list[int] = []
        for req, n in zip(self.requests, self.query_lens):
            ids.extend(req.all_ids[-n:] if self.is_prefill else req.output_ids[-1:])
        return ids


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch | None = None
    failed: list[tuple[Request, KVCoreError]] = field(default_factory=list)  # can never run


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._seq_ids = itertools.count()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and give its KV blocks back (finished, failed or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.seq_id is not None:
            self.kv.free_sequence(req.seq_id)
            req.seq_id = None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        admitted, query_lens = self._admit(out)
        if admitted:
            self.running.extend(admitted)
            out.batch = ScheduledBatch(admitted, query_lens, is_prefill=True)
            return out
        self._make_room(out)
        if self.running:
            out.batch = ScheduledBatch(list(self.running), [1] * len(self.running), is_prefill=False)
        return out

    def _admit(self, out: SchedulerOutput) -> tuple[list[Request], list[int]]:
        admitted: list[Request] = []
        query_lens: list[int] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.can_add_sequence():
                break
            seq_id = next(self._seq_ids)
            tokens = req.all_ids  # a preempted request re-enters with prompt + generated so far
            cached = self.kv.add_sequence(seq_id, tokens)
            num_new = len(tokens) - cached
            over_budget = sum(query_lens) + num_new > self.max_num_batched_tokens
            # Count the whole prefill batch together: each may fit alone but not all at once.
            fits = self.kv.can_reserve([r.seq_id for r in admitted] + [seq_id], query_lens + [num_new])
            if (over_budget and admitted) or not fits:
                self.kv.free_sequence(seq_id)
                if not fits and not self.running and not admitted:  # alone and still too big: never runs
                    self.waiting.popleft()
                    out.failed.append((req, OutOfBlocksError(
                        f"request '{req.request_id}' needs {len(tokens)} tokens of KV cache, more than the whole "
                        "cache holds; raise num_blocks or shorten the prompt")))
                    continue
                break
            req.seq_id = seq_id
            req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, cached)
            self.waiting.popleft()
            admitted.append(req)
            query_lens.append(num_new)
        return admitted, query_lens

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt the newest running requests until every remaining one can append a token."""
        while self.running:
            if self.kv.can_reserve([r.seq_id for r in self.running], [1] * len(self.running)):
                return
            victim = self.running.pop()
            self.kv.free_sequence(victim.seq_id)
            victim.seq_id = None
            if not self.running:  # alone and still no room: it fails, its blocks are back in the pool
                out.failed.append((victim, OutOfBlocksError(
                    f"request '{victim.request_id}' ran out of KV-cache blocks at {len(victim.all_ids)} tokens")))
                return
            victim.metrics.num_preemptions += 1
            self.waiting.appendleft(victim)
