"""The block pool under the block manager: free list, reference counts, and the prefix key of a full block
(the scheme is described in :mod:`kvcore.scheduling.block_manager`)."""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from kvcore.errors import ConfigError, KVCoreError, OutOfBlocksError

__all__ = ["BlockAllocator", "block_key", "root_key"]


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained key of a full block: SHA-256 over the parent key and the tokens as 64-bit integers."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


def root_key(namespace: str, cache_salt: str | None) -> bytes:
    """The parent key of a sequence's first block: what the K/V depend on besides the tokens."""
    # the length prefix keeps ("ab", "c") and ("a", "bc") apart; None and "" are distinct salts
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    ns = namespace.encode()
    return hashlib.sha256(len(ns).to_bytes(8, "little") + ns + salt).digest()


class BlockAllocator:
    """A pool of ``num_blocks`` block ids with a free list and per-block reference counts.

    :meth:`allocate` hands out a free block with reference count 1; :meth:`incref` adds a holder
    (sharing, or reviving a free block that still holds a cached prefix); :meth:`free` drops one holder
    and returns the block to the back of the free list when none is left.
    """

    def __init__(self, num_blocks: int, *, lowest_first: bool = False) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ConfigError(f"block allocator: num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        #: hand out the lowest free id instead of the least recently freed one: per-sequence layouts keep
        #: a batch on consecutive slots, which lets a backend attend to them in one call
        self.lowest_first = lowest_first
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise KVCoreError(f"block id {block_id} is outside the pool [0, {self.num_blocks})")
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self.ref_count(block_id) == 0

    def allocate(self) -> int:
        """Take a free block (reference count 1): the least recently freed, or the lowest id with
        ``lowest_first``. Raises :class:`OutOfBlocksError` when none is left."""
        if not self._free:
            raise OutOfBlocksError(f"no free KV-cache block (all {self.num_blocks} in use)")
        if self.lowest_first:
            block_id = min(self._free)
            del self._free[block_id]
        else:
            block_id, _ = self._free.popitem(last=False)
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int, *, revive: bool = False) -> None:
        """One more holder. A free block may be taken back only with ``revive`` (a prefix-cache hit)."""
        if self.ref_count(block_id) == 0:
            if not revive:
                raise KVCoreError(f"block {block_id} is free; cannot share it")
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder; the block returns to the pool when its count reaches 0."""
        count = self.ref_count(block_id)
        if count == 0:
            raise KVCoreError(f"double free of KV-cache block {block_id}")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            self._free[block_id] = None
