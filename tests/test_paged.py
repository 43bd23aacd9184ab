"""The paged backend and cache against the naive backend (the oracle) on a contiguous cache."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcore.backends.naive import NaiveBackend
from kvcore.backends.paged import BLOCK_TABLE_PAD, BlockAllocator, PagedBackend, PagedKVCache
from kvcore.errors import ConfigError, ContextLengthError, KVCoreError, OutOfBlocksError
from kvcore.kv_cache import CacheSpec, ContiguousKVCache, create_cache
from kvcore.plugins import BackendRegistry

CPU = torch.device("cpu")
FP32_ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is ~2x faster than two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_spec(num_kv_heads=2, head_dim=32, *, layers=2, max_num_seqs=4, max_seq_len=160, block_size=16,
              num_blocks=None, dtype=torch.float32) -> CacheSpec:
    return CacheSpec(
        num_layers=layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=CPU,
        max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, block_size=block_size, num_blocks=num_blocks,
    )


def shuffle_pool(cache: PagedKVCache, seed: int = 0) -> None:
    """Take every block and give them back in random order, so later tables are non-contiguous."""
    blocks = [cache.allocator.allocate() for _ in range(cache.num_blocks)]
    random.Random(seed).shuffle(blocks)
    for b in blocks:
        cache.allocator.free(b)


class Pair:
    """The paged backend on a paged cache next to the naive backend on a contiguous cache."""

    def __init__(self, num_heads, num_kv_heads, head_dim, *, block_size=16, dtype=torch.float32, shuffle=True,
                 **spec_kw):
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        spec = make_spec(num_kv_heads, head_dim, block_size=block_size, dtype=dtype, **spec_kw)
        self.paged_backend = PagedBackend(block_size=block_size)
        self.naive_backend = NaiveBackend()
        self.paged = self.paged_backend.create_cache(spec)
        self.contig = ContiguousKVCache(spec)
        if shuffle:
            shuffle_pool(self.paged)
        self.gen = torch.Generator().manual_seed(1234)

    def add(self, *seq_ids):
        for s in seq_ids:
            self.paged.add_sequence(s)
            self.contig.add_sequence(s)

    def fork(self, src, dst):
        self.paged.fork_sequence(src, dst)
        self.contig.fork_sequence(src, dst)

    def step(self, seq_ids, query_lens, atol=FP32_ATOL):
        scale = self.head_dim**-0.5
        mp = self.paged.prepare(seq_ids, query_lens, scale)
        mc = self.contig.prepare(seq_ids, query_lens, scale)
        total = sum(query_lens)
        for layer in range(self.paged.spec.num_layers):
            q = torch.randn(total, self.num_heads, self.head_dim, generator=self.gen).to(self.dtype)
            k = torch.randn(total, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
            v = torch.randn(total, self.num_kv_heads, self.head_dim, generator=self.gen).to(self.dtype)
            out = self.paged_backend.forward(layer, q, k, v, self.paged, mp)
            ref = self.naive_backend.forward(layer, q, k, v, self.contig, mc)
            assert out.shape == q.shape and out.dtype == q.dtype
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
        return mp

    def check_contents(self):
        for s in self.paged.seq_ids:
            assert self.paged.seq_len(s) == self.contig.seq_len(s)
            for layer in range(self.paged.spec.num_layers):
                kp, vp = self.paged.read(layer, s)
                kc, vc = self.contig.read(layer, s)
                assert torch.equal(kp, kc) and torch.equal(vp, vc)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_naive_prefill_decode_continue(num_heads, num_kv_heads, head_dim):
    bs = 16
    pair = Pair(num_heads, num_kv_heads, head_dim, block_size=bs)
    pair.add(0, 1, 2, 3)
    # ragged prefill hitting every block-boundary case
    pair.step([0, 1, 2, 3], [1, bs - 1, bs, bs + 1])
    for _ in range(3):
        pair.step([0, 1, 2, 3], [1, 1, 1, 1])  # decode
    pair.step([0, 1, 2, 3], [3, bs + 2, 1, 2 * bs])  # prefill continuing the cache, mixed with a 1-token row
    pair.step([2, 0], [1, 1])  # decode of a subset, order swapped
    pair.check_contents()
    tables = [pair.paged.block_table(s) for s in range(4)]
    assert any(t != sorted(t) or any(b - a != 1 for a, b in zip(t, t[1:])) for t in tables), tables


def test_decode_against_long_caches():
    pair = Pair(8, 2, 64, block_size=16, max_seq_len=400, layers=1)
    pair.add(0, 1, 2)
    pair.step([0, 1, 2], [300, 17, 129])
    for _ in range(2):
        pair.step([0, 1, 2], [1, 1, 1])
    pair.check_contents()


def test_single_token_prompts_use_the_decode_path():
    pair = Pair(4, 2, 32, layers=1)
    pair.add(0, 1)
    pair.step([0, 1], [1, 1])  # context 0, query 1: every key is visible
    pair.step([0, 1], [1, 1])


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_half_precision_close_to_naive(dtype, atol):
    pair = Pair(8, 2, 64, dtype=dtype, layers=1)
    pair.add(0, 1)
    pair.step([0, 1], [20, 33], atol=atol)
    pair.step([0, 1], [1, 1], atol=atol)
    pair.step([0, 1], [5, 1], atol=atol)


def test_block_size_one_and_large():
    for bs in (1, 64):
        pair = Pair(4, 2, 32, block_size=bs, layers=1)
        pair.add(0, 1)
        pair.step([0, 1], [7, 70])
        pair.step([0, 1], [1, 1])
        pair.check_contents()


# -- cache accounting ------------------------------------------------------------------------------------


def test_reserved_slots_bounded_and_all_blocks_returned():
    bs = 16
    cache = PagedKVCache(make_spec(block_size=bs, max_num_seqs=6))
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 50]
    for s in range(len(lens)):
        cache.add_sequence(s)
    cache.prepare(list(range(len(lens))), lens, 1.0)
    cache.prepare([0, 3, 5], [1, bs, 30], 1.0)
    for s in range(len(lens)):
        n = cache.seq_len(s)
        assert len(cache.block_table(s)) == math.ceil(n / bs)
        assert 0 <= cache.num_reserved_slots(s) <= bs - 1
    used = sum(len(cache.block_table(s)) for s in range(len(lens)))
    assert cache.num_free_blocks == cache.num_blocks - used
    for s in range(len(lens)):
        cache.free_sequence(s)
    assert cache.num_free_blocks == cache.num_blocks
    assert all(cache.allocator.ref_count(b) == 0 for b in range(cache.num_blocks))


def test_num_blocks_default_and_explicit():
    spec = make_spec(max_num_seqs=3, max_seq_len=100, block_size=16)
    cache = PagedKVCache(spec)
    assert cache.num_blocks == math.ceil(3 * 100 / 16)
    assert cache.k_pool.shape == (2, cache.num_blocks, 16, 2, 32) == cache.v_pool.shape
    assert cache.kv_bytes_allocated == 2 * cache.k_pool.numel() * 4
    assert PagedKVCache(make_spec(num_blocks=7)).num_blocks == 7
    assert isinstance(create_cache("paged", spec), PagedKVCache)


def test_cache_meta_addressing():
    bs = 4
    cache = PagedKVCache(make_spec(block_size=bs, num_blocks=20))
    shuffle_pool(cache, seed=3)
    cache.add_sequence(10)
    cache.add_sequence(11)
    cache.prepare([10], [2], 1.0)
    meta = cache.prepare([11, 10], [9, 3], 1.0)  # seq 11: 3 blocks, seq 10: 2 blocks (padded)
    cm = meta.cache_meta
    t10, t11 = cache.block_table(10), cache.block_table(11)
    assert cm.block_tables.dtype == torch.int32 and cm.block_tables.shape == (2, 3)
    assert cm.block_tables.tolist() == [t11, t10 + [BLOCK_TABLE_PAD]]
    assert cm.slot_mapping.dtype == torch.int64
    expected = [t11[p // bs] * bs + p % bs for p in range(9)] + [t10[p // bs] * bs + p % bs for p in range(2, 5)]
    assert cm.slot_mapping.tolist() == expected
    assert cm.seq_lens.tolist() == [9, 5]


def test_write_never_touches_other_sequences():
    cache = PagedKVCache(make_spec(num_kv_heads=1, head_dim=2, layers=1, block_size=4, num_blocks=12))
    shuffle_pool(cache, seed=5)
    for s in range(3):
        cache.add_sequence(s)
    meta = cache.prepare([0, 1, 2], [5, 2, 7], 1.0)
    vals = torch.arange(14, dtype=torch.float32)[:, None, None].expand(14, 1, 2)
    cache.write(0, vals, -vals, meta)
    assert cache.read(0, 0)[0][:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert cache.read(0, 1)[0][:, 0, 0].tolist() == [5, 6]
    assert cache.read(0, 2)[1][:, 0, 0].tolist() == [-7, -8, -9, -10, -11, -12, -13]


# -- fork / copy-on-write --------------------------------------------------------------------------------


def test_fork_shares_blocks_and_copies_on_write():
    bs = 16
    cache = PagedKVCache(make_spec(block_size=bs, num_blocks=10, layers=2))
    cache.add_sequence(0)
    meta = cache.prepare([0], [20], 1.0)
    for layer in range(2):
        cache.write(layer, torch.randn(20, 2, 32), torch.randn(20, 2, 32), meta)
    parent_before = [cache.read(layer, 0) for layer in range(2)]
    free_before = cache.num_free_blocks

    cache.fork_sequence(0, 1)
    shared = cache.block_table(0)
    assert cache.block_table(1) == shared and cache.seq_len(1) == 20
    assert [cache.allocator.ref_count(b) for b in shared] == [2, 2]
    assert cache.num_free_blocks == free_before  # a fork takes no block

    meta = cache.prepare([1], [1], 1.0)  # the child writes into the shared, partly filled last block
    for layer in range(2):
        cache.write(layer, torch.full((1, 2, 32), 7.0), torch.full((1, 2, 32), 8.0), meta)
    child = cache.block_table(1)
    assert child[0] == shared[0] and child[1] != shared[1]
    assert cache.block_table(0) == shared
    assert cache.allocator.ref_count(shared[0]) == 2  # the full prefix block stays shared
    assert cache.allocator.ref_count(shared[1]) == 1 and cache.allocator.ref_count(child[1]) == 1
    assert cache.num_free_blocks == free_before - 1
    for layer in range(2):
        kp, vp = cache.read(layer, 0)
        assert torch.equal(kp, parent_before[layer][0]) and torch.equal(vp, parent_before[layer][1])
        kc, vc = cache.read(layer, 1)
        assert torch.equal(kc[:20], kp) and torch.equal(vc[:20], vp)  # the copy carried the prefix
        assert torch.all(kc[20] == 7.0) and torch.all(vc[20] == 8.0)

    # the parent now holds its last block alone: it writes in place, no copy
    cache.prepare([0], [1], 1.0)
    assert cache.block_table(0) == shared and cache.num_free_blocks == free_before - 1

    cache.free_sequence(0)
    assert cache.allocator.ref_count(shared[0]) == 1
    cache.free_sequence(1)
    assert cache.num_free_blocks == cache.num_blocks


def test_fork_at_block_boundary_needs_no_copy():
    cache = PagedKVCache(make_spec(block_size=8, num_blocks=6))
    cache.add_sequence(0)
    cache.prepare([0], [16], 1.0)
    cache.fork_sequence(0, 1)
    table = cache.block_table(0)
    cache.prepare([1], [1], 1.0)
    assert cache.block_table(1)[:2] == table and len(cache.block_table(1)) == 3
    assert [cache.allocator.ref_count(b) for b in table] == [2, 2]


def test_fork_then_decode_both_matches_naive():
    """Parent and child both write into the shared last block in one call: one copy, not two."""
    pair = Pair(8, 2, 32, block_size=16)
    pair.add(0)
    pair.step([0], [21])
    pair.fork(0, 1)
    free = pair.paged.num_free_blocks
    assert pair.paged.num_blocks_needed([0, 1], [1, 1]) == 1
    pair.step([0, 1], [1, 1])
    assert pair.paged.num_free_blocks == free - 1
    pair.step([1, 0], [3, 12])  # both cross into new blocks
    pair.fork(1, 2)
    pair.step([2, 1, 0], [1, 1, 1])
    pair.check_contents()


def test_fork_errors():
    cache = PagedKVCache(make_spec())
    cache.add_sequence(0)
    with pytest.raises(KVCoreError):
        cache.fork_sequence(0, 0)
    with pytest.raises(KVCoreError):
        cache.fork_sequence(5, 6)


# -- out of blocks ---------------------------------------------------------------------------------------


def _snapshot(cache):
    return {
        s: (cache.seq_len(s), cache.block_table(s), [t.clone() for layer in range(cache.spec.num_layers)
                                                     for t in cache.read(layer, s)])
        for s in cache.seq_ids
    }


def _assert_same(cache, snap, free):
    assert cache.num_free_blocks == free
    assert set(cache.seq_ids) == set(snap)
    for s, (n, table, tensors) in snap.items():
        assert cache.seq_len(s) == n and cache.block_table(s) == table
        now = [t for layer in range(cache.spec.num_layers) for t in cache.read(layer, s)]
        assert all(torch.equal(a, b) for a, b in zip(now, tensors))


def test_out_of_blocks_leaves_every_sequence_intact():
    bs = 4
    cache = PagedKVCache(make_spec(block_size=bs, num_blocks=6, max_seq_len=100))
    for s in range(3):
        cache.add_sequence(s)
    meta = cache.prepare([0, 1, 2], [5, 4, 3], 1.0)  # 2 + 1 + 1 blocks: 2 left
    cache.write(0, torch.randn(12, 2, 32), torch.randn(12, 2, 32), meta)
    cache.fork_sequence(0, 3)  # shares seq 0's partly filled last block
    snap, free = _snapshot(cache), cache.num_free_blocks
    assert free == 2

    # one sequence alone does not fit: caught by the per-sequence check
    assert not cache.can_append(1, 13)
    with pytest.raises(OutOfBlocksError):
        cache.prepare([1, 2], [1, 13], 1.0)
    _assert_same(cache, snap, free)

    # each fits alone but not together: 1 (seq 1) + 1 (seq 2) + 1 copy-on-write (seq 3) > 2
    assert all(cache.can_append(s, n) for s, n in [(1, 1), (2, 2), (3, 1)])
    assert not cache.can_prepare([1, 2, 3], [1, 2, 1])
    with pytest.raises(OutOfBlocksError):
        cache.prepare([1, 2, 3], [1, 2, 1], 1.0)
    _assert_same(cache, snap, free)

    # past max_seq_len is a context-length error, also without side effects
    with pytest.raises(ContextLengthError):
        cache.prepare([2], [98], 1.0)
    _assert_same(cache, snap, free)

    assert cache.can_prepare([1, 2], [1, 2])
    cache.prepare([1, 2], [1, 2], 1.0)
    assert cache.num_free_blocks == 0
    assert not cache.can_add_sequence()
    with pytest.raises(OutOfBlocksError):
        cache.add_sequence(9)


# -- allocator -------------------------------------------------------------------------------------------


def test_block_allocator():
    alloc = BlockAllocator(3)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    assert sorted([a, b, c]) == [0, 1, 2] and alloc.num_free_blocks == 0 and not alloc.can_allocate(1)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()
    alloc.incref(b)
    assert alloc.ref_count(b) == 2
    alloc.free(b)
    assert alloc.ref_count(b) == 1 and alloc.num_free_blocks == 0
    alloc.free(b)
    assert alloc.is_free(b) and alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(KVCoreError, match="double free"):
        alloc.free(b)
    with pytest.raises(KVCoreError):
        alloc.incref(b)
    with pytest.raises(KVCoreError):
        alloc.ref_count(3)
    assert alloc.allocate() == b
    with pytest.raises(ConfigError):
        BlockAllocator(0)


# -- options and registration ----------------------------------------------------------------------------


def test_block_size_option_overrides_the_spec():
    spec = make_spec(block_size=16)
    cache = PagedBackend(block_size=32).create_cache(spec)
    assert isinstance(cache, PagedKVCache) and cache.block_size == 32 and cache.spec.block_size == 32
    assert PagedBackend().create_cache(spec).block_size == 16


@pytest.mark.parametrize("bad", [0, -4, 1.5, "16", True])
def test_invalid_block_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="block_size"):
        PagedBackend(block_size=bad)


def test_unknown_options_are_config_errors():
    with pytest.raises(ConfigError):
        PagedBackend(blocksize=16)
    with pytest.raises(ConfigError, match="decode_impl"):
        PagedBackend(decode_impl="magic")


def test_registered_as_a_plugin():
    registry = BackendRegistry(load_entrypoints=False, builtins=("kvcore.backends.naive", "kvcore.backends.paged"))
    entry = registry.get("paged")
    assert entry.cls is PagedBackend and entry.plugin == "kvcore.backends.paged"
    assert PagedBackend.priority == 5 and PagedBackend.capabilities.cache_kinds == ("paged",)
    backend = registry.create("paged", {"block_size": 8})
    assert backend.block_size == 8
    assert backend.validate(device=CPU, dtype=torch.bfloat16, head_dim=64, num_heads=9, num_kv_heads=3) == []
