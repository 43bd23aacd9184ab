"""The prefix index under the block manager: which block holds the K/V of which chained key, per group.

A full block's key chains from the start of its sequence (:func:`~kvcore.scheduling.block_pool.block_key`);
every group of layers (:mod:`kvcore.scheduling.kv_groups`) stores the same tokens in a block of its own, so
a key is looked up per group. A hit also compares the block's stored tokens, so even a colliding key cannot
hand one request another's K/V. A block keeps its key while it is free (it can be revived by a hit) and
loses it when it is handed out again (:meth:`PrefixIndex.forget`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.scheduling.block_pool import block_key
from kvcore.scheduling.kv_groups import first_live_block

__all__ = ["PrefixIndex"]


class PrefixIndex:
    def __init__(self) -> None:
        #: block -> (its group, its chained key, its tokens): the tokens are compared on every hit
        self._key_of: dict[int, tuple[int, bytes, tuple[int, ...]]] = {}
        self._block_of: dict[tuple[int, bytes], int] = {}  # (group, chained key) -> block holding it

    def forget(self, block_id: int) -> None:
        """``block_id`` is about to be overwritten: it no longer holds what its key names."""
        stale = self._key_of.pop(block_id, None)
        if stale is not None:
            del self._block_of[stale[:2]]

    def add(self, group: int, block_id: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Record that ``block_id`` holds ``tokens`` under ``key`` for ``group`` (the first holder of a key
        keeps it)."""
        if block_id not in self._key_of and (group, key) not in self._block_of:
            self._key_of[block_id], self._block_of[(group, key)] = (group, key, tokens), block_id

    def add_blocks(self, tables: Sequence[Sequence[int | None]], token_ids: Sequence[int], start: int, stop: int,
                   parent: bytes, block_size: int) -> bytes:
        """Key blocks ``start..stop - 1`` of one sequence's ``tables`` (one per group), the chain continuing
        from ``parent``; returns the last key."""
        for i in range(start, stop):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            parent = block_key(parent, tokens)
            for group, table in enumerate(tables):
                if table[i] is not None:  # a given-back block was keyed before, or is dead anyway
                    self.add(group, table[i], parent, tokens)
        return parent

    def lookup(self, group: int, key: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self._block_of.get((group, key))
        # a key match alone is not trusted: the stored tokens must be the same too
        if block_id is None or self._key_of[block_id][2] != tokens:
            return None
        return block_id

    def match(
        self, root: bytes, token_ids: Sequence[int], windows: Sequence[int | None], block_size: int
    ) -> tuple[int, list[list[int | None]]]:
        """The longest cached prefix of ``token_ids`` (whole blocks, never the last token) usable by every
        group: a full-attention group needs all its blocks, a window group only those the next query still
        reads. Returns the number of blocks and each group's table (None: an entry the window never reads)."""
        bs = block_size
        limit = (len(token_ids) - 1) // bs
        found: list[list[int | None]] = [[] for _ in windows]
        parent = root
        full = [g for g, w in enumerate(windows) if w is None]
        for i in range(limit):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_key(parent, tokens)
            hits = [self.lookup(g, parent, tokens) for g in range(len(windows))]
            if any(hits[g] is None for g in full):
                break  # a full-attention group needs every block: no longer prefix can hit
            for g, block_id in enumerate(hits):
                found[g].append(block_id)
        # the longest length whose live blocks every window group still has
        for n in range(len(found[0]) if found else 0, 0, -1):
            if all(w is None or None not in found[g][first_live_block(n * bs, w, bs) : n]
                   for g, w in enumerate(windows)):
                tables = [[b if i >= first_live_block(n * bs, w, bs) else None for i, b in enumerate(found[g][:n])]
                          for g, w in enumerate(windows)]
                return n, tables
        return 0, [[] for _ in windows]
