"""KV blocks, owned by the core: allocation, reference counts, copy-on-write and prefix hashes.

Every cache layout is addressed in blocks (a per-sequence layout has one block per sequence). A
sequence owns a *block table*, the physical block ids holding its tokens in order: token ``p`` lives in
block ``table[p // block_size]`` at offset ``p % block_size``. A sequence of ``n`` tokens holds exactly
``ceil(n / block_size)`` blocks.

Sharing
    :meth:`BlockManager.fork_sequence` gives the child every block of the parent (reference count +1).
    Blocks are copy-on-write: before a sequence writes into a block another sequence also holds (only
    ever its partly filled last block), :meth:`~BlockManager.reserve` takes a fresh block, swaps it
    into the writer's table and returns the ``(src, dst)`` pair for the cache to copy.

Prefix keys
    A full block is identified by a SHA-256 key chained from the start of the sequence: ``k_0 =
    sha256(namespace, cache salt)``, ``k_i = sha256(k_{i-1}, token bytes of block i)``. The namespace names
    what else changes the K/V (model, dtype, weight format, cache layout) and the optional per-request
    cache salt keeps tenants apart: requests with different salts never share a block. A hit also compares
    the block's stored tokens, so even a colliding key cannot hand one request another's K/V. With
    ``enable_prefix_caching`` the blocks of a new sequence whose prompt starts with already computed full
    blocks are shared instead of recomputed. A freed block keeps its key until it is handed out again; the
    free list is in least-recently-freed order, so eviction is LRU.

All-or-nothing
    :meth:`~BlockManager.reserve` counts the blocks the whole batch needs (new blocks plus copy-on-write
    copies) before taking any; when they are not all free it raises and no table changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcore.errors import ConfigError, ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.scheduling.block_pool import BlockAllocator, block_key, root_key

__all__ = ["BlockManager"]


class BlockManager:
    """Block tables of the live sequences over one :class:`BlockAllocator`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seq_len: int,
        *,
        enable_prefix_caching: bool = False,
        namespace: str = "",
    ) -> None:
        if block_size <= 0 or max_seq_len <= 0:
            raise ConfigError(f"block manager: block_size {block_size} and max_seq_len {max_seq_len} must be > 0")
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.allocator = BlockAllocator(num_blocks, lowest_first=block_size >= max_seq_len)
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace  # what the K/V depend on besides tokens and salt (see root_key)
        self._tables: dict[int, list[int]] = {}
        self._seq_lens: dict[int, int] = {}
        self._roots: dict[int, bytes] = {}  # seq -> the root key of its chain (namespace and cache salt)
        #: full block -> (its chained key, its tokens): the tokens are compared on every hit
        self._key_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self._block_of: dict[bytes, int] = {}  # chained key -> block holding it
        self._committed: dict[int, tuple[int, bytes]] = {}  # seq -> (full blocks keyed, last chained key)

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seq_lens

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seq_lens)

    def seq_len(self, seq_id: int) -> int:
        """Tokens reserved for ``seq_id`` (those of the current call included once reserved)."""
        try:
            return self._seq_lens[seq_id]
        except KeyError:
            raise KVCoreError(f"sequence {seq_id} is not in the KV cache") from None

    def block_table(self, seq_id: int) -> list[int]:
        self.seq_len(seq_id)
        return list(self._tables[seq_id])

    def num_reserved_slots(self, seq_id: int) -> int:
        """Slots held by ``seq_id`` but not holding a token: ``blocks * block_size - seq_len``."""
        return len(self._tables[seq_id]) * self.block_size - self.seq_len(seq_id)

    @property
    def num_tokens_in_use(self) -> int:
        return sum(self._seq_lens.values())

    # -- sequences -----------------------------------------------------------------------------------
    def can_add_sequence(self) -> bool:
        return self.allocator.num_free_blocks > 0  # its first token needs a block

    def add_sequence(self, seq_id: int, token_ids: Sequence[int] = (), cache_salt: str | None = None) -> int:
        """Start ``seq_id``. With prefix caching, share the cached full blocks ``token_ids`` starts with
        (never the last token: its logits must be computed) that were computed under the same
        ``cache_salt``. Returns the number of tokens reused."""
        if seq_id in self._seq_lens:
            raise KVCoreError(f"sequence {seq_id} is already in the KV cache")
        if not self.can_add_sequence():
            raise OutOfBlocksError(f"KV cache is full: no free block for sequence {seq_id}")
        table = []
        if self.enable_prefix_caching:
            self._roots[seq_id] = root_key(self.namespace, cache_salt)
            table = self._match_prefix(self._roots[seq_id], token_ids)
        for block_id in table:
            self.allocator.incref(block_id, revive=True)
        self._tables[seq_id] = table
        self._seq_lens[seq_id] = len(table) * self.block_size
        return self._seq_lens[seq_id]

    def free_sequence(self, seq_id: int) -> None:
        self.seq_len(seq_id)
        # Last block first: LRU then evicts a prefix's tail before its head, which keeps the head reusable.
        for block_id in reversed(self._tables.pop(seq_id)):
            self.allocator.free(block_id)
        del self._seq_lens[seq_id]
        self._committed.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> None:
        """``dst`` shares all of ``src``'s blocks (copy-on-write); takes no block now."""
        length = self.seq_len(src_seq_id)
        if dst_seq_id in self._seq_lens:
            raise KVCoreError(f"sequence {dst_seq_id} is already in the KV cache")
        table = list(self._tables[src_seq_id])
        for block_id in table:
            self.allocator.incref(block_id)
        self._tables[dst_seq_id] = table
        self._seq_lens[dst_seq_id] = length
        if src_seq_id in self._roots:
            self._roots[dst_seq_id] = self._roots[src_seq_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Undo a reservation: keep the first ``num_tokens`` tokens (whose K/V were written before) and give
        back the blocks past them. A forward that failed after :meth:`reserve` is rolled back this way."""
        if not 0 <= num_tokens <= self.seq_len(seq_id):
            raise KVCoreError(f"sequence {seq_id}: cannot truncate {self.seq_len(seq_id)} tokens to {num_tokens}")
        table = self._tables[seq_id]
        while len(table) > math.ceil(num_tokens / self.block_size):
            self.allocator.free(table.pop())
        self._seq_lens[seq_id] = num_tokens
        if self._committed.get(seq_id, (0, b""))[0] > len(table):
            del self._committed[seq_id]  # the next commit re-walks the chain over the blocks now in the table

    # -- reservation ---------------------------------------------------------------------------------
    def _needs_copy(self, seq_id: int) -> bool:
        """Whether the next write of ``seq_id`` lands in a shared, partly filled last block."""
        table = self._tables[seq_id]
        return (
            bool(table)
            and self._seq_lens[seq_id] % self.block_size != 0
            and self.allocator.ref_count(table[-1]) > 1
        )

    def _new_blocks(self, seq_id: int, num_tokens: int) -> int:
        return math.ceil((self._seq_lens[seq_id] + num_tokens) / self.block_size) - len(self._tables[seq_id])

    def num_blocks_needed(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> int:
        """Blocks :meth:`reserve` would take: new blocks plus copy-on-write copies. ``w`` writers of a
        shared block with reference count ``r`` make ``min(w, r - 1)`` copies (the last holder writes in
        place)."""
        total = 0
        writers: dict[int, int] = {}
        for seq_id, num_new in zip(seq_ids, query_lens):
            self.seq_len(seq_id)
            total += self._new_blocks(seq_id, num_new)
            if num_new > 0 and self._needs_copy(seq_id):
                last = self._tables[seq_id][-1]
                writers[last] = writers.get(last, 0) + 1
        return total + sum(min(w, self.allocator.ref_count(b) - 1) for b, w in writers.items())

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self.can_reserve([seq_id], [num_tokens])

    def can_reserve(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> bool:
        """Whether :meth:`reserve` would succeed for the whole batch together."""
        if any(self.seq_len(s) + n > self.max_seq_len for s, n in zip(seq_ids, query_lens)):
            return False
        return self.num_blocks_needed(seq_ids, query_lens) <= self.allocator.num_free_blocks

    def reserve(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> list[tuple[int, int]]:
        """Make room for ``query_lens[i]`` more tokens of each sequence; all or nothing.

        Returns the ``(src, dst)`` block copies the cache must make first (copy-on-write).
        """
        if len(seq_ids) != len(query_lens) or not seq_ids:
            raise KVCoreError("reserve() needs one query length per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise KVCoreError(f"reserve() got a sequence twice: {list(seq_ids)}")
        for seq_id, num_new in zip(seq_ids, query_lens):
            if num_new <= 0:
                raise KVCoreError(f"sequence {seq_id}: query length must be positive, got {num_new}")
            have = self.seq_len(seq_id)
            if have + num_new > self.max_seq_len:
                raise ContextLengthError(
                    f"sequence {seq_id}: {have} + {num_new} tokens exceed the cache's max_seq_len {self.max_seq_len}"
                )
        needed, free = self.num_blocks_needed(seq_ids, query_lens), self.allocator.num_free_blocks
        if needed > free:
            raise OutOfBlocksError(
                f"KV cache: the batch of sequences {list(seq_ids)} needs {needed} more blocks, only {free} free"
            )
        copies = []
        for seq_id, num_new in zip(seq_ids, query_lens):
            table = self._tables[seq_id]
            if self._needs_copy(seq_id):
                old, new = table[-1], self._allocate()
                self.allocator.free(old)  # drops this sequence's hold; the other holders keep it
                table[-1] = new
                copies.append((old, new))
            for _ in range(self._new_blocks(seq_id, num_new)):
                table.append(self._allocate())
            self._seq_lens[seq_id] += num_new
        return copies

    def _allocate(self) -> int:
        block_id = self.allocator.allocate()
        stale = self._key_of.pop(block_id, None)  # its old content is about to be overwritten
        if stale is not None:
            del self._block_of[stale[0]]
        return block_id

    # -- prefix keys ---------------------------------------------------------------------------------
    def _match_prefix(self, root: bytes, token_ids: Sequence[int]) -> list[int]:
        table, parent, bs = [], root, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_key(parent, tokens)
            block_id = self._block_of.get(parent)
            # a key match alone is not trusted: the stored tokens must be the same too
            if block_id is None or self._key_of[block_id][1] != tokens:
                break
            table.append(block_id)
        return table

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record the chained keys of ``seq_id``'s newly full blocks once their K/V are written
        (``token_ids``: the sequence's tokens so far). Incremental; a no-op without prefix caching."""
        if not self.enable_prefix_caching:
            return
        table, bs = self._tables[seq_id], self.block_size
        done, parent = self._committed.get(seq_id, (0, self._roots[seq_id]))
        num_full = min(len(token_ids), self._seq_lens[seq_id]) // bs
        for i in range(done, num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_key(parent, tokens)
            if table[i] not in self._key_of and parent not in self._block_of:
                self._key_of[table[i]], self._block_of[parent] = (parent, tokens), table[i]
        self._committed[seq_id] = (max(done, num_full), parent)
