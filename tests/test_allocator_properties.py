"""Stateful property tests of the block allocator and the paged KV cache's block bookkeeping.

Random programs of add / append(n) / batched append / fork / free run against a small paged cache (CPU,
one layer, one KV head of width 1) next to a plain-Python model of every sequence's content. Each token
written gets a unique value, so reading a sequence back proves no other sequence's write (and no
copy-on-write) corrupted it. After every step the block accounting invariants are checked.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.backends.paged import BlockAllocator, PagedKVCache
from kvcore.errors import ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.kv_cache import CacheSpec

SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~2x faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a dict model of reference counts."""

    NUM_BLOCKS = 6

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(self.NUM_BLOCKS)
        self.refs: Counter[int] = Counter()

    @rule()
    def allocate(self):
        if len(self.refs) == self.NUM_BLOCKS:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate()
            return
        b = self.alloc.allocate()
        assert b not in self.refs
        self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.incref(b)
        self.refs[b] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.free(b)
        self.refs[b] -= 1
        if not self.refs[b]:
            del self.refs[b]

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def double_free_is_refused(self, b):
        if b in self.refs:
            return
        with pytest.raises(KVCoreError, match="double free"):
            self.alloc.free(b)

    @invariant()
    def counts_match(self):
        assert self.alloc.num_free_blocks + len(self.refs) == self.NUM_BLOCKS
        assert self.alloc.can_allocate(self.NUM_BLOCKS - len(self.refs))
        for b in range(self.NUM_BLOCKS):
            assert self.alloc.ref_count(b) == self.refs.get(b, 0)


class PagedCacheMachine(RuleBasedStateMachine):
    """A paged cache against a list-of-values model per sequence."""

    BLOCK_SIZE = 4
    NUM_BLOCKS = 12
    MAX_SEQ_LEN = 30

    def __init__(self):
        super().__init__()
        spec = CacheSpec(
            num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
            max_num_seqs=4, max_seq_len=self.MAX_SEQ_LEN, block_size=self.BLOCK_SIZE, num_blocks=self.NUM_BLOCKS,
        )
        self.cache = PagedKVCache(spec)
        self.model: dict[int, list[float]] = {}  # seq -> the K value of every cached token
        self.next_seq = 0
        self.next_value = 1.0

    def _append(self, seq_ids, lens):
        before = {s: (self.cache.seq_len(s), self.cache.block_table(s)) for s in self.model}
        free = self.cache.num_free_blocks
        fits = self.cache.can_prepare(seq_ids, lens)
        try:
            meta = self.cache.prepare(seq_ids, lens, 1.0)
        except (OutOfBlocksError, ContextLengthError):
            assert not fits
            # all-or-nothing: nobody's table, length or free count moved
            assert self.cache.num_free_blocks == free
            assert {s: (self.cache.seq_len(s), self.cache.block_table(s)) for s in self.model} == before
            return
        assert fits
        total = sum(lens)
        values = torch.arange(self.next_value, self.next_value + total)
        self.next_value += total
        kv = values[:, None, None]
        self.cache.write(0, kv, -kv, meta)
        start = 0
        for s, n in zip(seq_ids, lens):
            self.model[s].extend(values[start : start + n].tolist())
            start += n

    @rule()
    def add(self):
        if not self.cache.can_add_sequence():
            with pytest.raises(OutOfBlocksError):
                self.cache.add_sequence(self.next_seq)
            return
        self.cache.add_sequence(self.next_seq)
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
        self.cache.fork_sequence(src, self.next_seq)
        self.model[self.next_seq] = list(self.model[src])
        self.next_seq += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free_sequence(s)
        del self.model[s]
        with pytest.raises(KVCoreError):
            self.cache.free_sequence(s)

    @invariant()
    def blocks_are_accounted_for(self):
        cache, alloc = self.cache, self.cache.allocator
        holders = Counter()
        for s in self.model:
            table = cache.block_table(s)
            assert len(table) == len(set(table))  # a table never holds a block twice
            assert len(table) == math.ceil(cache.seq_len(s) / self.BLOCK_SIZE)
            assert 0 <= cache.num_reserved_slots(s) < self.BLOCK_SIZE or not table
            holders.update(table)
        for b in range(self.NUM_BLOCKS):
            assert alloc.ref_count(b) == holders.get(b, 0)  # also: every table entry has ref > 0
        assert alloc.num_free_blocks + len(holders) == self.NUM_BLOCKS  # nothing leaked
        assert len(set(alloc._free)) == len(alloc._free)  # no block freed twice into the pool

    @invariant()
    def contents_are_intact(self):
        assert sorted(self.cache.seq_ids) == sorted(self.model)
        for s, values in self.model.items():
            k, v = self.cache.read(0, s)
            assert k.flatten().tolist() == values
            assert v.flatten().tolist() == [-x for x in values]


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = SETTINGS
TestPagedCache = PagedCacheMachine.TestCase
TestPagedCache.settings = SETTINGS
