"""KV blocks, owned by the core: allocation, reference counts, copy-on-write, prefix hashes and sliding windows.

Every cache layout is addressed in blocks (a per-sequence layout has one block per sequence). A
sequence owns a *block table* per group of layers (:mod:`kvcore.scheduling.kv_groups`; one group unless
sliding-window layers give blocks back), the physical block ids holding its tokens in order: token ``p``
lives in block ``table[p // block_size]`` at offset ``p % block_size``. A sequence of ``n`` tokens has
``ceil(n / block_size)`` entries in every table; all groups take their blocks from one pool.

Sliding windows
    A window group gives back the blocks its next query can no longer read (:meth:`BlockManager.slide`);
    a given-back entry reads as block 0 in :meth:`~BlockManager.block_table` (the window masks it).

Sharing
    :meth:`BlockManager.fork_sequence` gives the child every block of the parent (reference count +1).
    Blocks are copy-on-write: before a sequence writes into a block another sequence also holds (only
    ever its partly filled last block), :meth:`~BlockManager.reserve` takes a fresh block, swaps it
    into the writer's table and returns the ``(src, dst)`` pair for the cache to copy.

Prefix keys
    A full block is identified by a SHA-256 key chained from the start of the sequence: ``k_0 =
    sha256(namespace, cache salt)``, ``k_i = sha256(k_{i-1}, token bytes of block i)``. The namespace names
    what else changes the K/V (model, dtype, weight format, cache layout) and the optional per-request
    cache salt keeps tenants apart: requests with different salts never share a block. With
    ``enable_prefix_caching`` the blocks of a new sequence whose prompt starts with already computed full
    blocks are shared instead of recomputed (:class:`~kvcore.scheduling.prefix_index.PrefixIndex`: per
    group, a window group needing only the blocks its next query reads). A freed block keeps its key until
    it is handed out again; the free list is in least-recently-freed order, so eviction is LRU.

All-or-nothing
    :meth:`~BlockManager.reserve` counts the blocks the whole batch needs (new blocks plus copy-on-write
    copies, in every group) before taking any; when they are not all free it raises and no table changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcore.errors import ConfigError, ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.scheduling.block_pool import BlockAllocator, root_key
from kvcore.scheduling.kv_groups import first_live_block, peak_blocks
from kvcore.scheduling.prefix_index import PrefixIndex

__all__ = ["BlockManager"]


class BlockManager:
    """Block tables of the live sequences over one :class:`BlockAllocator`; ``windows``: one entry per
    group of layers, its sliding window (None: full attention)."""

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int, *, enable_prefix_caching: bool = False,
                 namespace: str = "", windows: Sequence[int | None] = (None,)) -> None:
        if block_size <= 0 or max_seq_len <= 0:
            raise ConfigError(f"block manager: block_size {block_size} and max_seq_len {max_seq_len} must be > 0")
        if not windows:
            raise ConfigError("block manager: needs at least one group of layers")
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.windows = tuple(windows)
        self.allocator = BlockAllocator(num_blocks, lowest_first=block_size >= max_seq_len)
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace  # what the K/V depend on besides tokens and salt (see root_key)
        #: seq -> one table per group; None: a block the group's window gave back
        self._tables: dict[int, list[list[int | None]]] = {}
        self._seq_lens: dict[int, int] = {}
        self._roots: dict[int, bytes] = {}  # seq -> the root key of its chain (namespace and cache salt)
        self._index = PrefixIndex()
        self._committed: dict[int, tuple[int, bytes]] = {}  # seq -> (full blocks keyed, last chained key)

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:  # whether some group gives blocks back as its window slides
        return any(w is not None for w in self.windows)

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

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """``seq_id``'s table in ``group``; a given-back entry reads block 0 (the window masks its keys)."""
        self.seq_len(seq_id)
        return [0 if b is None else b for b in self._tables[seq_id][group]]

    def held_blocks(self, seq_id: int) -> list[list[int]]:
        """The blocks ``seq_id`` holds, per group (given-back entries left out)."""
        self.seq_len(seq_id)
        return [[b for b in table if b is not None] for table in self._tables[seq_id]]

    def num_tokens_held(self, seq_id: int) -> list[int]:
        """Per group: the tokens ``seq_id`` still holds the K/V of (less the given-back blocks)."""
        n = self.seq_len(seq_id)
        return [n - table.count(None) * self.block_size for table in self._tables[seq_id]]

    def num_reserved_slots(self, seq_id: int) -> int:
        """Slots held by ``seq_id`` but not holding a token: ``blocks * block_size - seq_len``."""
        return len(self._tables[seq_id][0]) * self.block_size - self.seq_len(seq_id)

    @property
    def num_tokens_in_use(self) -> int:
        return sum(self._seq_lens.values())

    def min_blocks_for(self, num_tokens: int) -> int:
        """The fewest blocks a sequence of ``num_tokens`` ever needs at once (its window groups computing it
        one token at a time): more than :attr:`num_blocks` and it can never run."""
        return peak_blocks(self.windows, num_tokens, self.block_size, chunk=1)

    def num_tokens_fitting(self, seq_id: int, num_free: int) -> int:
        """Tokens ``seq_id`` can append with ``num_free`` free blocks (every group takes one block per
        ``block_size`` tokens; copy-on-write copies not counted)."""
        return self.num_reserved_slots(seq_id) + max(0, num_free) // self.num_groups * self.block_size

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
        num_hit, tables = 0, [[] for _ in self.windows]
        if self.enable_prefix_caching:
            self._roots[seq_id] = root_key(self.namespace, cache_salt)
            num_hit, tables = self._index.match(self._roots[seq_id], token_ids, self.windows, self.block_size)
        for block_id in (b for table in tables for b in table if b is not None):
            self.allocator.incref(block_id, revive=True)
        self._tables[seq_id] = tables
        self._seq_lens[seq_id] = num_hit * self.block_size
        return self._seq_lens[seq_id]

    def free_sequence(self, seq_id: int) -> None:
        self.seq_len(seq_id)
        tables = self._tables.pop(seq_id)
        # Last block first: LRU then evicts a prefix's tail before its head, which keeps the head reusable.
        for i in reversed(range(len(tables[0]))):
            for table in tables:
                if table[i] is not None:
                    self.allocator.free(table[i])
        del self._seq_lens[seq_id]
        self._committed.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def fork_sequence(self, src_seq_id: int, dst_seq_id: int) -> None:
        """``dst`` shares all of ``src``'s blocks (copy-on-write); takes no block now."""
        length = self.seq_len(src_seq_id)
        if dst_seq_id in self._seq_lens:
            raise KVCoreError(f"sequence {dst_seq_id} is already in the KV cache")
        tables = [list(t) for t in self._tables[src_seq_id]]
        for block_id in (b for table in tables for b in table if b is not None):
            self.allocator.incref(block_id)
        self._tables[dst_seq_id] = tables
        self._seq_lens[dst_seq_id] = length
        if src_seq_id in self._roots:
            self._roots[dst_seq_id] = self._roots[src_seq_id]

    def slide(self, seq_id: int, num_computed: int) -> None:
        """``seq_id``'s first ``num_computed`` tokens are computed and its next query is at that position:
        each window group gives back the blocks that query can no longer read. Never called past what a
        rollback may return to (the scheduler passes the committed count)."""
        for window, table in zip(self.windows, self._tables[seq_id]):
            # given-back entries are always a prefix of the table: walk back to it, not from the start
            i = min(first_live_block(num_computed, window, self.block_size), len(table)) - 1
            while i >= 0 and table[i] is not None:
                self.allocator.free(table[i])
                table[i] = None
                i -= 1

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Undo a reservation: keep the first ``num_tokens`` tokens (whose K/V were written before) and give
        back the blocks past them. A forward that failed after :meth:`reserve` is rolled back this way."""
        if not 0 <= num_tokens <= self.seq_len(seq_id):
            raise KVCoreError(f"sequence {seq_id}: cannot truncate {self.seq_len(seq_id)} tokens to {num_tokens}")
        keep = math.ceil(num_tokens / self.block_size)
        tables = self._tables[seq_id]
        if any(None in table[first_live_block(num_tokens, w, self.block_size) : keep]
               for w, table in zip(self.windows, tables)):  # checked in every group before any changes
            raise KVCoreError(f"sequence {seq_id}: cannot truncate to {num_tokens} tokens: their window's "
                              "blocks were given back")
        for table in tables:
            while len(table) > keep:
                block_id = table.pop()
                if block_id is not None:
                    self.allocator.free(block_id)
        self._seq_lens[seq_id] = num_tokens
        if self._committed.get(seq_id, (0, b""))[0] > keep:
            del self._committed[seq_id]  # the next commit re-walks the chain over the blocks now in the table

    # -- reservation ---------------------------------------------------------------------------------
    def _shared_last(self, seq_id: int) -> list[int]:
        """The shared, partly filled last blocks (one per group at most) the next write of ``seq_id`` must
        copy first."""
        if self._seq_lens[seq_id] % self.block_size == 0:
            return []
        lasts = [table[-1] for table in self._tables[seq_id] if table and table[-1] is not None]
        return [b for b in lasts if self.allocator.ref_count(b) > 1]

    def _new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """New entries each group's table takes for ``num_tokens`` more tokens."""
        return math.ceil((self._seq_lens[seq_id] + num_tokens) / self.block_size) - len(self._tables[seq_id][0])

    def num_blocks_needed(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> int:
        """Blocks :meth:`reserve` would take: new blocks plus copy-on-write copies, in every group. ``w``
        writers of a shared block with reference count ``r`` make ``min(w, r - 1)`` copies (the last holder
        writes in place)."""
        total = 0
        writers: dict[int, int] = {}
        for seq_id, num_new in zip(seq_ids, query_lens):
            self.seq_len(seq_id)
            total += self._new_blocks(seq_id, num_new) * self.num_groups
            if num_new > 0:
                for last in self._shared_last(seq_id):
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
            shared = set(self._shared_last(seq_id))
            num_blocks = self._new_blocks(seq_id, num_new)
            for table in self._tables[seq_id]:
                if table and table[-1] in shared:
                    old, new = table[-1], self._allocate()
                    self.allocator.free(old)  # drops this sequence's hold; the other holders keep it
                    table[-1] = new
                    copies.append((old, new))
                for _ in range(num_blocks):
                    table.append(self._allocate())
            self._seq_lens[seq_id] += num_new
        return copies

    def _allocate(self) -> int:
        block_id = self.allocator.allocate()
        self._index.forget(block_id)  # its old content is about to be overwritten
        return block_id

    # -- prefix keys ---------------------------------------------------------------------------------
    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record the chained keys of ``seq_id``'s newly full blocks once their K/V are written
        (``token_ids``: the sequence's tokens so far). Incremental; a no-op without prefix caching."""
        if not self.enable_prefix_caching:
            return
        done, parent = self._committed.get(seq_id, (0, self._roots[seq_id]))
        num_full = min(len(token_ids), self._seq_lens[seq_id]) // self.block_size
        parent = self._index.add_blocks(self._tables[seq_id], token_ids, done, num_full, parent, self.block_size)
        self._committed[seq_id] = (max(done, num_full), parent)
