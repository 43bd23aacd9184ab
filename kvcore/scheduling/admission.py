"""Admission: which waiting requests join the running ones this step, with their first prompt chunk or whole
prompt, within the running-sequence limit, the free KV blocks and the step's token budget.

:class:`Admission` is the :class:`~kvcore.scheduling.scheduler.Scheduler`'s; it reads and changes the
scheduler's queues, which the scheduler hands it each step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvcore.errors import ContextLengthError, OutOfBlocksError
from kvcore.scheduling.batch import SchedulerOutput
from kvcore.scheduling.kv_manager import KVCacheManager
from kvcore.scheduling.prefix import shares_inflight_prefix
from kvcore.scheduling.request import EngineStats, Request

__all__ = ["Admission", "Rows", "add_chunk", "free", "too_big"]

#: the rows of one forward: requests, and per request the new tokens it computes
Rows = tuple[list[Request], list[int]]


def free(kv: KVCacheManager, req: Request) -> None:
    """Give ``req``'s KV blocks back; it has no computed tokens after this."""
    if req.seq_id is not None:
        seq_id, req.seq_id = req.seq_id, None
        if kv.blocks.has_sequence(seq_id):
            kv.free_sequence(seq_id)
    req.num_computed_tokens = 0


def add_chunk(kv: KVCacheManager, rows: Rows, req: Request, budget: int) -> int:
    """Schedule the largest chunk (at most ``budget`` tokens) of ``req``'s uncomputed tokens that the free
    blocks hold next to ``rows``; returns its length (0: none fits)."""
    blocks = kv.blocks
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


def too_big(req: Request, max_seq_len: int) -> OutOfBlocksError | ContextLengthError:
    """Why ``req`` can never run, even alone with the whole cache."""
    if req.num_tokens > max_seq_len:
        # The engine never lets a sequence past the limit: a plugin changed the request's tokens.
        # Recomputed, it would be preempted at the limit and admitted again, forever.
        return ContextLengthError(
            f"request '{req.request_id}' holds {req.num_tokens} tokens, past the context limit of "
            f"{max_seq_len}: its tokens were changed outside the engine (by a plugin that "
            "wrote into the request it was shown?)")
    return OutOfBlocksError(
        f"request '{req.request_id}' needs {req.num_tokens} tokens of KV cache, more than the whole "
        "cache holds; raise num_blocks or shorten the prompt"
    )


def room(req: Request) -> int:
    """Running sequences ``req`` (with n > 1 its samples) will occupy once admitted."""
    return 1 + len(req.pending_samples)


class Admission:
    """Admits waiting requests into a step; ``new_seq_id`` names each admitted request's KV sequence."""

    def __init__(self, kv: KVCacheManager, stats: EngineStats, max_num_seqs: int, new_seq_id: Callable[[], int]
                 ) -> None:
        self.kv, self.stats, self.max_num_seqs, self.new_seq_id = kv, stats, max_num_seqs, new_seq_id

    def admit(
        self, waiting: deque[Request], running: list[Request], out: SchedulerOutput, budget: int, *, chunked: bool,
        rows: Rows | None = None,
    ) -> list[Request] | Rows | None:
        """Admit requests from the front of ``waiting``; chunked: append their first chunks to ``rows`` and return
        the admitted, else add them to ``running`` and return the whole-prompt prefill rows (None: none). The
        requests that can never run go to ``out.failed``."""
        rows = rows if rows is not None else ([], [])
        admitted: list[Request] = []
        blocks = self.kv.blocks
        # what the running and admitted requests occupy once their n > 1 samples fork, not one sequence each
        occupied = sum(room(r) for r in running)
        while waiting and budget > 0:
            req = waiting[0]
            if occupied + room(req) > self.max_num_seqs:
                break
            if not self.kv.can_add_sequence():
                break
            # even alone it never fits (or its tokens grew past the context limit outside the engine)
            if req.num_tokens > blocks.max_seq_len or blocks.min_blocks_for(req.num_tokens) > blocks.num_blocks:
                waiting.popleft()
                out.failed.append((req, too_big(req, blocks.max_seq_len)))
                continue
            seq_id = self.new_seq_id()
            tokens = req.all_ids  # a preempted request re-enters with prompt + generated so far
            cached = self.kv.add_sequence(seq_id, tokens, req.params.cache_salt)
            if shares_inflight_prefix(blocks, req, tokens, cached, [*running, *rows[0]]):
                self.kv.free_sequence(seq_id)  # its prefix is being computed: admitted next, as a cache hit
                break
            req.seq_id, req.num_computed_tokens = seq_id, cached
            if chunked:
                n = add_chunk(self.kv, rows, req, budget)
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
                free(self.kv, req)
                if not chunked and not running and not rows[0]:  # alone and still too big: never runs
                    waiting.popleft()
                    out.failed.append((req, too_big(req, blocks.max_seq_len)))
                    continue
                break
            budget -= n if chunked else 0
            req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, cached)
            self.stats.num_cached_tokens += cached
            waiting.popleft()
            admitted.append(req)
            occupied += room(req)
        if chunked:
            return admitted
        running.extend(admitted)
        return rows if rows[0] else None
