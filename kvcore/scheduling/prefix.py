"""Admission with prefix caching: wait for a shared prefix that is being computed instead of computing it twice."""

from __future__ import annotations

from kvcore.scheduling.block_manager import BlockManager
from kvcore.scheduling.request import Request

__all__ = ["shares_inflight_prefix"]


def shares_inflight_prefix(
    blocks: BlockManager, req: Request, tokens: list[int], cached: int, inflight: list[Request]
) -> bool:
    """With prefix caching: whether more full blocks of ``tokens`` than the ``cached`` ones are being
    computed for a request with ``req``'s cache salt whose prefill is in flight. Waiting a step for them
    to be committed turns n requests with one long shared prompt into one prefill plus n - 1 cache hits."""
    if not blocks.enable_prefix_caching:
        return False
    bs, limit = blocks.block_size, (len(tokens) - 1) // blocks.block_size
    for other in inflight:
        if other.is_decoding or limit * bs <= cached or other.params.cache_salt != req.params.cache_salt:
            continue
        ids = other.all_ids
        lo, hi = cached // bs, min(limit, len(ids) // bs)  # lo blocks are known to match (cache hits)
        while lo < hi:  # the longest common prefix in whole blocks: list slices compare in C
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens[: mid * bs] == ids[: mid * bs] else (lo, mid - 1)
        if lo * bs > cached:
            return True
    return False
