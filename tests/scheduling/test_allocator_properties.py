"""Stateful property tests of the block allocator and the core's block bookkeeping over real caches.

Random programs of add / append(n) / batched append / fork / free run against a small cache (CPU, one
layer, one KV head of width 1) driven through a :class:`~kvcore.scheduling.kv_manager.KVCacheManager`, next to a
plain-Python model of every sequence's content. Each token written gets a unique value, so reading a
sequence back proves no other sequence's write (and no copy-on-write) corrupted it. After every step the
block accounting invariants are checked. The same program runs on the paged cache (blocks of 4 tokens)
and on the contiguous cache (one block = one slot of ``max_seq_len`` tokens).

With prefix caching the value written for a token is a function of the whole prefix it ends (as a real
model's K/V are), so a block shared from the prefix cache must hold exactly what recomputing it would.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.backends.contiguous import ContiguousKVCache
from kvcore.backends.paged import PagedKVCache
from kvcore.errors import ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.interfaces.kv_cache import CacheSpec
from kvcore.scheduling.block_pool import BlockAllocator
from kvcore.scheduling.kv_manager import KVCacheManager

SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SMALL_SETTINGS = settings(SETTINGS, max_examples=30)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~2x faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_spec(*, max_num_seqs: int, max_seq_len: int, block_size: int, num_blocks: int | None) -> CacheSpec:
    return CacheSpec(
        num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
        max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks,
    )


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model of reference counts and of the free list's order: least recently
    freed first, or the lowest id first with ``lowest_first``."""

    NUM_BLOCKS = 6
    LOWEST_FIRST = False

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(self.NUM_BLOCKS, lowest_first=self.LOWEST_FIRST)
        self.refs: Counter[int] = Counter()
        self.free_order: list[int] = list(range(self.NUM_BLOCKS))  # front = handed out next (LRU)

    @rule()
    def allocate(self):
        if not self.free_order:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate()
            return
        expected = min(self.free_order) if self.LOWEST_FIRST else self.free_order[0]
        b = self.alloc.allocate()
        assert b == expected and b not in self.refs
        self.free_order.remove(b)
        self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.incref(b)
        self.refs[b] += 1

    @precondition(lambda self: self.free_order)
    @rule(data=st.data())
    def revive(self, data):
        """A prefix-cache hit takes a free block back out of the middle of the free list."""
        b = data.draw(st.sampled_from(self.free_order))
        with pytest.raises(KVCoreError):
            self.alloc.incref(b)  # plain sharing of a free block is refused
        self.alloc.incref(b, revive=True)
        self.free_order.remove(b)
        self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.free(b)
        self.refs[b] -= 1
        if not self.refs[b]:
            del self.refs[b]
            self.free_order.append(b)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def double_free_is_refused(self, b):
        if b in self.refs:
            return
        with pytest.raises(KVCoreError, match="double free"):
            self.alloc.free(b)

    @invariant()
    def counts_match(self):
        assert self.alloc.num_free_blocks + len(self.refs) == self.NUM_BLOCKS
        assert self.alloc.num_used_blocks == len(self.refs)
        assert self.alloc.can_allocate(self.NUM_BLOCKS - len(self.refs))
        assert not self.alloc.can_allocate(self.NUM_BLOCKS - len(self.refs) + 1)
        for b in range(self.NUM_BLOCKS):
            assert self.alloc.ref_count(b) == self.refs.get(b, 0)
            assert self.alloc.is_free(b) == (b in self.free_order)


class LowestFirstAllocatorMachine(AllocatorMachine):
    LOWEST_FIRST = True


class CacheMachine(RuleBasedStateMachine):
    """A cache behind a KVCacheManager against a list-of-values model per sequence."""

    BLOCK_SIZE = 4
    NUM_BLOCKS = 12
    MAX_SEQ_LEN = 30

    def make_cache(self):
        spec = tiny_spec(max_num_seqs=4, max_seq_len=self.MAX_SEQ_LEN, block_size=self.BLOCK_SIZE,
                         num_blocks=self.NUM_BLOCKS)
        return PagedKVCache(spec)

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.make_cache())
        self.block_size = self.kv.cache.block_size  # a slot layout: one block of max_seq_len
        self.model: dict[int, list[float]] = {}  # seq -> the K value of every cached token
        self.next_seq = 0
        self.next_value = 1.0

    def _state(self):
        blocks = self.kv.blocks
        return {s: (blocks.seq_len(s), blocks.block_table(s)) for s in self.model}, blocks.num_free_blocks

    def _append(self, seq_ids, lens):
        before = self._state()
        fits = self.kv.can_reserve(seq_ids, lens)
        try:
            meta = self.kv.prepare(seq_ids, lens, 1.0)
        except (OutOfBlocksError, ContextLengthError):
            assert not fits
            # all-or-nothing: nobody's table, length or free count moved
            assert self._state() == before
            return
        assert fits
        assert meta.block_tables == [self.kv.blocks.block_table(s) for s in seq_ids]
        total = sum(lens)
        values = torch.arange(self.next_value, self.next_value + total)
        self.next_value += total
        kv = values[:, None, None]
        self.kv.cache.write(0, kv, -kv, meta)
        start = 0
        for s, n in zip(seq_ids, lens):
            self.model[s].extend(values[start : start + n].tolist())
            start += n

    @rule()
    def add(self):
        if not self.kv.can_add_sequence():
            return  # the scheduler never adds a sequence then; its first token would have no block
        self.kv.add_sequence(self.next_seq)
        assert self.kv.seq_len(self.next_seq) == 0 and self.kv.blocks.block_table(self.next_seq) == []
        self.model[self.next_seq] = []
        self.next_seq += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self._append([s], [n])

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def append_batch(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=2, max_size=4, unique=True))
        lens = data.draw(st.lists(st.integers(1, 6), min_size=len(seqs), max_size=len(seqs)))
        self._append(seqs, lens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.model)))
        free = self.kv.blocks.num_free_blocks
        self.kv.fork_sequence(src, self.next_seq)
        assert self.kv.blocks.num_free_blocks == free  # a fork takes no block
        self.model[self.next_seq] = list(self.model[src])
        self.next_seq += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.kv.free_sequence(s)
        del self.model[s]
        with pytest.raises(KVCoreError):
            self.kv.free_sequence(s)

    @invariant()
    def blocks_are_accounted_for(self):
        blocks, alloc = self.kv.blocks, self.kv.blocks.allocator
        holders = Counter()
        for s in self.model:
            table = blocks.block_table(s)
            assert len(table) == len(set(table))  # a table never holds a block twice
            assert len(table) == math.ceil(blocks.seq_len(s) / self.block_size)
            assert 0 <= blocks.num_reserved_slots(s) < self.block_size or not table
            holders.update(table)
        for b in range(self.kv.cache.num_blocks):
            assert alloc.ref_count(b) == holders.get(b, 0)  # also: every table entry has ref > 0
        assert alloc.num_free_blocks + len(holders) == self.kv.cache.num_blocks  # nothing leaked
        assert blocks.num_tokens_in_use == sum(len(v) for v in self.model.values())

    @invariant()
    def contents_are_intact(self):
        assert sorted(self.kv.blocks.seq_ids) == sorted(self.model)
        for s, values in self.model.items():
            k, v = self.kv.read(0, s)
            assert k.flatten().tolist() == values
            assert v.flatten().tolist() == [-x for x in values]


class ContiguousCacheMachine(CacheMachine):
    """The same program on the slot layout: a fork shares the slot, the first write copies all of it."""

    def make_cache(self):
        return ContiguousKVCache(tiny_spec(max_num_seqs=4, max_seq_len=self.MAX_SEQ_LEN, block_size=16,
                                           num_blocks=None))


class PrefixCachingMachine(RuleBasedStateMachine):
    """Prefix caching on a paged cache. Prompts come from a two-token alphabet and blocks hold 2 tokens,
    so prefixes repeat often; every freed, revived, evicted or shared block is checked by content."""

    BLOCK_SIZE = 2
    NUM_BLOCKS = 10
    MAX_SEQ_LEN = 16
    TOKENS = st.lists(st.integers(1, 2), min_size=1, max_size=7)

    def __init__(self):
        super().__init__()
        spec = tiny_spec(max_num_seqs=4, max_seq_len=self.MAX_SEQ_LEN, block_size=self.BLOCK_SIZE,
                         num_blocks=self.NUM_BLOCKS)
        self.kv = KVCacheManager(PagedKVCache(spec), enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids, all computed and committed
        self.value_of: dict[tuple[int, ...], float] = {}  # prefix -> the K value of its last token
        self.next_seq = 0

    def _value(self, prefix: tuple[int, ...]) -> float:
        return self.value_of.setdefault(prefix, float(len(self.value_of) + 1))

    def _compute(self, seq_ids: list[int], new_tokens: list[list[int]]) -> bool:
        """Append and "compute" ``new_tokens[i]`` for each sequence, then commit; False if it did not fit."""
        lens = [len(t) for t in new_tokens]
        before = {s: self.kv.blocks.block_table(s) for s in self.tokens}, self.kv.blocks.num_free_blocks
        if not self.kv.can_reserve(seq_ids, lens):
            with pytest.raises((OutOfBlocksError, ContextLengthError)):
                self.kv.prepare(seq_ids, lens, 1.0)
            assert ({s: self.kv.blocks.block_table(s) for s in self.tokens}, self.kv.blocks.num_free_blocks) == before
            return False
        meta = self.kv.prepare(seq_ids, lens, 1.0)
        values = []
        for s, new in zip(seq_ids, new_tokens):
            self.tokens[s] = self.tokens[s] + new
            n = len(self.tokens[s])
            values += [self._value(tuple(self.tokens[s][: p + 1])) for p in range(n - len(new), n)]
        kv = torch.tensor(values)[:, None, None]
        self.kv.cache.write(0, kv, -kv, meta)
        for s in seq_ids:
            self.kv.blocks.commit(s, self.tokens[s])
        return True

    @rule(prompt=TOKENS)
    def add(self, prompt):
        if not self.kv.can_add_sequence():
            return
        seq = self.next_seq
        self.next_seq += 1
        cached = self.kv.add_sequence(seq, prompt)
        assert cached % self.BLOCK_SIZE == 0 and cached <= len(prompt) - 1  # never the last token's block
        assert self.kv.seq_len(seq) == cached
        assert all(tuple(prompt[: p + 1]) in self.value_of for p in range(cached))  # computed before
        self.tokens[seq] = prompt[:cached]
        if not self._compute([seq], [prompt[cached:]]):
            self.kv.free_sequence(seq)  # what the scheduler does when a prompt does not fit
            del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True))
        self._compute(seqs, [data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=3)) for _ in seqs])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.fork_sequence(src, self.next_seq)
        self.tokens[self.next_seq] = list(self.tokens[src])
        self.next_seq += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free_sequence(s)
        del self.tokens[s]

    @invariant()
    def contents_are_what_recomputing_gives(self):
        assert sorted(self.kv.blocks.seq_ids) == sorted(self.tokens)
        holders = Counter()
        for s, tokens in self.tokens.items():
            expected = [self._value(tuple(tokens[: p + 1])) for p in range(len(tokens))]
            k, v = self.kv.read(0, s)
            assert k.flatten().tolist() == expected
            assert v.flatten().tolist() == [-x for x in expected]
            holders.update(self.kv.blocks.block_table(s))
        alloc = self.kv.blocks.allocator
        assert all(alloc.ref_count(b) == holders.get(b, 0) for b in range(self.NUM_BLOCKS))


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = SETTINGS
TestLowestFirstAllocator = LowestFirstAllocatorMachine.TestCase
TestLowestFirstAllocator.settings = SMALL_SETTINGS
TestPagedCache = CacheMachine.TestCase
TestPagedCache.settings = SETTINGS
TestContiguousCache = ContiguousCacheMachine.TestCase
TestContiguousCache.settings = SMALL_SETTINGS
TestPrefixCaching = PrefixCachingMachine.TestCase
TestPrefixCaching.settings = SETTINGS
